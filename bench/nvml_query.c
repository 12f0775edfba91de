/* What an operator asks NVML for besides `fuser -v`: each GPU's memory used and the processes
 * on it (nvidia-smi --query-compute-apps=pid,used_memory), with nothing else: the tightest
 * baseline for `gpugate status --json`. Loads libnvidia-ml.so.1 from the library path (the
 * stand-in driver in the benchmarks). */
#include <dlfcn.h>
#include <stdio.h>

typedef struct {
    unsigned long long total, free, used;
} memory_t;
typedef struct {
    unsigned int pid;
    unsigned long long used;
} process_t;

int main(void)
{
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(nvml, "nvmlDeviceGetCount_v2");
    int (*handle)(unsigned, void **) =
        (int (*)(unsigned, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*memory)(void *, memory_t *) =
        (int (*)(void *, memory_t *))dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    int (*procs)(void *, unsigned *, process_t *) = (int (*)(void *, unsigned *, process_t *))dlsym(
        nvml, "nvmlDeviceGetComputeRunningProcesses");
    int (*shutdown)(void) = (int (*)(void))dlsym(nvml, "nvmlShutdown");
    unsigned gpus = 0;
    if (!init || !count || !handle || !memory || !procs || !shutdown || init() || count(&gpus))
        return 1;
    for (unsigned i = 0; i < gpus; i++) {
        void *device;
        memory_t mem;
        process_t list[256];
        unsigned n = 256;
        if (handle(i, &device) || memory(device, &mem) || procs(device, &n, list))
            return 1;
        printf("%u %llu MiB\n", i, mem.used >> 20);
        for (unsigned k = 0; k < n; k++)
            printf("  %u %llu MiB\n", list[k].pid, list[k].used >> 20);
    }
    shutdown();
    return 0;
}
