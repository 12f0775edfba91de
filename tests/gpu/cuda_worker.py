"""A process that holds real GPU memory through the CUDA driver API (libcuda.so.1, present
wherever the NVIDIA driver is; no framework needed), like a vLLM worker.

    python3 cuda_worker.py DEVICE MIB READY_FILE [--children N]

With --children, it forks N workers on the same device first and allocates in each (the
parent allocates too), then writes READY_FILE with the pids and sleeps.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def hold(device: int, mib: int) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    check = lambda code, what: code == 0 or sys.exit(f"{what} failed: CUDA error {code}")  # noqa: E731
    check(cuda.cuInit(0), "cuInit")
    handle = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    context = ctypes.c_void_p()
    check(cuda.cuCtxCreate_v2(ctypes.byref(context), 0, handle), "cuCtxCreate")
    pointer = ctypes.c_uint64()
    check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20)), "cuMemAlloc")


def main() -> None:
    device, mib, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    children = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--children" else 0
    pids = [os.getpid()]
    held_r, held_w = os.pipe()  # each child writes a byte once its memory is allocated
    for _ in range(children):
        pid = os.fork()  # before any CUDA call: CUDA state does not survive fork
        if pid == 0:
            os.close(held_r)
            hold(device, mib)
            os.write(held_w, b"1")
            os.close(held_w)
            while True:
                time.sleep(3600)
        pids.append(pid)
    os.close(held_w)
    hold(device, mib)
    got = b""
    while len(got) < children:  # every child holds its memory (EOF: one of them failed)
        chunk = os.read(held_r, children - len(got))
        if not chunk:
            sys.exit("a child exited before it held its memory")
        got += chunk
    with open(ready + ".tmp", "w") as handle:
        json.dump({"parent": pids[0], "children": pids[1:]}, handle)
    os.replace(ready + ".tmp", ready)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
