/*
 * fake_nvml.c - a stand-in libnvidia-ml.so.1 for gpugate's tests.
 *
 * pynvml (nvidia-ml-py) loads this library unchanged with CDLL("libnvidia-ml.so.1").
 * It exports the NVML calls gpugate needs, with NVML's ABI (struct layouts, return
 * codes), and answers them from a small, faithful model of a GPU host that is derived
 * from the live process table on every call.  See /work/shared/simhost.md.
 *
 * Settings file: $FAKE_NVML_CONFIG, default /etc/fake-nvml.conf; "key = value" lines,
 * '#' starts a comment; re-read on every call.  A missing file means all defaults.
 *
 *   gpu_count = 8                 minors = 0 1 2 3 4 5 6 7   (minor of each index)
 *   total_mib = 97887             reserved_mib = 512
 *   uuid_prefix = GPU-fa4e5a11-0000-0000-0000-   (uuid = prefix + 12 hex digits of index)
 *   name = NVIDIA H200 (simulated)               driver_version = 570.0.sim
 *   dev_root = /dev               state_dir = /run/fake-nvml
 *   release_delay_ms = 0
 *   init_error = 0                (an NVML return code for nvmlInit* to return)
 *   lost_gpus =                   (indices whose handle calls return GPU_IS_LOST)
 *   memory_not_supported = 0      (1: memory info calls return NOT_SUPPORTED)
 *   hang = 0                      (1: every call, nvmlInit* and nvmlShutdown too, blocks
 *                                  until the setting is cleared: a hung driver)
 *   hang_gpus =                   (indices whose device calls block until cleared)
 *   A call that blocks appends "PID FUNCTION INDEX" (INDEX -1: no GPU) to STATE_DIR/hung.log
 *   once, when it starts to block; it then re-reads the settings every 20 ms.
 *   mig = INDEX [GI/CI/MIB[/PROFILE] ...]   (one line per GPU in MIG mode; may repeat)
 *                    GPU INDEX is in MIG mode (nvmlDeviceGetMigMode: 1, 1), with one MIG
 *                    device (slice) per GI/CI/MIB, at MIG index 0, 1, ... of at most
 *                    max_mig_devices (default 7): GPU instance GI, compute instance CI, MIB
 *                    MiB of memory, PROFILE (default "1g.MIBmb") in its name
 *                    ("NAME MIG PROFILE").  A slice's UUID is "MIG-" + uuid_prefix without its
 *                    "GPU-" + 4 hex digits each of INDEX, GI and CI.  Every other GPU is MIG
 *                    capable with MIG disabled (0, 0) and no MIG devices.
 *   mps_error = 0                 (an NVML return code for the MPS client list calls to return,
 *                                  e.g. 13 FUNCTION_NOT_FOUND or 3 NOT_SUPPORTED: a driver
 *                                  that cannot list MPS clients)
 *   mps_clients_compute = 0       (1: an MPS client is on the compute list too, with the same
 *                                  memory, as nvidia-smi's "M+C" shows on some drivers)
 *   MIG device handles answer nvmlDeviceGetUUID, GetName, GetMemoryInfo(_v2), the process
 *   lists, IsMigDeviceHandle, GetGpuInstanceId, GetComputeInstanceId and
 *   GetDeviceHandleFromMigDeviceHandle; the calls made of a whole GPU (GetIndex,
 *   GetMinorNumber, GetMigMode, GetMaxMigDeviceCount, GetMigDeviceHandleByIndex) answer
 *   INVALID_ARGUMENT for them.  nvmlDeviceGetHandleByUUID takes MIG UUIDs too.
 *
 * Model (STATE_DIR):
 *   claims/PID       "MIB STARTTIME N[,N...] [mps]": PID uses MIB MiB on each GPU whose minor is
 *                    N.  An entry "N/GI/CI" is a MIG slice of that GPU: PID uses MIB MiB of
 *                    it, and is listed on that slice's handle alone (and on its parent's, with
 *                    GI and CI, as NVML aggregates a MIG GPU's processes for root).  The claim is live while /proc/PID/stat's starttime (field 22)
 *                    equals STARTTIME and PID has an fd open on DEV_ROOT/nvidiaN for one
 *                    of its Ns (a zombie has none); a live claim is listed as a compute
 *                    process on every claimed GPU whose device file it has open, and counts
 *                    as used on all claimed GPUs.  (A reader that may not read PID's fds,
 *                    e.g. not root, takes all claimed devices as open, as the driver knows.)
 *                    With "mps", PID is a CUDA MPS client: listed by
 *                    nvmlDeviceGetMPSComputeRunningProcesses(_v2,_v3) instead of the compute
 *                    list (a Volta+ client has its own address space and opens the device
 *                    files itself; its memory counts as used like any claim's).  The MPS
 *                    server is an ordinary claim: on the compute list with its own memory.
 *   claims/PID.gone  CLOCK_REALTIME ns when a claim was first seen not live.  Its memory
 *                    stays used (the PID is not listed) until release_delay_ms later; then
 *                    the claim and .gone files are deleted and "UNIX_NS PID N[,N...]" is
 *                    appended to freed.log.
 *   leak/INDEX       integer MiB used on GPU INDEX with no process at all.
 *   leak/INDEX-GI-CI integer MiB used on that MIG slice (and so on its GPU) with no process.
 *
 * The only static mutable state is the nvmlInit refcount.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

/* ---- NVML ABI (as in nvml.h and pynvml) ---- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

struct nvmlDevice_st {
    unsigned char unused;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define NVML_MEMORY_V2_VERSION 0x02000028u /* sizeof(nvmlMemory_v2_t) | 2 << 24 */

