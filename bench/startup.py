"""Start-up: `gpugate pre UNIT` on a clean host (nothing to kill), end to end: interpreter,
imports, NVML (the stand-in library), discovery, the empty kill and wait, reporting, exit.

The installed command (README's install: a venv of its own) is timed, with the same machine's
floors next to it: a bare interpreter, and the imports gpugate cannot do without.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.crowd import Crowd, Mix
from bench.stage import UNIT, Stage
from bench.timing import Samples, run_timed

PRE = "gpugate pre (whole run)"
INTERPRETER = "python -c pass"
CONFIG_IMPORT = "import gpugate.config.schema (pydantic)"
ALL_IMPORTS = "import everything pre needs"


@dataclass
class StartupResult:
    processes: int
    mix: str
    command: str
    samples: dict[str, Samples] = field(default_factory=dict)
    discover_ms: list[float] = field(default_factory=list)  # gpugate's own count, each run

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


def measure_startup(
    stage: Stage, command: list[str], processes: int, runs: int, mix: Mix | None = None
) -> StartupResult:
    mix = mix or Mix()
    python = _python_of(command)
    exit_now = "import os; os._exit(0)"
    cases = {
        PRE: [*command, *stage.roots_args(), "pre", UNIT, "--config", str(stage.config)],
        INTERPRETER: [python, "-c", "pass"],
        CONFIG_IMPORT: [python, "-c", f"import gpugate.config.schema; {exit_now}"],
        ALL_IMPORTS: [
            python,
            "-c",
            f"import gpugate.front.cli, gpugate.core.run, pynvml, systemd.journal; {exit_now}",
        ],
    }
    result = StartupResult(processes, mix.describe(processes), " ".join(command[:1]))
    result.samples = {name: Samples() for name in cases}
    with Crowd(processes, mix=mix):
        for _ in range(runs):
            for name, argv in cases.items():
                run = run_timed(argv, env=stage.env())
                if run.returncode != 0:
                    raise RuntimeError(f"{' '.join(argv)} exited {run.returncode}: {run.stderr}")
                if name == PRE:
                    if "0 process(es) stopped" not in run.stderr:
                        raise RuntimeError(
                            f"gpugate pre did something on a clean host:\n{run.stderr}"
                        )
                    if found := re.search(r"discover (\d+) ms", run.stderr):
                        result.discover_ms.append(float(found.group(1)))
                result.samples[name].add(run.wall, run.cpu, run.rss_kib)
    return result
