"""A process's facts (ProcFs.info) of one revision against the working tree's, interleaved.

    git show REV:src/gpugate/host/procfs.py > .bench/before_procfs.py
    python3 -m bench.facts_compare .bench/before_procfs.py [COUNT]

discover() reads the facts of each holder and the app-tree walk those of its relatives: this
times that read for COUNT processes of this host (default 200), each in a fresh ProcFs (no
cache), 7 interleaved runs; prints the median wall and CPU time per process of each.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.stage import load_by_path
from gpugate.host.scan import ProcFs

RUNS = 7


def timed(read: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    read()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str]) -> int:
    before = load_by_path("before_procfs", Path(argv[1]))
    count = int(argv[2]) if len(argv) > 2 else 200
    pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())[-count:]

    def read_all(factory: Callable[[], object]) -> None:
        procfs = factory()
        for pid in pids:
            procfs.info(pid)  # type: ignore[attr-defined]

    reads = {
        "before": lambda: read_all(before.ProcFs),
        "after (working tree)": lambda: read_all(ProcFs),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in reads}
    for _ in range(RUNS):
        for name, read in reads.items():
            times[name].append(timed(read))
    for name, runs in times.items():
        wall = statistics.median(run[0] for run in runs) / len(pids) * 1e6
        cpu = statistics.median(run[1] for run in runs) / len(pids) * 1e6
        print(f"{name}: {wall:.1f} us wall / {cpu:.1f} us CPU per process ({len(pids)} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
