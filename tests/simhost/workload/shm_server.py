"""A server that makes POSIX shared memory as vLLM does: `multiprocessing.shared_memory`
segments (`/dev/shm/psm_*`), registered with multiprocessing's resource tracker (which would
unlink them on a clean exit), and a worker attached to one that ignores SIGTERM (a hung NCCL
teardown). Standard library only (it runs on every release root's Python).

    shm_server.py READY_DIR [serve|crash]

Once the segments exist and the worker holds one, writes READY_DIR/PID.json: {"server",
"worker", "tracker" (PIDs), "segments" (paths), "shm_dev" (the device of its /dev/shm),
"seen_at_start" (what its /dev/shm held before it made anything)}. `crash`: then SIGKILLs
itself (a crash of the main process; the worker and the tracker live on). SIGTERM makes the
server shut down as vLLM's API server does: it stops its worker and waits for it, which
never ends (the worker ignores SIGTERM), so systemd's SIGKILL after TimeoutStopSec= ends them
all, the resource tracker (which ignores SIGTERM too) with them, and nobody unlinks anything.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any

SIZE = 1 << 20


def worker(name: str, ready: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    segment = shared_memory.SharedMemory(name)  # attached: held open and mapped
    ready.send(os.getpid())
    while segment.size:
        time.sleep(3600)


def main() -> None:
    ready_dir, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "serve")
    seen = sorted(os.listdir("/dev/shm"))
    ctx = multiprocessing.get_context("fork")
    segments = [shared_memory.SharedMemory(create=True, size=size) for size in (SIZE, 4096)]
    segments[0].buf[:] = b"x" * SIZE  # touched: it takes space in the tmpfs
    parent, child = ctx.Pipe()
    process = ctx.Process(target=worker, args=(segments[0].name, child))
    process.start()
    info = {
        "server": os.getpid(),
        "worker": parent.recv(),
        "tracker": resource_tracker._resource_tracker._pid,  # type: ignore[attr-defined]
        "segments": ["/dev/shm/" + s.name.lstrip("/") for s in segments],
        "shm_dev": os.stat("/dev/shm").st_dev,
        "seen_at_start": seen,
    }
    os.makedirs(ready_dir, exist_ok=True)
    path = os.path.join(ready_dir, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(info, out)
    os.rename(path + ".tmp", path)
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    while not stopping:
        signal.pause()
    process.terminate()
    process.join()  # never returns: the worker ignores SIGTERM
    for segment in segments:  # a clean shutdown would get here
        segment.close()
        segment.unlink()


if __name__ == "__main__":
    main()