typedef struct { /* used by the unversioned process-list calls */
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct { /* used by the _v2 and _v3 process-list calls */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

/* ---- settings ---- */

#define MAX_GPUS 64
#define MAX_MIG 7 /* MIG devices per GPU (an H100's most) */
#define MAX_LISTED 1024 /* holders listed per GPU */
#define MIB 1048576ULL

struct slice {
    unsigned gi, ci;
    unsigned long long mib;
    char profile[32];
};

struct config {
    unsigned gpu_count;
    unsigned long long total_mib, reserved_mib;
    unsigned minors[MAX_GPUS];
    char uuid_prefix[128];
    char name[96];
    char driver_version[80];
    char dev_root[PATH_MAX];
    char state_dir[PATH_MAX];
    long long release_delay_ms;
    int init_error;
    unsigned char lost[MAX_GPUS];
    int memory_not_supported;
    int mps_error;
    int mps_clients_compute;
    int hang;
    unsigned char hang_gpu[MAX_GPUS];
    unsigned char mig[MAX_GPUS];      /* in MIG mode */
    unsigned nslices[MAX_GPUS];       /* its MIG devices, at MIG indices 0..nslices-1 */
    struct slice slices[MAX_GPUS][MAX_MIG];
    unsigned max_mig;
};

/* Parses "INDEX [GI/CI/MIB[/PROFILE] ...]" into c's MIG settings. */
static void parse_mig(struct config *c, const char *val)
{
    char *end;
    unsigned long index = strtoul(val, &end, 10);
    if (end == val || index >= MAX_GPUS)
        return;
    c->mig[index] = 1;
    const char *p = end;
    while (*p) {
        while (isspace((unsigned char)*p))
            p++;
        if (!*p)
            break;
        struct slice sl = {0, 0, 0, ""};
        int used = 0;
        if (sscanf(p, "%u/%u/%llu%n", &sl.gi, &sl.ci, &sl.mib, &used) != 3)
            return;
        p += used;
        if (*p == '/') {
            p++;
            size_t n = strcspn(p, " \t");
            snprintf(sl.profile, sizeof(sl.profile), "%.*s", (int)n, p);
            p += n;
        } else {
            snprintf(sl.profile, sizeof(sl.profile), "1g.%llumb", sl.mib);
        }
        if (c->nslices[index] < MAX_MIG)
            c->slices[index][c->nslices[index]++] = sl;
    }
}

static void copy_str(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

/* Parses a space-separated list of unsigned numbers into out[0..max); returns the count. */
static unsigned parse_uint_list(const char *s, unsigned *out, unsigned max)
{
    unsigned n = 0;
    char *end;
    while (n < max) {
        while (isspace((unsigned char)*s) || *s == ',')
            s++;
        if (!isdigit((unsigned char)*s))
            break;
        out[n++] = (unsigned)strtoul(s, &end, 10);
        s = end;
    }
    return n;
}

static void load_config(struct config *c)
{
    memset(c, 0, sizeof(*c));
    c->gpu_count = 8;
    c->total_mib = 97887;
    c->reserved_mib = 512;
    for (unsigned i = 0; i < MAX_GPUS; i++)
        c->minors[i] = i;
    copy_str(c->uuid_prefix, sizeof(c->uuid_prefix), "GPU-fa4e5a11-0000-0000-0000-");
    copy_str(c->name, sizeof(c->name), "NVIDIA H200 (simulated)");
    copy_str(c->driver_version, sizeof(c->driver_version), "570.0.sim");
    copy_str(c->dev_root, sizeof(c->dev_root), "/dev");
    copy_str(c->state_dir, sizeof(c->state_dir), "/run/fake-nvml");
    c->max_mig = MAX_MIG;

    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = fopen(path && *path ? path : "/etc/fake-nvml.conf", "re");
    if (!f)
        return;
    char line[1024];
    while (fgets(line, sizeof(line), f)) {
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *eq = strchr(line, '=');
        if (!eq)
            continue;
        *eq = '\0';
        const char *key = trim(line);
        const char *val = trim(eq + 1);
        if (!strcmp(key, "gpu_count")) {
            c->gpu_count = (unsigned)strtoul(val, NULL, 10);
            if (c->gpu_count > MAX_GPUS)
                c->gpu_count = MAX_GPUS;
        } else if (!strcmp(key, "total_mib")) {
            c->total_mib = strtoull(val, NULL, 10);
        } else if (!strcmp(key, "reserved_mib")) {
            c->reserved_mib = strtoull(val, NULL, 10);
        } else if (!strcmp(key, "minors")) {
            parse_uint_list(val, c->minors, MAX_GPUS);
        } else if (!strcmp(key, "uuid_prefix")) {
            copy_str(c->uuid_prefix, sizeof(c->uuid_prefix), val);
        } else if (!strcmp(key, "name")) {
            copy_str(c->name, sizeof(c->name), val);
        } else if (!strcmp(key, "driver_version")) {
            copy_str(c->driver_version, sizeof(c->driver_version), val);
        } else if (!strcmp(key, "dev_root")) {
            copy_str(c->dev_root, sizeof(c->dev_root), val);
        } else if (!strcmp(key, "state_dir")) {
            copy_str(c->state_dir, sizeof(c->state_dir), val);
        } else if (!strcmp(key, "release_delay_ms")) {
            c->release_delay_ms = strtoll(val, NULL, 10);
        } else if (!strcmp(key, "init_error")) {
            c->init_error = (int)strtol(val, NULL, 10);
        } else if (!strcmp(key, "lost_gpus")) {
            unsigned idx[MAX_GPUS];
            unsigned n = parse_uint_list(val, idx, MAX_GPUS);
            for (unsigned i = 0; i < n; i++)
                if (idx[i] < MAX_GPUS)
                    c->lost[idx[i]] = 1;
        } else if (!strcmp(key, "memory_not_supported")) {
            c->memory_not_supported = (int)strtol(val, NULL, 10) != 0;
        } else if (!strcmp(key, "mps_error")) {
            c->mps_error = (int)strtol(val, NULL, 10);
        } else if (!strcmp(key, "mps_clients_compute")) {
            c->mps_clients_compute = (int)strtol(val, NULL, 10) != 0;
        } else if (!strcmp(key, "hang")) {
            c->hang = (int)strtol(val, NULL, 10) != 0;
        } else if (!strcmp(key, "hang_gpus")) {
            unsigned idx[MAX_GPUS];
            unsigned n = parse_uint_list(val, idx, MAX_GPUS);
            for (unsigned i = 0; i < n; i++)
                if (idx[i] < MAX_GPUS)
                    c->hang_gpu[idx[i]] = 1;
        } else if (!strcmp(key, "mig")) {
            parse_mig(c, val);
        } else if (!strcmp(key, "max_mig_devices")) {
            c->max_mig = (unsigned)strtoul(val, NULL, 10);
            if (c->max_mig > MAX_MIG)
                c->max_mig = MAX_MIG;
        }
    }
    fclose(f);
}

/* ---- the hang fault ---- */

static int hangs(const struct config *c, int index)
{
    return c->hang || (index >= 0 && index < MAX_GPUS && c->hang_gpu[index]);
}

/*
 * Blocks while the settings say this call hangs, as a driver in a bad state does; notes it
 * once in STATE_DIR/hung.log, so that a test knows the call is blocked.  Reloads *c.
 */
static void hang_while_set(struct config *c, const char *function, int index)
{
    int noted = 0;
    while (hangs(c, index)) {
        if (!noted) {
            char path[PATH_MAX + 32], line[256];
            snprintf(path, sizeof(path), "%s/hung.log", c->state_dir);
            int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
            if (fd >= 0) {
                int len = snprintf(line, sizeof(line), "%d %s %d\n", (int)getpid(), function,
                                   index);
                if (write(fd, line, (size_t)len) != len) {
                    /* ignored */
                }
                close(fd);
            }
            noted = 1;
        }
        struct timespec pause = {0, 20000000};
        nanosleep(&pause, NULL);
        load_config(c);
    }
}

/* ---- init state and handles ---- */

static int init_refcount; /* the only mutable static state */

/* A handle is the address of one of these; its index is its offset. */
static const struct nvmlDevice_st device_slots[MAX_GPUS];
/* A MIG device's handle: its GPU's index and its MIG index. */
static const struct nvmlDevice_st mig_slots[MAX_GPUS][MAX_MIG];

static int initialized(void)
{
    return __atomic_load_n(&init_refcount, __ATOMIC_SEQ_CST) > 0;
}

static nvmlDevice_t handle_of(unsigned index)
{
    return (nvmlDevice_t)&device_slots[index]; /* never written through */
}

static nvmlDevice_t mig_handle_of(unsigned index, unsigned slice)
{
    return (nvmlDevice_t)&mig_slots[index][slice]; /* never written through */
}

/*
 * Loads the settings and resolves a handle, of a GPU or of one of its MIG devices, to the
 * GPU's index and the MIG index (*slice, -1 for the GPU itself); the common check of the calls
 * a MIG device answers too.
 */
static nvmlReturn_t any_device_call(nvmlDevice_t device, struct config *c, unsigned *index,
                                    int *slice)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    load_config(c);
    const struct nvmlDevice_st *d = device;
    const struct nvmlDevice_st *first_mig = &mig_slots[0][0];
    if (d >= device_slots && d < device_slots + MAX_GPUS) {
        *index = (unsigned)(d - device_slots);
        *slice = -1;
    } else if (d >= first_mig && d < first_mig + MAX_GPUS * MAX_MIG) {
        unsigned offset = (unsigned)(d - first_mig);
        *index = offset / MAX_MIG;
        *slice = (int)(offset % MAX_MIG);
        if (*index < c->gpu_count && (!c->mig[*index] || (unsigned)*slice >= c->nslices[*index]))
            return NVML_ERROR_INVALID_ARGUMENT; /* the slice is gone (MIG reconfigured) */
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (*index >= c->gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    hang_while_set(c, "device call", (int)*index);
    if (c->lost[*index])
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* The check of the calls made of a whole GPU alone: a MIG device's handle is refused. */
static nvmlReturn_t device_call(nvmlDevice_t device, struct config *c, unsigned *index)
{
    int slice;
    nvmlReturn_t ret = any_device_call(device, c, index, &slice);
    if (ret == NVML_SUCCESS && slice >= 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return ret;
}

static nvmlReturn_t copy_out(char *buf, unsigned length, const char *s)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

static void uuid_of(const struct config *c, unsigned index, char *out, size_t size)
{
    snprintf(out, size, "%s%012x", c->uuid_prefix, index);
}

static void mig_uuid_of(const struct config *c, unsigned index, unsigned slice, char *out,
                        size_t size)
{
    const char *rest = c->uuid_prefix;
    if (!strncmp(rest, "GPU-", 4))
        rest += 4;
    const struct slice *sl = &c->slices[index][slice];
    snprintf(out, size, "MIG-%s%04x%04x%04x", rest, index & 0xffff, sl->gi & 0xffff,
             sl->ci & 0xffff);
}

/* ---- the process table ---- */

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Field 22 of /proc/PID/stat, or 0 if the process does not exist. */
static unsigned long long proc_starttime(unsigned pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
    if (!p)
        return 0;
    p++;
    for (int field = 3; field <= 22; field++) { /* fields after comm start at 3 */
        while (*p == ' ')
            p++;
        if (field == 22)
            return strtoull(p, NULL, 10);
        while (*p && *p != ' ')
            p++;
    }
    return 0;
}

/*
 * Sets held[i] for each minors[i] that PID has an fd open on (DEV_ROOT/nvidiaN); returns how
 * many.  A reader not allowed to look at PID's fds (not root, another user's process) cannot
 * tell, while the real driver can: it then takes every claimed device as held.
 */
static unsigned held_devices(unsigned pid, const char *dev_root, const unsigned *minors, unsigned n,
                             unsigned char *held)
{
    char path[64], link[PATH_MAX + 32], prefix[PATH_MAX + 16];
    unsigned count = 0;
    memset(held, 0, n);
    snprintf(prefix, sizeof(prefix), "%s/nvidia", dev_root);
    size_t plen = strlen(prefix);
    snprintf(path, sizeof(path), "/proc/%u/fd", pid);
    DIR *dir = opendir(path);
    if (!dir && (errno == EACCES || errno == EPERM)) {
        memset(held, 1, n);
        return n;
    }
    if (!dir)
        return 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (e->d_name[0] == '.')
            continue;
        ssize_t len = readlinkat(dirfd(dir), e->d_name, link, sizeof(link) - 1);
        if (len < 0 && (errno == EACCES || errno == EPERM)) {
            memset(held, 1, n);
            count = n;
            break;
        }
        if (len <= 0)
            continue;
        link[len] = '\0';
        if (strncmp(link, prefix, plen) != 0)
            continue;
        const char *digits = link + plen;
        if (!*digits || strspn(digits, "0123456789") != strlen(digits))
            continue; /* nvidiactl, nvidia-uvm, "nvidia3 (deleted)" */
        unsigned minor = (unsigned)strtoul(digits, NULL, 10);
        for (unsigned i = 0; i < n; i++) {
            if (minors[i] == minor && !held[i]) {
                held[i] = 1;
                count++;
            }
        }
    }
    closedir(dir);
    return count;
}

/* Reads one integer from a small file into *value; returns 0 on success. */
static int read_number(const char *path, long long *value)
{
    char buf[64];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *end;
    *value = strtoll(buf, &end, 10);
    return end == buf ? -1 : 0;
}

/* The time a claim was first seen not live: read from PATH, or now, recorded there atomically. */
static long long first_noticed_gone(const char *path)
{
    long long t;
    if (read_number(path, &t) == 0)
        return t;
    t = now_ns();
    char tmp[PATH_MAX + 160], buf[32];
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return t; /* cannot record it (permissions): ignored */
    int len = snprintf(buf, sizeof(buf), "%lld\n", t);
    int ok = write(fd, buf, (size_t)len) == len;
    close(fd);
    if (ok && link(tmp, path) != 0 && errno == EEXIST)
        read_number(path, &t); /* someone else noticed first: theirs counts */
    unlink(tmp);
    return t;
}

static void append_freed(const struct config *c, unsigned pid, const char *devices)
{
    char path[PATH_MAX + 32], line[512];
    snprintf(path, sizeof(path), "%s/freed.log", c->state_dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    int len = snprintf(line, sizeof(line), "%lld %u %s\n", now_ns(), pid, devices);
    if (write(fd, line, (size_t)len) != len) {
        /* ignored, like every other write failure */
    }
    close(fd);
}

struct listed {
    unsigned pid;
    unsigned long long bytes;
    unsigned gi, ci; /* NVML_VALUE_NOT_AVAILABLE_UINT: not on a MIG slice */
    int mps;         /* an MPS client */
};

/* What a usage is asked of: a GPU (slice -1), or one of its MIG devices (gi, ci). */
struct target {
    unsigned minor;
    int slice;
    unsigned gi, ci;
};

/* One entry of a claim: "N" (a whole GPU) or "N/GI/CI" (a MIG slice of it). */
struct entry {
    unsigned minor, gi, ci;
    int on_slice;
};

/* Parses a claim's device list into out[0..max); returns the count (0: malformed). */
static unsigned parse_entries(const char *s, struct entry *out, unsigned max)
{
    unsigned n = 0;
    while (*s && n < max) {
        struct entry e = {0, NVML_VALUE_NOT_AVAILABLE_UINT, NVML_VALUE_NOT_AVAILABLE_UINT, 0};
        int used = 0;
        if (sscanf(s, "%u/%u/%u%n", &e.minor, &e.gi, &e.ci, &used) == 3)
            e.on_slice = 1;
        else if (sscanf(s, "%u%n", &e.minor, &used) != 1)
            return 0;
        s += used;
        if (*s && *s != ',')
            return 0;
        if (*s == ',')
            s++;
        out[n++] = e;
    }
    return n;
}

static int entry_matches(const struct entry *e, const struct target *t)
{
    if (e->minor != t->minor)
        return 0;
    return t->slice < 0 || (e->on_slice && e->gi == t->gi && e->ci == t->ci);
}

struct gpu_usage {
    unsigned long long used_bytes; /* claims still counted, plus leak; excludes reserved */
    unsigned nlisted;              /* may exceed MAX_LISTED; only that many are stored */
    struct listed listed[MAX_LISTED];
};

/* Applies one claim file to the usage of target t; reaps it when released. */
static void apply_claim(const struct config *c, const char *dev_root, unsigned pid,
                        const struct target *t, struct gpu_usage *u)
{
    char path[PATH_MAX + 64], gone[PATH_MAX + 96], buf[512], devices[256], kind[8] = "";
    unsigned long long mib, start;
    snprintf(path, sizeof(path), "%s/claims/%u", c->state_dir, pid);
    snprintf(gone, sizeof(gone), "%s.gone", path);

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = '\0';
    int fields = sscanf(buf, "%llu %llu %255s %7s", &mib, &start, devices, kind);
    if (fields < 3 || (fields == 4 && strcmp(kind, "mps") != 0))
        return; /* malformed (or half-written by a careless writer): ignored */
    int mps = fields == 4;

    struct entry entries[MAX_GPUS];
    unsigned minors[MAX_GPUS];
    unsigned nentries = parse_entries(devices, entries, MAX_GPUS);
    unsigned matching = 0;
    for (unsigned i = 0; i < nentries; i++) {
        minors[i] = entries[i].minor;
        matching += entry_matches(&entries[i], t);
    }
    if (matching == 0)
        return; /* not a claim on this GPU or slice */

    unsigned long long bytes = mib * MIB;
    unsigned char held[MAX_GPUS];
    int live = start != 0 && proc_starttime(pid) == start &&
               held_devices(pid, dev_root, minors, nentries, held) > 0;
    if (live) {
        unlink(gone); /* a stale mark from an earlier process with this pid */
        for (unsigned i = 0; i < nentries; i++) {
            if (!entry_matches(&entries[i], t))
                continue;
            u->used_bytes += bytes;
            if (held[i]) {
                if (u->nlisted < MAX_LISTED)
                    u->listed[u->nlisted] =
                        (struct listed){pid, bytes, entries[i].gi, entries[i].ci, mps};
                u->nlisted++;
            }
        }
        return;
    }
    long long since = first_noticed_gone(gone);
    if (now_ns() < since + c->release_delay_ms * 1000000LL) {
        u->used_bytes += bytes * matching; /* the driver has not freed it yet */
        return;
    }
    if (unlink(path) == 0) { /* whoever deletes the claim reports the release */
        unlink(gone);
        append_freed(c, pid, devices);
    }
}

/* Derives the memory use and the compute processes of GPU `index`, or of its MIG device
 * `slice` (-1: the GPU itself), from the process table. */
static void gpu_usage(const struct config *c, unsigned index, int slice, struct gpu_usage *u)
{
    struct target t = {c->minors[index], slice, 0, 0};
    if (slice >= 0) {
        t.gi = c->slices[index][slice].gi;
        t.ci = c->slices[index][slice].ci;
    }
    char dir_path[PATH_MAX + 16], leak[PATH_MAX + 64], dev_root[PATH_MAX];
    u->used_bytes = 0;
    u->nlisted = 0;

    /* fd links are resolved paths: compare against the resolved device root */
    if (!realpath(c->dev_root, dev_root))
        copy_str(dev_root, sizeof(dev_root), c->dev_root);
    size_t len = strlen(dev_root);
    while (len > 1 && dev_root[len - 1] == '/')
        dev_root[--len] = '\0';
    if (!strcmp(dev_root, "/"))
        dev_root[0] = '\0';

    snprintf(dir_path, sizeof(dir_path), "%s/claims", c->state_dir);
    DIR *dir = opendir(dir_path);
    if (dir) {
        struct dirent *e;
        while ((e = readdir(dir))) {
            if (!e->d_name[0] || strspn(e->d_name, "0123456789") != strlen(e->d_name))
                continue; /* PID.gone, temporary files */
            apply_claim(c, dev_root, (unsigned)strtoul(e->d_name, NULL, 10), &t, u);
        }
        closedir(dir);
    }

    long long leaked;
    if (slice < 0) {
        snprintf(leak, sizeof(leak), "%s/leak/%u", c->state_dir, index);
        if (read_number(leak, &leaked) == 0 && leaked > 0)
            u->used_bytes += (unsigned long long)leaked * MIB;
    }
    for (unsigned k = 0; c->mig[index] && k < c->nslices[index]; k++) {
        if (slice >= 0 && (unsigned)slice != k)
            continue;
        snprintf(leak, sizeof(leak), "%s/leak/%u-%u-%u", c->state_dir, index,
                 c->slices[index][k].gi, c->slices[index][k].ci);
        if (read_number(leak, &leaked) == 0 && leaked > 0)
            u->used_bytes += (unsigned long long)leaked * MIB;
    }
}

/* ---- exported API ---- */

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct config c;
    (void)flags;
    load_config(&c);
    hang_while_set(&c, "nvmlInit", -1);
    if (c.init_error != NVML_SUCCESS)
        return c.init_error;
    __atomic_add_fetch(&init_refcount, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlShutdown(void)
{
    struct config c;
    load_config(&c);
    hang_while_set(&c, "nvmlShutdown", -1);
    int count = __atomic_load_n(&init_refcount, __ATOMIC_SEQ_CST);
    while (count > 0) {
        if (__atomic_compare_exchange_n(&init_refcount, &count, count - 1, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
            return NVML_SUCCESS;
    }
    return NVML_ERROR_UNINITIALIZED;
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    struct config c;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    load_config(&c);
    return copy_out(version, length, c.driver_version);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    struct config c;
    char buf[96];
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    load_config(&c);
    snprintf(buf, sizeof(buf), "13.%s", c.driver_version);
    return copy_out(version, length, buf);
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    struct config c;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    load_config(&c);
    hang_while_set(&c, "nvmlDeviceGetCount", -1);
    *count = c.gpu_count;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return nvmlDeviceGetCount_v2(count);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    struct config c;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    load_config(&c);
    if (!device || index >= c.gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    hang_while_set(&c, "nvmlDeviceGetHandleByIndex", (int)index);
    if (c.lost[index])
        return NVML_ERROR_GPU_IS_LOST;
    *device = handle_of(index);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    struct config c;
    char mine[sizeof(c.uuid_prefix) + 16];
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    load_config(&c);
    for (unsigned i = 0; i < c.gpu_count; i++) {
        uuid_of(&c, i, mine, sizeof(mine));
        if (!strcmp(uuid, mine)) {
            if (c.lost[i])
                return NVML_ERROR_GPU_IS_LOST;
            *device = handle_of(i);
            return NVML_SUCCESS;
        }
        for (unsigned k = 0; c.mig[i] && k < c.nslices[i]; k++) {
            mig_uuid_of(&c, i, k, mine, sizeof(mine));
            if (!strcmp(uuid, mine)) {
                if (c.lost[i])
                    return NVML_ERROR_GPU_IS_LOST;
                *device = mig_handle_of(i, k);
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct config c;
    unsigned i;
    nvmlReturn_t ret = device_call(device, &c, &i);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = i;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    struct config c;
    unsigned i;
    nvmlReturn_t ret = device_call(device, &c, &i);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = c.minors[i];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct config c;
    unsigned i;
    int slice;
    char buf[sizeof(c.uuid_prefix) + 16];
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (slice >= 0)
        mig_uuid_of(&c, i, (unsigned)slice, buf, sizeof(buf));
    else
        uuid_of(&c, i, buf, sizeof(buf));
    return copy_out(uuid, length, buf);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct config c;
    unsigned i;
    int slice;
    char buf[sizeof(c.name) + 48];
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (slice < 0)
        return copy_out(name, length, c.name);
    snprintf(buf, sizeof(buf), "%s MIG %s", c.name, c.slices[i][slice].profile);
    return copy_out(name, length, buf);
}

/* ---- MIG ---- */

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                      unsigned int *pendingMode)
{
    struct config c;
    unsigned i;
    nvmlReturn_t ret = device_call(device, &c, &i);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!currentMode || !pendingMode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *currentMode = *pendingMode = c.mig[i];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    struct config c;
    unsigned i;
    nvmlReturn_t ret = device_call(device, &c, &i);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = c.mig[i] ? c.max_mig : 0; /* zero where MIG is not enabled */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *migDevice)
{
    struct config c;
    unsigned i;
    nvmlReturn_t ret = device_call(device, &c, &i);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!migDevice || !c.mig[i] || index >= c.max_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= c.nslices[i])
        return NVML_ERROR_NOT_FOUND; /* no MIG device at this index */
    *migDevice = mig_handle_of(i, index);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                              nvmlDevice_t *device)
{
    struct config c;
    unsigned i;
    int slice;
    nvmlReturn_t ret = any_device_call(migDevice, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!device || slice < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = handle_of(i);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    struct config c;
    unsigned i;
    int slice;
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!isMigDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = slice >= 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t instance_id(nvmlDevice_t device, unsigned int *id, int compute)
{
    struct config c;
    unsigned i;
    int slice;
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!id || slice < 0)
        return NVML_ERROR_INVALID_ARGUMENT; /* not a MIG device */
    *id = compute ? c.slices[i][slice].ci : c.slices[i][slice].gi;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 1);
}

/* Memory of a GPU or MIG device as NVML v2 reports it (used excludes reserved; a MIG device
 * has none reserved). */
static nvmlReturn_t memory_v2(nvmlDevice_t device, nvmlMemory_v2_t *out)
{
    struct config c;
    unsigned i;
    int slice;
    struct gpu_usage u;
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (c.memory_not_supported)
        return NVML_ERROR_NOT_SUPPORTED;
    gpu_usage(&c, i, slice, &u);
    out->total = (slice < 0 ? c.total_mib : c.slices[i][slice].mib) * MIB;
    out->reserved = slice < 0 ? c.reserved_mib * MIB : 0;
    out->used = u.used_bytes;
    unsigned long long taken = out->used + out->reserved;
    out->free = taken < out->total ? out->total - taken : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlMemory_v2_t m;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t ret = memory_v2(device, &m);
    if (ret != NVML_SUCCESS)
        return ret;
    m.version = memory->version;
    *memory = m;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlMemory_v2_t m;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = memory_v2(device, &m);
    if (ret != NVML_SUCCESS)
        return ret;
    memory->total = m.total;
    memory->used = m.used + m.reserved; /* v1 counts the reserved memory as used */
    memory->free = m.free;
    return NVML_SUCCESS;
}

enum list_kind { LIST_COMPUTE, LIST_GRAPHICS, LIST_MPS };

/* Whether a live holder is on this list: an MPS client on the MPS list (and on the compute
 * list where mps_clients_compute says), any other on the compute list; graphics is empty. */
static int on_list(const struct config *c, const struct listed *l, enum list_kind kind)
{
    if (kind == LIST_MPS)
        return l->mps;
    return kind == LIST_COMPUTE && (!l->mps || c->mps_clients_compute);
}

/*
 * Process lists.  *count in: capacity of infos; out: the number of processes.  A NULL
 * array or a too small count gives INSUFFICIENT_SIZE (with the count), unless there
 * are no processes.
 */
static nvmlReturn_t process_list(nvmlDevice_t device, enum list_kind kind, unsigned int *count,
                                 nvmlProcessInfo_t *infos, nvmlProcessInfo_v1_t *infos_v1)
{
    struct config c;
    unsigned i;
    int slice;
    struct gpu_usage u;
    nvmlReturn_t ret = any_device_call(device, &c, &i, &slice);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (kind == LIST_MPS && c.mps_error != NVML_SUCCESS)
        return c.mps_error;
    u.nlisted = 0;
    if (kind != LIST_GRAPHICS)
        gpu_usage(&c, i, slice, &u);
    unsigned stored = u.nlisted < MAX_LISTED ? u.nlisted : MAX_LISTED, n = 0;
    for (unsigned k = 0; k < stored; k++)
        if (on_list(&c, &u.listed[k], kind))
            u.listed[n++] = u.listed[k];
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if ((!infos && !infos_v1) || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < n; k++) {
        if (infos)
            infos[k] = (nvmlProcessInfo_t){u.listed[k].pid, u.listed[k].bytes, u.listed[k].gi,
                                           u.listed[k].ci};
        else
            infos_v1[k] = (nvmlProcessInfo_v1_t){u.listed[k].pid, u.listed[k].bytes};
    }
    *count = n;
    return NVML_SUCCESS;
}

#define PROCESS_CALLS(NAME, KIND)                                                              \
    API nvmlReturn_t NAME##_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos)  \
    {                                                                                          \
        return process_list(d, KIND, count, infos, NULL);                                      \
    }                                                                                          \
    API nvmlReturn_t NAME##_v2(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos)  \
    {                                                                                          \
        return process_list(d, KIND, count, infos, NULL);                                      \
    }                                                                                          \
    /* the unversioned symbol keeps NVML's original two-field struct */                        \
    API nvmlReturn_t NAME(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_v1_t *infos)    \
    {                                                                                          \
        return process_list(d, KIND, count, NULL, infos);                                      \
    }

PROCESS_CALLS(nvmlDeviceGetComputeRunningProcesses, LIST_COMPUTE)
PROCESS_CALLS(nvmlDeviceGetGraphicsRunningProcesses, LIST_GRAPHICS)
PROCESS_CALLS(nvmlDeviceGetMPSComputeRunningProcesses, LIST_MPS)
