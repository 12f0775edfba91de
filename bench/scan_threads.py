"""The device-file scan on one thread and on several, interleaved on one crowd (issue 30):

    python3 -m bench.scan_threads [--counts 5000] [--threads 1,2,4] [--runs 7]

Prints per crowd size and thread count the median wall and CPU time (all threads) of the scan,
and the load average. On a host with few cores the scan picks one thread (host.scan's
scan_threads); the other counts are forced here to show what they would give.
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
from gpugate.host.scan import scan_device_users


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="5000")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    dev = make_device_root(BUILD / "scan-threads-dev")
    prefix = str(dev / "nvidia")
    held = (f"fd:{dev / 'nvidia0'}", f"map:{dev / 'nvidia3'}")
    counts = [int(n) for n in args.counts.split(",")]
    threads = [int(n) for n in args.threads.split(",")]
    print(f"cores {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}")
    for count in counts:
        with Crowd(count, held):
            loads = [load_average()]
            times: dict[int, list[tuple[float, float]]] = {n: [] for n in threads}
            found: dict[int, set[int]] = {}
            for run in range(args.runs):
                for n in threads if run % 2 == 0 else threads[::-1]:
                    wall, cpu = time.perf_counter(), time.process_time()
                    scan = scan_device_users(Path("/proc"), prefix, threads=n)
                    times[n].append((time.perf_counter() - wall, time.process_time() - cpu))
                    found[n] = set(scan.users)
            loads.append(load_average())
        print(f"{count:,} extra processes, {args.runs} runs; load {' -> '.join(loads)}")
        for n, runs in times.items():
            wall = statistics.median(w for w, _ in runs) * 1000
            cpu = statistics.median(c for _, c in runs) * 1000
            print(f"  {n} thread(s): wall {wall:.0f} ms, CPU {cpu:.0f} ms, {len(found[n])} users")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
