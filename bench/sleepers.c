/*
 * sleepers.c - the crowd of a busy host, for gpugate's discovery benchmark.
 *
 *   sleepers COUNT HEAVY_EVERY HEAVY_FDS HEAVY_MAPS FILLER [fd:PATH | map:PATH]...
 *
 * Forks COUNT small sleepers; every HEAVY_EVERY-th one also holds HEAVY_FDS open fds (on
 * FILLER, /dev/null and pipes) and HEAVY_MAPS separate read-only mappings of FILLER (one
 * /proc/PID/maps line each).  Each extra argument forks one more sleeper that holds PATH open
 * (fd:) or only mapped (map:, its fd closed after mmap).  Prints each child's PID on a line,
 * then READY, and sleeps until its stdin reaches EOF (the benchmark closed it, or died): then
 * it SIGKILLs and reaps every child it forked and exits.  Children also die with it
 * (PR_SET_PDEATHSIG), so a killed leader leaves nothing behind.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what)
{
    perror(what);
    _exit(1);
}

static void hold_heavy(const char *filler, int fds, int maps)
{
    int filler_fd = open(filler, O_RDONLY);
    if (filler_fd < 0)
        die(filler);
    for (int i = 0; i < fds; i++) {
        int kind = i % 4, fd = -1, pipe_fds[2];
        if (kind == 0)
            fd = open("/dev/null", O_RDONLY);
        else if (kind == 1 && pipe(pipe_fds) == 0) {
            fd = pipe_fds[0];
            i++; /* the write end is one more fd */
        } else
            fd = open(filler, O_RDONLY);
        if (fd < 0)
            die("open");
    }
    /* Same file offset every time: neighbouring mappings cannot merge into one VMA. */
    for (int i = 0; i < maps; i++)
        if (mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, filler_fd, 0) == MAP_FAILED)
            die("mmap");
}

static void hold_device(const char *spec)
{
    const char *path = strchr(spec, ':') + 1;
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        die(path);
    if (!strncmp(spec, "map:", 4)) {
        if (mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0) == MAP_FAILED)
            die("mmap device");
        close(fd);
    }
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: %s COUNT HEAVY_EVERY HEAVY_FDS HEAVY_MAPS FILLER [fd:PATH|map:PATH]...\n",
                argv[0]);
        return 2;
    }
    int count = atoi(argv[1]), heavy_every = atoi(argv[2]);
    int heavy_fds = atoi(argv[3]), heavy_maps = atoi(argv[4]);
    const char *filler = argv[5];
    int extra = argc - 6, total = count + extra;
    pid_t leader = getpid();
    pid_t *children = calloc((size_t)total, sizeof(pid_t));
    if (!children)
        die("calloc");
    for (int i = 0; i < total; i++) {
        pid_t pid = fork();
        if (pid < 0)
            die("fork");
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != leader)
                _exit(0);
            int null_fd = open("/dev/null", O_RDWR);
            dup2(null_fd, 0);
            dup2(null_fd, 1);
            close(null_fd);
            if (i >= count)
                hold_device(argv[6 + i - count]);
            else if (heavy_every > 0 && i % heavy_every == 0)
                hold_heavy(filler, heavy_fds, heavy_maps);
            for (;;)
                pause();
        }
        children[i] = pid;
        printf("%d\n", pid);
    }
    printf("READY\n");
    fflush(stdout);
    char buf[256];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
    for (int i = 0; i < total; i++)
        kill(children[i], SIGKILL);
    for (int i = 0; i < total; i++)
        waitpid(children[i], NULL, 0);
    return 0;
}
