"""Start-up of `gpugate pre` on a clean stand-in host, two source trees side by side, with and
without a config file, against `python3 -I -c pass` measured in the same run (issue 38).

    python3 -m bench.config_startup BEFORE_SRC AFTER_SRC [--runs 30] [--processes 1000]

Each tree's `src` runs on this interpreter (PYTHONPATH), so both load the same pydantic,
pynvml and psutil. Runs are interleaved (floor, then each case of each tree, repeated) and
reported as medians of CPU time (user + system, from wait4: what the load of other processes
on the machine changes least) and wall time, each also as a ratio to the floor. Run it as
root inside a private mount namespace with a tmpfs on /run, so that the run without a config
takes its built-in lock_dir (/run/gpugate) there and not on the host:

    unshare -m --propagation private sh -c 'mount -t tmpfs -o mode=755 tmpfs /run && \\
        exec .venv/bin/python -m bench.config_startup /tmp/before/src src'
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.crowd import Crowd
from bench.stage import UNIT, Stage
from bench.timing import run_timed

FLOOR = "python3 -I -c pass"  # this interpreter, the one gpugate runs on


def installed_config(stage: Stage) -> Path:
    """The unit's file as `gpugate install --gpus 0` writes it (this tree's skeleton), with the
    stage's lock_dir (the bench host's /run is not the stage's)."""
    from gpugate.front.install import render_config  # noqa: PLC0415

    path = stage.root / "installed.toml"
    text = render_config(UNIT, [0]).replace("# lock_dir = ", "lock_dir = ")
    path.write_text(text.replace('lock_dir = "/run/gpugate"', f'lock_dir = "{stage.locks}"'))
    return path


def cases(stage: Stage) -> dict[str, list[str]]:
    gpugate = [sys.executable, "-m", "gpugate"]
    pre = [*gpugate, *stage.roots_args(), "pre", UNIT]
    installed = str(installed_config(stage))
    return {
        "pre, no config file": pre,  # /etc/gpugate: none on the bench host
        "pre, a file setting lock_dir": [*pre, "--config", str(stage.config)],
        "pre, install's config file": [*pre, "--config", installed],
        "config check FILE (install's)": [*gpugate, "config", "check", installed],
        "--help": [*gpugate, "--help"],
    }


def measure(trees: dict[str, Path], runs: int, processes: int) -> dict[str, dict[str, list[float]]]:
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, Crowd(processes):
        stage = Stage(Path(tmp) / "stage")
        for _ in range(runs):
            argvs = {FLOOR: [sys.executable, "-I", "-c", "pass"]}
            for label in trees:
                for name, argv in cases(stage).items():
                    argvs[f"{label}: {name}"] = argv
            for key, argv in argvs.items():
                env = stage.env()
                label = key.split(":", 1)[0]
                if label in trees:
                    env["PYTHONPATH"] = str(trees[label])
                    # bytecode cached as an installed gpugate's is, apart for each tree
                    env.pop("PYTHONDONTWRITEBYTECODE", None)
                    env["PYTHONPYCACHEPREFIX"] = f"{tmp}/pycache-{label}"
                run = run_timed(argv, env=env)
                if run.returncode != 0:
                    raise RuntimeError(f"{key} exited {run.returncode}: {run.stderr[-2000:]}")
                cpu.setdefault(key, []).append(run.cpu * 1000)
                wall.setdefault(key, []).append(run.wall * 1000)
    return {"cpu": cpu, "wall": wall}


def table(results: dict[str, dict[str, list[float]]], runs: int, processes: int) -> str:
    cpu, wall = results["cpu"], results["wall"]
    floor_cpu, floor_wall = statistics.median(cpu[FLOOR]), statistics.median(wall[FLOOR])
    lines = [
        f"Medians of {runs} interleaved runs, {processes} extra processes on the host.",
        "",
        "| command | CPU ms | CPU ÷ floor | wall ms | wall ÷ floor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in cpu:
        c, w = statistics.median(cpu[key]), statistics.median(wall[key])
        lines.append(f"| {key} | {c:.1f} | {c / floor_cpu:.2f} | {w:.1f} | {w / floor_wall:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the earlier tree's src folder")
    parser.add_argument("after", type=Path, help="the later tree's src folder")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--processes", type=int, default=1000)
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(table(measure(trees, args.runs, args.processes), args.runs, args.processes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
