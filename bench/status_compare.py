"""`gpugate status --json` of this tree and of another checkout, against what an operator
types instead, whole commands interleaved on one crowd (issue 30's targets):

    python3 -m bench.status_compare BEFORE_TREE [--counts 1000,5000] [--runs 5] [--watch-s 20]

Each tree runs from its own .venv (scripts/setup) as `python -m gpugate`. The baselines are
`fuser -v` on the stand-in GPU files plus bench/nvml_query.c (each GPU's memory and process
list, in C: nvidia-smi's answer without nvidia-smi), and `lsof` on the same files. CPU is the
child's user + system time from wait4; ratios are per run (baseline ÷ gpugate, above 1: gpugate
is faster), shown as median and range. With --watch-s, `status --watch` of each tree runs
that long at the first count and its CPU time per second of watching is shown. Run as root.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.crowd import BUILD, HERE, REPO, Crowd, compile_c
from bench.discovery import holder_specs
from bench.stage import UNIT, Stage, load_average
from bench.timing import Run, run_timed

STATUS_AFTER, STATUS_BEFORE = "status --json (this tree)", "status --json (before)"
PRE_AFTER, PRE_BEFORE = "pre, clean host (this tree)", "pre, clean host (before)"
FUSER, NVML, LSOF = "fuser -v", "nvml query (C)", "lsof"


def commands(stage: Stage, before: Path, nvml: Path) -> dict[str, list[str]]:
    def gpugate(tree: Path, *argv: str) -> list[str]:
        python = str(tree / ".venv" / "bin" / "python")
        return [python, "-m", "gpugate", *stage.roots_args(), *argv]

    status = ("status", "--json", "--config", str(stage.config))
    pre = ("pre", UNIT, "--config", str(stage.config))
    return {
        STATUS_AFTER: gpugate(REPO, *status),
        STATUS_BEFORE: gpugate(before, *status),
        PRE_AFTER: gpugate(REPO, *pre),
        PRE_BEFORE: gpugate(before, *pre),
        FUSER: ["fuser", "-v", *stage.gpu_paths()],
        NVML: [str(nvml)],
        LSOF: ["lsof", *stage.gpu_paths()],
    }


def checked(argv: list[str], env: dict[str, str]) -> Run:
    run = run_timed(argv, env=env)
    if run.returncode not in (0, 1):  # fuser and lsof exit 1 where they found nothing
        raise RuntimeError(f"{' '.join(argv[:4])}... exited {run.returncode}: {run.stderr}")
    return run


def child_env(stage: Stage) -> dict[str, str]:
    """The stand-in NVML's settings; bytecode cached as an installed gpugate's is (pip writes
    it), in a folder of the bench's own, not in either tree (PYTHONDONTWRITEBYTECODE off)."""
    env = stage.env()
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(BUILD / "pycache")
    return env


def timed_cases(
    stage: Stage, cases: dict[str, list[str]], count: int, runs: int, *, holders: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(CPU, wall) of each case, interleaved; with the GPU holders, or on a clean host."""
    env = child_env(stage)
    for argv in cases.values():
        checked(argv, env)  # a first run writes the bytecode
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    wall: dict[str, list[float]] = {name: [] for name in cases}
    with Crowd(0, holder_specs(stage) if holders else ()), Crowd(count):
        loads = [load_average()]
        # A fresh order each repeat (seeded: the same in every bench run): whatever runs right
        # after lsof pays 10-20% more CPU (measured), and a rotation puts the same case there
        # every time.
        shuffler = random.Random(count)
        for _ in range(runs):
            order = list(cases.items())
            shuffler.shuffle(order)
            for name, argv in order:
                run = checked(argv, env)
                cpu[name].append(run.cpu)
                wall[name].append(run.wall)
        loads.append(load_average())
    print(f"\n{count:,} extra processes, {runs} interleaved runs; load {' -> '.join(loads)}")
    _medians(cpu, wall)
    return cpu, wall


def _medians(cpu: dict[str, list[float]], wall: dict[str, list[float]]) -> None:
    for name, times in cpu.items():
        print(
            f"  {name}: CPU {statistics.median(times) * 1000:.0f} ms "
            f"({min(times) * 1000:.0f}-{max(times) * 1000:.0f}), "
            f"wall {statistics.median(wall[name]) * 1000:.0f} ms"
        )


def one_scale(stage: Stage, cases: dict[str, list[str]], count: int, runs: int) -> None:
    status = {name: cases[name] for name in (STATUS_AFTER, STATUS_BEFORE, FUSER, NVML, LSOF)}
    cpu, _ = timed_cases(stage, status, count, runs, holders=True)
    both = [f + n for f, n in zip(cpu[FUSER], cpu[NVML])]
    for side, status in (("this tree", STATUS_AFTER), ("before", STATUS_BEFORE)):
        _ratio(f"(fuser -v + nvml) ÷ status, {side}", both, cpu[status])
        _ratio(f"lsof ÷ status, {side}", cpu[LSOF], cpu[status])
    _ratio("status before ÷ this tree", cpu[STATUS_BEFORE], cpu[STATUS_AFTER])


def clean_pre(stage: Stage, cases: dict[str, list[str]], count: int, runs: int) -> None:
    """`gpugate pre` with nothing to kill (no holders), each tree."""
    pre = {name: cases[name] for name in (PRE_AFTER, PRE_BEFORE)}
    cpu, _ = timed_cases(stage, pre, count, runs, holders=False)
    _ratio("pre before ÷ this tree", cpu[PRE_BEFORE], cpu[PRE_AFTER])


def _ratio(what: str, baseline: list[float], ours: list[float]) -> None:
    ratios = [b / o for b, o in zip(baseline, ours) if o > 0]
    print(
        f"  CPU ratio {what}: median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f})"
    )


def watch_cpu(stage: Stage, cases: dict[str, list[str]], count: int, seconds: float) -> None:
    """status --watch of each tree, one after the other, SECONDS each: CPU per second."""
    env = child_env(stage)
    with Crowd(0, holder_specs(stage)), Crowd(count):
        for name in (STATUS_AFTER, STATUS_BEFORE):
            argv = [arg for arg in cases[name] if arg != "--json"] + ["--watch"]
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
            started = time.monotonic()
            time.sleep(seconds)
            proc.send_signal(signal.SIGINT)  # our own child: how --watch ends
            _, _, usage = os.wait4(proc.pid, 0)
            elapsed = time.monotonic() - started
            share = (usage.ru_utime + usage.ru_stime) / elapsed * 100
            print(f"  --watch {name}: {share:.1f}% of a core over {elapsed:.0f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the other checkout (its .venv is used)")
    parser.add_argument("--counts", default="1000,5000")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--watch-s", type=float, default=0.0)
    parser.add_argument("--pre-runs", type=int, default=0, help="pre on a clean host, 1,000")
    args = parser.parse_args(argv)
    stage = Stage(BUILD / "stage" / "status")
    nvml = compile_c(HERE / "nvml_query.c", "nvml_query", "-ldl")
    cases = commands(stage, args.before, nvml)
    print(f"cores {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}")
    counts = [int(n) for n in args.counts.split(",")]
    for count in counts:
        one_scale(stage, cases, count, args.runs)
    if args.pre_runs:
        clean_pre(stage, cases, 1000, args.pre_runs)
    if args.watch_s:
        print(f"\nstatus --watch at {counts[0]:,} extra processes:")
        watch_cpu(stage, cases, counts[0], args.watch_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
