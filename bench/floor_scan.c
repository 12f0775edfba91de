/*
 * floor_scan.c - the reads any /proc-based discovery must make, in C with nothing else:
 * for every process, read /proc/PID/maps to the end and readlink every /proc/PID/fd entry.
 *
 *   floor_scan PREFIX        prints the PIDs that have an fd on, or a mapping of, a path
 *                            starting with PREFIX, one a line
 *
 * The benchmark times it next to gpugate to show how much of gpugate's discovery is the
 * kernel's work (this program's time) and how much is gpugate's own.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int maps_hold(int proc_fd, const char *pid, const char *prefix)
{
    char path[64], buf[65536];
    snprintf(path, sizeof(path), "%s/maps", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    int found = 0;
    size_t plen = strlen(prefix), keep = 0;
    ssize_t n;
    /* keep the last plen-1 bytes of each chunk: a match may straddle two reads */
    while ((n = read(fd, buf + keep, sizeof(buf) - keep)) > 0) {
        size_t len = keep + (size_t)n;
        if (memmem(buf, len, prefix, plen))
            found = 1;
        keep = len < plen ? len : plen - 1;
        memmove(buf, buf + len - keep, keep);
    }
    close(fd);
    return found;
}

static int fds_hold(int proc_fd, const char *pid, const char *prefix)
{
    char path[64], target[4096];
    snprintf(path, sizeof(path), "%s/fd", pid);
    int dir_fd = openat(proc_fd, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0)
        return 0;
    DIR *dir = fdopendir(dir_fd);
    if (!dir) {
        close(dir_fd);
        return 0;
    }
    int found = 0;
    size_t plen = strlen(prefix);
    struct dirent *entry;
    while ((entry = readdir(dir))) {
        if (entry->d_name[0] == '.')
            continue;
        ssize_t n = readlinkat(dir_fd, entry->d_name, target, sizeof(target));
        if (n >= (ssize_t)plen && !memcmp(target, prefix, plen))
            found = 1;
    }
    closedir(dir);
    return found;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s PREFIX\n", argv[0]);
        return 2;
    }
    int proc_fd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *proc = fdopendir(dup(proc_fd));
    if (proc_fd < 0 || !proc) {
        perror("/proc");
        return 1;
    }
    struct dirent *entry;
    while ((entry = readdir(proc))) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9')
            continue;
        int mapped = maps_hold(proc_fd, entry->d_name, argv[1]);
        if (fds_hold(proc_fd, entry->d_name, argv[1]) || mapped)
            printf("%s\n", entry->d_name);
    }
    closedir(proc);
    close(proc_fd);
    return 0;
}
