"""Inside the simulated host: an independent NVML client that polls the stand-in driver
every millisecond, so that a claim's release is noticed (and logged to freed.log by the
driver) when it happens, not when gpugate next asks.

    python3 observer.py LOG [--procs]

Appends "UNIX_NS GPU USED_MIB [PROCESSES]" to LOG whenever a GPU's figures change, until
SIGTERM.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import time

MIB = 1024 * 1024
MEMORY_V2 = 0x02000028


class MemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def main(argv: list[str]) -> int:
    log_path, with_procs = argv[1], "--procs" in argv[2:]
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
        return 1
    count = ctypes.c_uint()
    nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    handles = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        handles.append(handle)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    last: dict[int, tuple[int, int]] = {}
    with open(log_path, "a", buffering=1) as log:
        while not stopping:
            for index, handle in enumerate(handles):
                memory = MemoryV2(version=MEMORY_V2)
                nvml.nvmlDeviceGetMemoryInfo_v2(handle, ctypes.byref(memory))
                listed = ctypes.c_uint(0)
                if with_procs:
                    nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(listed), None)
                state = (memory.used // MIB, listed.value)
                if last.get(index) != state:
                    last[index] = state
                    log.write(f"{time.time_ns()} {index} {state[0]} {state[1]}\n")
            time.sleep(0.001)
    nvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
