"""Issue 50's two figures for `gpugate pre UNIT`, the unit as `gpugate install` leaves it (its
config file in place), on a clean stand-in host (nothing to kill):

- without a crowd: pre's CPU against `python3 -I -c pass` (target: at most 120 ms);
- with N extra processes: pre's CPU against what an operator runs by hand to see the same, run
  side by side: `fuser -v` on every stand-in `/dev/nvidia*` plus a pynvml query of every GPU's
  memory and processes (a Python process: import pynvml, init, per GPU memory and compute
  processes, shutdown). Target: at most 1.25x their sum.

    python3 -m bench.pre_cost [--processes 1000] [--runs 21]

`pre` reads the file through the config cache as every start after the first does; the same
file with a comment added before each run (the first start after an edit: parsed and
validated) is shown beside it. Runs are interleaved (each command once per round); figures
are medians of CPU time (user + system, from wait4), the measure the load of other sessions
on this machine changes least.
gpugate runs as the README installs it for tests: this tree's .venv and its console script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.config_startup import installed_config
from bench.crowd import REPO, Crowd
from bench.stage import UNIT, Stage, load_average
from bench.timing import run_timed

FLOOR = "python3 -I -c pass"
PRE = "gpugate pre UNIT (install's config file)"
EDITED = "gpugate pre UNIT, its file just edited (validated again)"
FUSER = "fuser -v /dev/nvidia*"
PYNVML = "pynvml: every GPU's memory and processes"
QUERY = """
import pynvml
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pynvml.nvmlDeviceGetMemoryInfo(h)
    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
pynvml.nvmlShutdown()
"""


def commands(stage: Stage) -> dict[str, list[str]]:
    python = str(REPO / ".venv" / "bin" / "python")
    gpugate = str(REPO / ".venv" / "bin" / "gpugate")
    config = installed_config(stage)
    edited = config.with_name("edited.toml")
    edited.write_bytes(config.read_bytes())
    devices = sorted(str(path) for path in stage.dev.glob("nvidia*"))
    return {
        FLOOR: [sys.executable, "-I", "-c", "pass"],
        PRE: [gpugate, *stage.roots_args(), "pre", UNIT, "--config", str(config)],
        EDITED: [gpugate, *stage.roots_args(), "pre", UNIT, "--config", str(edited)],
        FUSER: ["/usr/bin/fuser", "-v", *devices],
        PYNVML: [python, "-I", "-c", QUERY],
    }


def measure(processes: int, runs: int) -> dict[str, list[float]]:
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, Crowd(processes):
        stage = Stage(Path(tmp) / "stage")
        argvs = commands(stage)
        env = stage.env()
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode cached, as an installed gpugate's is
        run_timed(argvs[PRE], env=env)  # writes it
        for round_ in range(runs):
            for name, argv in argvs.items():
                if name == EDITED:  # a file the config cache has not seen: parsed and validated
                    with Path(argv[-1]).open("a") as edited:
                        edited.write(f"# edit {round_}\n")
                run = run_timed(argv, env=env)
                # fuser exits 1 where no process uses the files: a clean host
                if run.returncode not in ((0, 1) if name == FUSER else (0,)):
                    raise RuntimeError(f"{name} exited {run.returncode}: {run.stderr[-2000:]}")
                if name in (PRE, EDITED) and "0 process(es) stopped" not in run.stderr:
                    raise RuntimeError(f"gpugate pre did something on a clean host:\n{run.stderr}")
                cpu.setdefault(name, []).append(run.cpu * 1000)
    return cpu


def report(processes: int, cpu: dict[str, list[float]], runs: int) -> list[str]:
    median = {name: statistics.median(values) for name, values in cpu.items()}
    edited = median.pop(EDITED)
    lines = [f"{processes} extra processes, medians of {runs} interleaved runs (CPU ms):"]
    lines += [f"| {name} | {value:.1f} |" for name, value in median.items()]
    by_hand = median[FUSER] + median[PYNVML]
    lines.append(f"| fuser + pynvml, summed | {by_hand:.1f} |")
    lines.append(f"pre ÷ (fuser + pynvml): {median[PRE] / by_hand:.2f} (target at 1,000: 1.25)")
    lines.append(f"| {EDITED} | {edited:.1f} | ÷ (fuser + pynvml): {edited / by_hand:.2f} |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="*", default=[0, 1000])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args(argv)
    print(f"load before: {load_average()}")
    for processes in args.processes:
        print("\n".join(report(processes, measure(processes, args.runs), args.runs)))
    print(f"load after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
