"""What one `gpugate sweep` costs, with COUNT extra processes on the stand-in host (issue 36):
CPU per sweep (the child's user + system time from wait4), and at one sweep a minute (the
gpugate-sweep.timer), CPU per hour and as a share of one core. The metrics textfile is set,
and the stand-in holders hold every GPU file (one of them mapped only), outside any unit:
each is owned by nobody, so every sweep writes the state and the gauges.

    python3 -m bench.sweep_cost [--counts 1000,5000] [--runs 5]     # as root
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench.crowd import BUILD, REPO, Crowd
from bench.discovery import holder_specs
from bench.stage import Stage, load_average
from bench.status_compare import checked, child_env

SWEEPS_PER_HOUR = 60


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,5000")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    stage = Stage(BUILD / "stage" / "sweep")
    config = stage.root / "sweep.toml"
    config.write_text(
        f'lock_dir = "{stage.locks}"\nmetrics_textfile = "{stage.root / "metrics.prom"}"\n'
    )
    python = str(REPO / ".venv" / "bin" / "python")
    sweep = [python, "-m", "gpugate", *stage.roots_args(), "sweep", "--config", str(config)]
    env = child_env(stage)
    print(f"cores {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}")
    print("| extra processes | CPU per sweep, median (range) | wall | CPU per hour | of a core |")
    print("| --- | --- | --- | --- | --- |")
    for count in (int(n) for n in args.counts.split(",")):
        with Crowd(0, holder_specs(stage)), Crowd(count):
            checked(sweep, env)  # the first writes the bytecode and the state
            loads = [load_average()]
            runs = [checked(sweep, env) for _ in range(args.runs)]
            loads.append(load_average())
        cpu = [run.cpu for run in runs]
        median = statistics.median(cpu)
        wall = statistics.median(run.wall for run in runs)
        hour = median * SWEEPS_PER_HOUR
        print(
            f"| {count:,} | {median * 1000:.0f} ms ({min(cpu) * 1000:.0f}-{max(cpu) * 1000:.0f}) "
            f"| {wall * 1000:.0f} ms | {hour:.1f} s | {hour / 3600 * 100:.2f}% |"
        )
        print(f"  ({count:,}: load {' -> '.join(loads)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
