/*
 * LD_PRELOAD shim for slurmd (and the slurmstepd it starts) on the simulated host only.
 *
 * The machine's kernel also mounts cgroup v1 hierarchies, and /proc/PID/cgroup lists them in
 * every cgroup namespace; Slurm's cgroup/v2 plugin then stops with "Hybrid mode is not
 * supported". A real cgroup v2 node shows only the "0::PATH" line: reads of /proc/.../cgroup
 * through this shim show just that line, and nothing else changes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);

static open_fn real_open(void) {
    static open_fn fn;
    if (!fn)
        fn = (open_fn)dlsym(RTLD_NEXT, "open");
    return fn;
}

static int is_cgroup_file(const char *path) {
    return path && fnmatch("/proc/*/cgroup", path, FNM_PATHNAME) == 0;
}

static int reading(int flags) { return (flags & O_ACCMODE) == O_RDONLY; }

/* A memfd holding only the unified hierarchy's line of PATH; -1 with errno as open's. */
static int unified_only(const char *path) {
    int src = real_open()(path, O_RDONLY | O_CLOEXEC);
    if (src < 0)
        return -1;
    static char buf[1 << 16];
    size_t total = 0;
    ssize_t n;
    while (total < sizeof(buf) - 1 && (n = read(src, buf + total, sizeof(buf) - 1 - total)) > 0)
        total += (size_t)n;
    close(src);
    buf[total] = '\0';
    int out = memfd_create("cgroup-v2-only", 0);
    if (out < 0)
        return -1;
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        size_t len = next ? (size_t)(++next - line) : strlen(line);
        if (strncmp(line, "0::", 3) == 0 && write(out, line, len) != (ssize_t)len) {
            close(out);
            return -1;
        }
    }
    lseek(out, 0, SEEK_SET);
    return out;
}

static mode_t mode_arg(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    if (is_cgroup_file(path) && reading(flags))
        return unified_only(path);
    return real_open()(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    if (is_cgroup_file(path) && reading(flags))
        return unified_only(path);
    return real_open()(path, flags | O_LARGEFILE, mode);
}

int __open_2(const char *path, int flags) { return open(path, flags); }
int __open64_2(const char *path, int flags) { return open64(path, flags); }

int openat(int dirfd, const char *path, int flags, ...) {
    static openat_fn real;
    if (!real)
        real = (openat_fn)dlsym(RTLD_NEXT, "openat");
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    if (is_cgroup_file(path) && reading(flags))
        return unified_only(path);
    return real(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    return openat(dirfd, path, flags | O_LARGEFILE, mode);
}

static FILE *reopen(const char *path, const char *mode, const char *name) {
    if (is_cgroup_file(path) && mode[0] == 'r' && !strchr(mode, '+')) {
        int fd = unified_only(path);
        return fd < 0 ? NULL : fdopen(fd, mode);
    }
    FILE *(*real)(const char *, const char *) =
        (FILE * (*)(const char *, const char *)) dlsym(RTLD_NEXT, name);
    return real(path, mode);
}

FILE *fopen(const char *path, const char *mode) { return reopen(path, mode, "fopen"); }
FILE *fopen64(const char *path, const char *mode) { return reopen(path, mode, "fopen64"); }
