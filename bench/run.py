#!/usr/bin/env python3
"""gpugate's benchmarks: discovery against fuser and lsof, start-up, reclaim latency and the
whole incident on the simulated GPU host; prints the tables and writes docs/benchmarks.md.

    python3 bench/run.py            # the full run (a few minutes), as root
    python3 bench/run.py --quick    # 1,000 processes, fewer repeats (about a minute);
                                    # writes .bench/benchmarks-quick.md

Starts up to 10,000 small C sleepers (compiled from bench/sleepers.c) and kills them all at
the end; boots the simulated GPU host (tests/simhost) when run as root.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.crowd import BUILD, REPO, Mix
from bench.discovery import measure_discovery
from bench.report import Report, render
from bench.stage import Stage, installed_gpugate, load_average, machine
from bench.startup import measure_startup


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 processes, fewer repeats")
    parser.add_argument("--scales", help="extra process counts, e.g. 1000,5000,10000")
    parser.add_argument("--repeats", type=int, help="discovery repeats per tool (5; quick 3)")
    parser.add_argument("--startup-runs", type=int, help="start-up runs (20; quick 10)")
    parser.add_argument(
        "--heavy-every",
        type=int,
        default=Mix().heavy_every,
        help="every Nth sleeper holds many fds and mappings (default %(default)s)",
    )
    parser.add_argument("--no-simhost", action="store_true", help="skip the simulated GPU host")
    parser.add_argument("--output", type=Path, help="Markdown file to write")
    args = parser.parse_args(argv)
    quick = args.quick
    args.scale_list = [
        int(n) for n in (args.scales or ("1000" if quick else "1000,5000,10000")).split(",")
    ]
    args.repeats = args.repeats or (3 if quick else 5)
    args.startup_runs = args.startup_runs or (10 if quick else 20)
    args.output = args.output or (
        BUILD / "benchmarks-quick.md" if quick else REPO / "docs" / "benchmarks.md"
    )
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    mix = Mix(heavy_every=args.heavy_every)
    report = Report(
        machine=machine(),
        command=shlex.join(["python3", "bench/run.py", *argv]),
        load_before=load_average(),
    )
    stage_root = BUILD / "stage"
    shutil.rmtree(stage_root, ignore_errors=True)
    stage = Stage(stage_root / "discovery")
    command, report.gpugate_install = installed_gpugate()
    started = time.monotonic()
    for processes in args.scale_list:
        print(f"discovery: {processes:,} extra processes, {args.repeats} repeats...", flush=True)
        report.discovery.append(
            measure_discovery(stage, processes, args.repeats, mix=mix, gpugate_command=command)
        )
    print(f"start-up: {args.startup_runs} runs at 1,000 extra processes...", flush=True)
    report.startup = measure_startup(
        Stage(stage_root / "clean"), command, 1000, args.startup_runs, mix=mix
    )
    if args.no_simhost:
        report.simulated_skipped = "--no-simhost"
    elif os.geteuid() != 0:
        report.simulated_skipped = "needs root (run as root for the simulated GPU host)"
    else:
        from bench.simulated import measure_simulated, unavailable  # noqa: PLC0415

        reason = unavailable()
        if reason is not None:
            report.simulated_skipped = reason
        else:
            print(
                "simulated GPU host: reclaim latency, hand cleanup, whole incident...", flush=True
            )
            quick = args.quick
            report.simulated = measure_simulated(
                reclaims=3 if quick else 10,
                hand_loops=1 if quick else 5,
                incidents=1 if quick else 3,
                startups=5 if quick else args.startup_runs,
            )
    report.load_after = load_average()
    text = render(report)
    print()
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"written to {args.output} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
