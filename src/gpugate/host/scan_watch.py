"""The device-file scan for `status --watch`: each look rescans what can have changed (the
processes that are new since the last look, the holders it knows, the PIDs NVML lists now),
and a full scan now and then (FULL_SCAN_EVERY_S) finds the rest.

What a rescan trusts from the last look: a process that was there, held nothing and is not
listed by NVML still holds nothing. A process that opens a device file later without a CUDA
context (a watcher starting to poll) shows at the next full scan; one with a context is listed
by NVML at once. A new socket inode or shm area asked for (a listener restarted) makes the look
a full one; a process the last look's deadline left unread is read again. A PID reused between
two looks (the PID space wrapping within a second) is read as the process it was until the
next full scan.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from gpugate.host.scan import NO_DEADLINE, Deadline, DeviceScan, scan_device_users
from gpugate.host.shm import ShmArea

FULL_SCAN_EVERY_S = 30.0


class WatchScan:
    """A scan that remembers its last look; call it as `scan_device_users` (plus the PIDs NVML
    lists now)."""

    def __init__(
        self,
        full_every_s: float = FULL_SCAN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.full_every_s = full_every_s
        self.clock = clock
        self.full_scans = 0
        self.rescans = 0
        self._last: DeviceScan | None = None
        self._asked: tuple[object, ...] = ()
        self._listed: set[int] = set()
        self._full_at = 0.0

    def __call__(
        self,
        proc_root: Path,
        device_prefix: str | None,
        socket_inodes: Collection[int] = frozenset(),
        shm_areas: Sequence[ShmArea] = (),
        listed_by_nvml: Collection[int] = (),
        deadline: Deadline = NO_DEADLINE,
    ) -> DeviceScan:
        asked = (proc_root, device_prefix, frozenset(socket_inodes), tuple(shm_areas))
        listed = {int(name) for name in os.listdir(proc_root) if name.isdigit()}
        now = self.clock()
        last = self._last
        if last is None or asked != self._asked or now - self._full_at >= self.full_every_s:
            scan = scan_device_users(proc_root, device_prefix, socket_inodes, shm_areas, deadline)
            self._full_at = now
            self.full_scans += 1
        else:
            known = set(last.users) | set(last.shm) | set(last.cut_short)  # (not all read)
            again = (known | set(listed_by_nvml)) & listed
            new = listed - self._listed
            scan = scan_device_users(
                proc_root,
                device_prefix,
                socket_inodes,
                shm_areas,
                deadline,
                pids=sorted(again | new),
            )
            # Still there and not readable then: not readable now (no second try per look).
            kept = [pid for pid in last.unreadable if pid in listed and pid not in new]
            scan.unreadable = sorted({*scan.unreadable, *kept})
            self.rescans += 1
        self._last, self._asked, self._listed = scan, asked, listed
        return scan
