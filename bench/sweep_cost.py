"""What one `gpugate sweep` costs, with COUNT extra processes on the stand-in host (issues 36,
47): CPU per sweep (the child's user + system time from wait4) beside `python3 -I -c pass` on
the same interpreter in the same runs (interleaved), and at one sweep a minute (the
gpugate-sweep.timer), CPU per hour and as a share of one core. The metrics textfile is set.

The stand-in holders hold every GPU file (one of them mapped only); two of them (the holders
of nvidia2 and nvidia5) claim 4,000 MiB each from the stand-in NVML, which lists them there.
Each holder is outside any unit: the two listed ones are owned by nobody (each sweep writes the
state and the gauges), the others hold device files only.

Scenarios: `accounted` (NVML's lists account for every GPU's memory: the sweep reads the listed
processes alone), `leak` (30,000 MiB on GPU 4 listed for no process, a driver leak: the sweep
reads every process's fds, as before issue 47).

    python3 -m bench.sweep_cost [--counts 1000,5000,20000] [--runs 5] \
        [--scenarios accounted,leak] [--src OTHER_TREE/src]     # as root
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

from bench.crowd import BUILD, REPO, Crowd
from bench.discovery import holder_specs
from bench.stage import Stage, load_average
from bench.status_compare import checked, child_env
from bench.timing import Run

SWEEPS_PER_HOUR = 60
CLAIMED = (2, 5)  # the GPUs whose fd holders claim memory
CLAIM_MIB = 4000
LEAK = (4, 30000)  # GPU, MiB


def start_time(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2 :].split()[19])


def clear(stage: Stage) -> None:
    for folder in (stage.state / "claims", stage.state / "leak"):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)


def set_scenario(stage: Stage, holders: dict[str, int], scenario: str) -> None:
    """The stand-in NVML's claims for the listed holders, and the leak where asked."""
    clear(stage)
    claims, leaks = stage.state / "claims", stage.state / "leak"
    for gpu in CLAIMED:
        pid = holders[f"fd:{stage.dev / f'nvidia{gpu}'}"]
        (claims / str(pid)).write_text(f"{CLAIM_MIB} {start_time(pid)} {gpu}\n")
    if scenario == "leak":
        (leaks / str(LEAK[0])).write_text(f"{LEAK[1]}\n")
    elif scenario != "accounted":
        raise SystemExit(f"unknown scenario {scenario!r}: accounted, leak")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1000,5000,20000")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scenarios", default="accounted,leak")
    parser.add_argument("--src", help="another tree's src/ to run (BEFORE), on this venv")
    args = parser.parse_args(argv)
    stage = Stage(BUILD / "stage" / "sweep")
    config = stage.root / "sweep.toml"
    config.write_text(
        f'lock_dir = "{stage.locks}"\nmetrics_textfile = "{stage.root / "metrics.prom"}"\n'
    )
    python = str(REPO / ".venv" / "bin" / "python")
    sweep = [python, "-m", "gpugate", *stage.roots_args(), "sweep", "--config", str(config)]
    floor = [python, "-I", "-c", "pass"]
    env = child_env(stage)
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    print(
        f"gpugate from {args.src or 'this tree'}; cores {os.cpu_count()}, "
        f"affinity {len(os.sched_getaffinity(0))}"
    )
    print(
        "| scenario | extra processes | CPU per sweep, median (range) | `python3 -I -c pass` "
        "| ratio | wall | CPU per hour | of a core |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for count in (int(n) for n in args.counts.split(",")):
        with Crowd(0, holder_specs(stage)) as holders, Crowd(count):
            for scenario in args.scenarios.split(","):
                set_scenario(stage, holders.holders, scenario)
                checked(sweep, env)  # the first writes the bytecode and the state
                loads = [load_average()]
                runs, floors = [], []
                for _ in range(args.runs):
                    runs.append(checked(sweep, env))
                    floors.append(checked(floor, env))
                loads.append(load_average())
                row(scenario, count, [r.cpu for r in runs], [r.cpu for r in floors], runs)
                print(f"  ({scenario}, {count:,}: load {' -> '.join(loads)})", file=sys.stderr)
            clear(stage)
    return 0


def row(scenario: str, count: int, cpu: list[float], floor: list[float], runs: list[Run]) -> None:
    median, base = statistics.median(cpu), statistics.median(floor)
    wall = statistics.median(run.wall for run in runs)
    hour = median * SWEEPS_PER_HOUR
    print(
        f"| {scenario} | {count:,} | {median * 1000:.0f} ms ({min(cpu) * 1000:.0f}-"
        f"{max(cpu) * 1000:.0f}) | {base * 1000:.1f} ms | {median / base:.1f}x "
        f"| {wall * 1000:.0f} ms | {hour:.1f} s | {hour / 3600 * 100:.2f}% |"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
