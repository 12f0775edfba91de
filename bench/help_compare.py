"""`gpugate --help` start-up of two checkouts, interleaved: each one's console script and
`python -m gpugate`, from its own .venv (scripts/setup), CPU time (user + system, from wait4)
and wall time, medians.

    python3 -m bench.help_compare BEFORE_TREE AFTER_TREE [RUNS]    # RUNS: 40
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


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
        "console script": lambda tree: [str(tree / ".venv/bin/gpugate"), "--help"],
        "python -m gpugate": lambda tree: [
            str(tree / ".venv/bin/python"),
            "-m",
            "gpugate",
            "--help",
        ],
    }
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in range(runs):
        sides = list(trees.items())
        for case, argv_of in cases.items():
            for side, tree in sides if run % 2 == 0 else sides[::-1]:
                samples.setdefault((case, side), []).append(timed(argv_of(tree), env))
    print(f"{runs} runs each; load average {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    for case in cases:
        before, after = samples[(case, "before")], samples[(case, "after")]
        for index, what in ((0, "CPU"), (1, "wall")):
            old = statistics.median(sample[index] for sample in before) * 1000
            new = statistics.median(sample[index] for sample in after) * 1000
            print(f"{case}, {what}: before {old:.1f} ms, after {new:.1f} ms, {new / old:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
