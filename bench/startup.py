"""Start-up: `gpugate pre UNIT` on a clean host (nothing to kill), end to end: interpreter,
imports, NVML (the stand-in library), discovery, the empty kill and wait, reporting, exit.

The installed command (README's install: a venv of its own) is timed, with the same machine's
floors next to it: a bare interpreter, the modules a `pre` loads (each one, in the order that
run loaded them), and the scan alone, in-process (bench/probe.py). What is left of the whole
run past the imports and the scan is the rest: config, NVML, cgroup, locks, reporting.

    python3 -m bench.startup [--processes 1000] [--runs 15]   # the split, this tree's .venv

With --no-config, `pre` reads no config file and takes the built-in lock_dir, /run/gpugate: run
it as root in a private mount namespace with a tmpfs on /run (bench/config_startup.py's way):

    unshare -m --propagation private sh -c 'mount -t tmpfs -o mode=755 tmpfs /run && \\
        exec .venv/bin/python -m bench.startup --no-config'
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.crowd import BUILD, REPO, Crowd, Mix
from bench.discovery import Probe
from bench.stage import UNIT, Stage, load_average
from bench.timing import Samples, run_timed

PRE = "gpugate pre (whole run)"
INTERPRETER = "python -c pass"
CONFIG_IMPORT = "import gpugate.config.schema (pydantic)"
ALL_IMPORTS = "import every module pre loads"
SCAN = "the scan alone (in-process, bench/probe.py)"
# Run by the interpreter gpugate runs on: a pre, in-process, then the modules it loaded.
LOADED = """
import sys
from gpugate.front.cli import main
code = main(sys.argv[1:])
loaded = list(sys.modules)
import json
print(json.dumps([code, loaded]), file=sys.__stdout__)
"""


@dataclass
class StartupResult:
    processes: int
    mix: str
    command: str
    samples: dict[str, Samples] = field(default_factory=dict)
    discover_ms: list[float] = field(default_factory=list)  # gpugate's own count, each run
    modules: int = 0  # what a pre loads: every module, the standard library's included

    @property
    def discover_median_ms(self) -> float:
        return statistics.median(self.discover_ms) if self.discover_ms else float("nan")


def _python_of(command: list[str]) -> str:
    """The interpreter a console script runs (its #! line), or the command's own python."""
    script = Path(command[0])
    if len(command) == 1:
        first = script.read_text(errors="replace").splitlines()[0]
        if first.startswith("#!"):
            return first[2:].strip().split()[0]
    return command[0]


def pre_modules(stage: Stage, python: str, pre_args: list[str]) -> list[str]:
    """The modules one `pre` loads, in the order it loaded them."""
    run = run_timed([python, "-c", LOADED, *pre_args], env=stage.env())
    code, modules = json.loads(run.stdout.strip().splitlines()[-1])
    if code != 0:
        raise RuntimeError(f"gpugate pre exited {code}: {run.stderr}")
    return [name for name in modules if name != "__main__"]


def _importer(modules: list[str]) -> str:
    return (
        f"import os\nfor name in {modules!r}:\n"
        "    try:\n        __import__(name)\n    except Exception:\n        pass\nos._exit(0)\n"
    )


def measure_startup(
    stage: Stage,
    command: list[str],
    processes: int,
    runs: int,
    mix: Mix | None = None,
    *,
    config: bool = True,
) -> StartupResult:
    """config: pre reads the stage's config file (it sets lock_dir: pydantic's models)."""
    mix = mix or Mix()
    python = _python_of(command)
    exit_now = "import os; os._exit(0)"
    pre_args = [*stage.roots_args(), "pre", UNIT]
    pre_args += ["--config", str(stage.config)] if config else []
    cases = {
        PRE: [*command, *pre_args],
        INTERPRETER: [python, "-c", "pass"],
        CONFIG_IMPORT: [python, "-c", f"import gpugate.config.schema; {exit_now}"],
    }
    result = StartupResult(processes, mix.describe(processes), " ".join(command[:1]))
    result.samples = {name: Samples() for name in [*cases, ALL_IMPORTS, SCAN]}
    with Crowd(processes, mix=mix):
        modules = pre_modules(stage, python, pre_args)
        result.modules = len(modules)
        cases[ALL_IMPORTS] = [python, "-c", _importer(modules)]
        probe = Probe(stage)
        try:
            for _ in range(runs):
                for name, argv in cases.items():
                    run = run_timed(argv, env=stage.env())
                    if run.returncode != 0:
                        raise RuntimeError(f"{argv[0]} exited {run.returncode}: {run.stderr}")
                    if name == PRE:
                        _check_clean(run.stderr, result)
                    result.samples[name].add(run.wall, run.cpu, run.rss_kib)
                wall, cpu, _ = probe.ask("scan")
                result.samples[SCAN].add(wall, cpu)
        finally:
            probe.close()
    return result


def _check_clean(stderr: str, result: StartupResult) -> None:
    if "0 process(es) stopped" not in stderr:
        raise RuntimeError(f"gpugate pre did something on a clean host:\n{stderr}")
    if found := re.search(r"discover (\d+) ms", stderr):
        result.discover_ms.append(float(found.group(1)))


def split(result: StartupResult) -> list[tuple[str, float]]:
    """The whole run's CPU (medians, ms): interpreter, imports, scan, rest."""
    cpu = {name: samples.cpu_ms for name, samples in result.samples.items()}
    imports = cpu[ALL_IMPORTS] - cpu[INTERPRETER]
    rest = cpu[PRE] - cpu[ALL_IMPORTS] - cpu[SCAN]
    return [
        ("interpreter (python -c pass)", cpu[INTERPRETER]),
        (f"imports ({result.modules} modules)", imports),
        ("scan (in-process)", cpu[SCAN]),
        ("rest (config, NVML, cgroup, locks, reporting)", rest),
        ("whole run", cpu[PRE]),
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--no-config", action="store_true", help="pre reads no config file")
    args = parser.parse_args(argv)
    load_before = load_average()
    command = [str(REPO / ".venv" / "bin" / "gpugate")]
    stage = Stage(BUILD / "stage" / "split")
    config = not args.no_config
    result = measure_startup(stage, command, args.processes, args.runs, config=config)
    print(f"{args.runs} interleaved runs, {result.mix}; load {load_before} -> {load_average()}")
    print("pre reads " + ("the stage's config file" if config else "no config file"))
    for name, samples in result.samples.items():
        print(f"{name}: CPU {samples.cpu_ms:.1f} ms, wall {samples.wall_ms:.1f} ms")
    whole = result.samples[PRE].cpu_ms
    for name, value in split(result):
        print(f"| {name} | {value:.1f} ms | {value / whole:.0%} |")
    print(f"discover (gpugate's own count, wall): {result.discover_median_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
