"""The device-file scan in one pass and over worker processes (host/scan_split.py),
interleaved on one crowd, to find where the split starts to pay (issue 38):

    python3 -m bench.scan_split [--counts 1000,5000,20000] [--workers 2,4,8,16] [--runs 7]

As root (the crowd raises its limits). Prints per crowd size and worker count the median wall
time of one scan (the workers are started once per count, before the runs, as a hook would
start them before NVML), the speed-up over the one pass, the speed-up per worker, and the
holders found (each count must find the same), and stops at the switch point: the smallest
crowd at which a worker count is faster than the one pass by more than the spread of either's
runs. On the device machine (16 cores) run it with --workers 2,4,8,16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.crowd import BUILD, Crowd, make_device_root
from bench.stage import load_average
from gpugate.host.scan import NO_DEADLINE, scan_device_users
from gpugate.host.scan_split import SplitScan


def measure(
    count: int, workers: list[int], runs: int, prefix: str, held: tuple[str, ...]
) -> list[int]:
    """Prints the figures; returns the worker counts that beat the one pass by more than the
    spread of either's runs."""
    splits = {n: SplitScan(n) for n in workers}
    for split in splits.values():
        split.__enter__()  # before the crowd's reader thread exists
    try:
        with Crowd(count, held):
            loads = [load_average()]
            walls: dict[int, list[float]] = {n: [] for n in [1, *workers]}
            found: dict[int, set[int]] = {}
            for run in range(runs):
                order = [1, *workers] if run % 2 == 0 else [*workers, 1][::-1]
                for n in order:
                    started = time.perf_counter()
                    if n == 1:
                        scan = scan_device_users(Path("/proc"), prefix)
                    else:
                        scan = splits[n](Path("/proc"), prefix, (), (), (), NO_DEADLINE)
                    walls[n].append(time.perf_counter() - started)
                    found[n] = set(scan.users)
            loads.append(load_average())
    finally:
        for split in splits.values():
            split.close()
    one = statistics.median(walls[1])
    spread_one = max(walls[1]) - min(walls[1])
    print(f"{count:,} extra processes, {runs} runs; load {' -> '.join(loads)}")
    winners = []
    for n, values in walls.items():
        wall = statistics.median(values)
        spread = (max(values) - min(values)) * 1000
        print(
            f"  {n:>2} worker(s): wall {wall * 1000:.0f} ms (spread {spread:.0f}), "
            f"x{one / wall:.2f} over one pass, x{one / wall / n:.2f} per worker, "
            f"{len(found[n])} holders"
        )
        if n > 1 and one - wall > max(spread_one, max(values) - min(values)):
            winners.append(n)
    return winners


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,5000,20000")
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    dev = make_device_root(BUILD / "scan-split-dev")
    prefix = str(dev / "nvidia")
    held = (f"fd:{dev / 'nvidia0'}", f"map:{dev / 'nvidia3'}")
    workers = [int(n) for n in args.workers.split(",")]
    print(f"cores {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}")
    for count in (int(n) for n in args.counts.split(",")):
        winners = measure(count, workers, args.runs, prefix, held)
        if winners:
            print(f"switch point: {count:,} processes, {min(winners)} workers or more")
            return 0
    print("switch point: none (no worker count beat the one pass by more than the spread)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
