"""Waiting: poll NVML until every owned GPU is at or below the free level and lists no process,
the unit's ports are free, and no respawn is under way.

Polls start at 5 ms and back off to 50 ms, so the exit follows the driver's release closely
without spinning; progress is reported about once a second. What turns up during the wait (a
respawned holder: NVML lists a PID not seen, a port is listened on again, a watched parent
starts the killed child's executable again) is looked for with a new discovery, at most every
LOOK_AGAIN_EVERY_S, and killed by the caller as in the kill rounds.

The look runs when NVML lists a PID not known, a port is held, or a respawn is under way.
While parents of killed holders are watched (a respawn may come from them), success needs
two looks in a row, LOOK_AGAIN_EVERY_S apart, that find nothing: a respawned holder that NVML
does not list yet is caught, and a loop that respawns between two polls cannot end the run
as a success.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpugate.core.outcome import BusyGpu
from gpugate.host.nvml import Gpu, GpuDriver

FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
PROGRESS_EVERY_S = 1.0
LOOK_AGAIN_EVERY_S = 0.2  # a rediscovery costs a pass over /proc: not at every poll


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


@dataclass
class Settled:
    busy: list[BusyGpu]  # GPUs still used at the deadline
    ports: list[int]  # the unit's ports still listened on at the deadline
    pending: list[int]  # respawned children at the deadline
    stable: bool = True  # False: parents are watched and no two looks in a row found it clear

    @property
    def held(self) -> bool:
        return bool(self.busy or self.ports or self.pending or not self.stable)


class WaitProbes(Protocol):
    """What the wait looks at, each time it looks."""

    def busy_gpus(self) -> list[BusyGpu]:
        """The GPUs still above free_mib."""

    def busy_ports(self) -> list[int]:
        """The unit's ports something still listens on."""

    def pending(self) -> list[int]:
        """Respawns under way below a watched parent."""

    def look_again(self) -> bool:
        """Rediscover and kill what is found (True: something was)."""

    def known_pids(self) -> Collection[int]:
        """The PIDs the run signalled or spared: NVML may still list them."""

    def watching(self) -> bool:
        """Whether parents of the killed are watched (for respawns)."""


def wait_settled(
    probes: WaitProbes,
    *,
    deadline: float,
    on_progress: Callable[[list[BusyGpu], float], None] = lambda busy, left: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Settled:
    """Poll until the GPUs and ports are free and no respawn is under way, or the deadline.
    look_again rediscovers and kills what it finds (True when it found something); when it
    runs, and why two clear looks are needed while parents are watched: the module's doc."""
    interval = FIRST_POLL_S
    next_progress = clock()
    next_look = clock()
    clear_since: float | None = None
    while True:
        busy = probes.busy_gpus()
        ports = probes.busy_ports()
        watched = probes.watching()
        under_way = probes.pending() if watched else []
        now = clock()
        known = probes.known_pids()
        unexplained = any(pid not in known for item in busy for pid in item.pids)
        clear = not busy and not ports and not under_way
        if not clear:
            clear_since = None
        if clear and not watched:
            return Settled(busy, ports, under_way)
        if (unexplained or ports or under_way or clear) and now >= next_look:
            next_look = now + LOOK_AGAIN_EVERY_S
            if probes.look_again():
                clear_since = None
                continue
            if clear:
                if clear_since is not None:
                    return Settled(busy, ports, under_way)
                clear_since = now
        if now >= deadline:
            return Settled(busy, ports, under_way, stable=not watched and clear)
        if now >= next_progress:
            on_progress(busy, deadline - now)
            next_progress = now + PROGRESS_EVERY_S
        sleep(min(interval, max(deadline - now, 0)))
        interval = min(interval * 1.5, MAX_POLL_S)
