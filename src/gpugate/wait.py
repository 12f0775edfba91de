"""Waiting: poll NVML until every owned GPU is at or below the free level and lists no process.

Polls start at 5 ms and back off to 50 ms, so the exit follows the driver's release closely
without spinning; progress is reported about once a second.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from gpugate.nvml import Gpu, GpuDriver
from gpugate.outcome import BusyGpu

FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
PROGRESS_EVERY_S = 1.0


def busy_gpus(
    driver: GpuDriver, gpus: Sequence[Gpu], free_mib: int, ignored_pids: Collection[int]
) -> list[BusyGpu]:
    busy: list[BusyGpu] = []
    for gpu in gpus:
        usage = driver.usage(gpu)
        pids = tuple(p.pid for p in usage.processes if p.pid not in ignored_pids)
        if usage.used_mib > free_mib or pids:
            busy.append(BusyGpu(gpu, usage.used_mib, pids))
    return busy


def wait_until_free(
    driver: GpuDriver,
    gpus: Sequence[Gpu],
    *,
    free_mib: int,
    ignored_pids: Collection[int],
    deadline: float,
    on_progress: Callable[[list[BusyGpu], float], None] = lambda busy, left: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[BusyGpu]:
    """Return [] once all are free, else what was still busy at the deadline."""
    interval = FIRST_POLL_S
    next_progress = clock()
    while True:
        busy = busy_gpus(driver, gpus, free_mib, ignored_pids)
        now = clock()
        if not busy or now >= deadline:
            return busy
        if now >= next_progress:
            on_progress(busy, deadline - now)
            next_progress = now + PROGRESS_EVERY_S
        sleep(min(interval, max(deadline - now, 0)))
        interval = min(interval * 1.5, MAX_POLL_S)
