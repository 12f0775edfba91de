"""`gpugate --help` start-up of two checkouts, interleaved: each one's console script and
`python -m gpugate`, from its own .venv (scripts/setup), CPU time (user + system, from wait4)
and wall time, medians; each also against its floor, `python -I -c pass` on the same venv's
interpreter in the same runs.

    python3 -m bench.help_compare BEFORE_TREE AFTER_TREE [RUNS]    # RUNS: 40

Each tree's src/ is byte-compiled first, as an installed package is: with
PYTHONDONTWRITEBYTECODE set, every run would compile gpugate's modules again.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLOOR = "python -I -c pass"


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one run to its end."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", env=env
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed")
    return usage.ru_utime + usage.ru_stime, wall


def main(argv: list[str]) -> int:
    trees = {"before": Path(argv[1]), "after": Path(argv[2])}
    runs = int(argv[3]) if len(argv) > 3 else 40
    cases = {
        FLOOR: lambda tree: [str(tree / ".venv/bin/python"), "-I", "-c", "pass"],
        "console script": lambda tree: [str(tree / ".venv/bin/gpugate"), "--help"],
        "python -m gpugate": lambda tree: [
            str(tree / ".venv/bin/python"),
            "-m",
            "gpugate",
            "--help",
        ],
    }
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for tree in trees.values():
        compile_all = [str(tree / ".venv/bin/python"), "-m", "compileall", "-q", str(tree / "src")]
        subprocess.run(compile_all, check=True, stdout=subprocess.DEVNULL)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    load_before = " ".join(f"{load:.2f}" for load in os.getloadavg())
    for run in range(runs):
        sides = list(trees.items())
        for case, argv_of in cases.items():
            for side, tree in sides if run % 2 == 0 else sides[::-1]:
                samples.setdefault((case, side), []).append(timed(argv_of(tree), env))
    load_after = " ".join(f"{load:.2f}" for load in os.getloadavg())
    print(f"{runs} runs each; load average {load_before} before, {load_after} after")
    for index, what in ((0, "CPU"), (1, "wall")):
        floor = {
            side: statistics.median(sample[index] for sample in samples[(FLOOR, side)]) * 1000
            for side in trees
        }
        for case in cases:
            old, new = (
                statistics.median(sample[index] for sample in samples[(case, side)]) * 1000
                for side in trees
            )
            print(
                f"{case}, {what}: before {old:.1f} ms ({old / floor['before']:.2f}x floor), "
                f"after {new:.1f} ms ({new / floor['after']:.2f}x floor), {new / old:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
