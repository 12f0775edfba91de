"""The device-file scan of one revision against the working tree's, interleaved on one crowd.

    git show REV:src/gpugate/procfs.py > .bench/before_scan.py
    python3 -m bench.scan_compare .bench/before_scan.py [COUNT ...]

Prints, per crowd size, the median wall and CPU time of each scan (5 interleaved runs each), and
of the working tree's scan asked also for a set of socket inodes (the ports' cost) and for the
shared-memory files (every process of the crowd then has a segment open and one mapped in a
folder standing for /dev/shm: the worst case of the shm notes' cost).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.crowd import BUILD, Crowd, make_device_root
from bench.stage import load_by_path
from gpugate.host.scan import scan_device_users
from gpugate.host.shm import ShmArea

RUNS = 5


def timed(scan: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    scan()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str]) -> int:
    before = load_by_path("before_scan", Path(argv[1]))
    counts = [int(n) for n in argv[2:]] or [1000, 5000]
    dev = make_device_root(BUILD / "scan-compare-dev")
    prefix = str(dev / "nvidia")
    proc = Path("/proc")
    inodes = frozenset(range(1, 64))
    shm = dev / "shm"
    shm.mkdir(exist_ok=True)
    for name in ("psm_open", "nccl-mapped"):
        (shm / name).write_bytes(b"\0" * 4096)
    areas = [ShmArea(str(shm), shm.stat().st_dev)]
    scans: dict[str, Callable[[], object]] = {
        "before": lambda: before.scan_device_users(proc, prefix),
        "after": lambda: scan_device_users(proc, prefix),
        "after, with ports": lambda: scan_device_users(proc, prefix, inodes),
        "after, with shm": lambda: scan_device_users(proc, prefix, (), areas),
    }
    held = (
        f"fd:{dev / 'nvidia0'}",
        f"map:{dev / 'nvidia3'}",
        f"fd:{shm / 'psm_open'}",
        f"map:{shm / 'nccl-mapped'}",
    )
    for count in counts:
        with Crowd(count, held):
            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in scans}
            for _ in range(RUNS):
                for name, scan in scans.items():
                    samples[name].append(timed(scan))
            for name, runs in samples.items():
                wall = statistics.median(w for w, _ in runs) * 1000
                cpu = statistics.median(c for _, c in runs) * 1000
                print(f"{count} processes, {name}: wall {wall:.1f} ms, cpu {cpu:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
