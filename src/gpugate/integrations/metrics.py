"""Prometheus metrics: a node_exporter textfile rewritten after each run, its counters kept
in `PATH.state` under an flock on `PATH.lock`. A unit's first write puts every result at 0:
increase() sees nothing in a series born at 1 (docs/metrics.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple, TextIO

from gpugate.core.outcome import RunSummary, result_label
from gpugate.errors import ExitCode
from gpugate.host.safe_files import RULE, folder, read_capped, untrusted, why_untrusted, write_in
from gpugate.integrations.records import flocked, parse_record
from gpugate.phase import Phase

STATE_VERSION = 1
RESULTS = ("success", *(code.name.lower() for code in ExitCode if code is not ExitCode.OK))
RELEASE_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RELEASE = "gpugate_memory_release_seconds"

ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})  # a label value's
Labels = tuple[tuple[str, str], ...]
_WARNED: set[Path] = set()


class Family(NamedTuple):
    name: str
    kind: str  # counter, gauge or histogram
    help: str

    @property
    def sample_names(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        return (self.name,)


SWEEP_FAMILIES = (  # rewritten whole by each `gpugate sweep`, not added to
    Family(
        "gpugate_gpu_memory_mib",
        "gauge",
        "GPU memory used, in MiB, by what owns its processes (nobody: no unit, job or "
        "container; unlisted: no process NVML lists), at the last sweep",
    ),
    Family("gpugate_unowned_processes", "gauge", "processes holding the GPU that nothing owns"),
    Family(
        "gpugate_unowned_seconds",
        "gauge",
        "seconds the oldest unowned holder of the GPU has been seen unowned (0: none)",
    ),
    Family(
        "gpugate_session_processes",
        "gauge",
        "processes holding the GPU in a login session whose user is still logged in",
    ),
    Family("gpugate_sweep_timestamp_seconds", "gauge", "Unix time of the last gpugate sweep"),
)
FAMILIES = (
    Family("gpugate_runs_total", "counter", "gpugate runs, by phase, unit and result"),
    Family(
        "gpugate_processes_killed_total", "counter", "processes gpugate stopped, by phase and unit"
    ),
    Family(
        "gpugate_wait_seconds_total",
        "counter",
        "seconds spent waiting for the driver to free GPU memory, by phase and unit",
    ),
    Family(
        "gpugate_reclaimed_mib_total",
        "counter",
        "GPU memory freed by runs (used before the kill minus used after the wait), in MiB",
    ),
    Family(
        "gpugate_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the unit's last run that left this GPU free",
    ),
    Family(
        "gpugate_last_run_failed",
        "gauge",
        "1 when the unit's last run of this phase failed, 0 when it succeeded",
    ),
    Family(
        RELEASE,
        "histogram",
        "seconds from the first signal to the GPU memory being free, runs that killed",
    ),
    *SWEEP_FAMILIES,
)


Samples = dict[str, dict[Labels, float]]  # name -> label set -> value


def run_record(
    phase: str, unit: str, exit_code: ExitCode, summary: RunSummary | None
) -> Callable[[Samples], None]:
    """What one run adds to the counters (record_run's change). unit: the label (a Slurm job's
    runs count under "slurm"); summary: None where an error ended the run (NVML, lock)."""
    finished_at = time.time()
    done = summary or RunSummary()
    return lambda samples: apply(samples, phase, unit, exit_code, done, finished_at)


def apply(
    samples: Samples,
    phase: str,
    unit: str,
    exit_code: ExitCode,
    summary: RunSummary,
    finished_at: float,
) -> None:
    def add(name: str, labels: Mapping[str, str], value: float, *, put: bool = False) -> None:
        key = tuple(sorted(labels.items()))
        family = samples.setdefault(name, {})
        family[key] = value if put else family.get(key, 0) + value

    run = {"phase": phase, "unit": unit}
    # Phases come in pairs (a unit's, a job's): the first write for one writes the other's too.
    systemd = Phase(phase).traits.systemd
    for each_phase in (other.value for other in Phase if other.traits.systemd == systemd):
        for result in RESULTS:  # at 0 from the unit's first write: see the module's doc
            add("gpugate_runs_total", {"phase": each_phase, "unit": unit, "result": result}, 0)
    add("gpugate_runs_total", {**run, "result": result_label(exit_code)}, 1)
    add("gpugate_last_run_failed", run, 0 if exit_code is ExitCode.OK else 1, put=True)
    gpus = {
        gpu.index: {"unit": unit, "gpu": str(gpu.index), "uuid": gpu.uuid} for gpu in summary.owned
    }
    busy = {item.gpu.index for item in summary.busy}
    if exit_code is ExitCode.OK and summary.killed and gpus and not busy:
        release_s = summary.seconds_kill + summary.seconds_wait  # kill to free
        for bound in RELEASE_BUCKETS_S:
            add(f"{RELEASE}_bucket", {**run, "le": _number(bound)}, release_s <= bound)
        add(f"{RELEASE}_bucket", {**run, "le": "+Inf"}, 1)
        add(f"{RELEASE}_sum", run, release_s)
        add(f"{RELEASE}_count", run, 1)
    add("gpugate_processes_killed_total", run, len(summary.killed))
    add("gpugate_wait_seconds_total", run, summary.seconds_wait)
    for index, mib in summary.freed_mib_by_gpu.items():
        if index in gpus:
            add("gpugate_reclaimed_mib_total", gpus[index], mib)
    for index, labels in gpus.items():  # free at the end of a successful run
        if exit_code is ExitCode.OK and index not in busy:
            add("gpugate_last_success_timestamp_seconds", labels, finished_at, put=True)


def render(samples: Samples) -> str:
    """The Prometheus text exposition format (0.0.4), families in a fixed order."""
    lines: list[str] = []
    for family in FAMILIES:
        if not any(samples.get(name) for name in family.sample_names):
            continue
        lines += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.kind}"]
        rows = [
            (labels, name, value)
            for name in family.sample_names
            for labels, value in samples.get(name, {}).items()
        ]
        for labels, name, value in sorted(rows, key=_row_order):
            text = ",".join(f'{key}="{v.translate(ESCAPES)}"' for key, v in labels)
            series = f"{name}{{{text}}}" if text else name
            lines.append(f"{series} {_number(value)}")
    return "\n".join(lines) + "\n"


def _row_order(row: tuple[Labels, str, float]) -> tuple[object, ...]:
    """Series by series; a histogram's buckets in rising `le`, then its sum and count."""
    labels, name, _ = row
    rest = tuple(item for item in labels if item[0] != "le")
    le = dict(labels).get("le")
    return (rest, name.endswith("_bucket") is False, name, float(le) if le else 0.0)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def load_state(state: str, folder_fd: int) -> Samples:
    """The counters so far (file state in folder_fd); a missing or unreadable state
    starts them again from zero (Prometheus takes a counter that goes down as a reset)."""
    try:  # BadRecord is a ValueError, so is a text that is not UTF-8.
        data = parse_record(read_capped(state, dir_fd=folder_fd).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    found = data.get("samples")
    if data.get("version") != STATE_VERSION or not isinstance(found, dict):
        return {}
    samples: Samples = {}
    known = {name for family in FAMILIES for name in family.sample_names}
    for name, entries in found.items():
        for entry in entries if name in known and isinstance(entries, list) else ():
            try:
                labels = tuple(sorted((str(k), str(v)) for k, v in entry["labels"].items()))
                samples.setdefault(name, {})[labels] = float(entry["value"])
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
    return samples


def record_run(textfile: Path, change: Callable[[Samples], None]) -> None:
    """Change the counters (PATH.state) and rewrite the textfile, under PATH.lock (OSError).
    The folder may be the exporter's: all through its descriptor, no link followed."""
    state, lock = (textfile.with_name(textfile.name + suffix) for suffix in (".state", ".lock"))
    with folder(textfile.parent) as folder_fd, flocked(folder_fd, lock.name, lock):
        samples = load_state(state.name, folder_fd)
        change(samples)
        found = {
            name: [{"labels": dict(labels), "value": value} for labels, value in sorted(by.items())]
            for name, by in sorted(samples.items())
        }
        data = json.dumps({"version": STATE_VERSION, "samples": found}, indent=1, sort_keys=True)
        # State first: after a crash between the renames the next run rewrites the textfile.
        write_in(folder_fd, state.name, data.encode() + b"\n")
        write_in(folder_fd, textfile.name, render(samples).encode())


def record_sweep(textfile: Path, gauges: Samples) -> None:
    """Replace the sweep's gauges; the runs' counters are kept."""
    fresh = {family.name: dict(gauges.get(family.name, {})) for family in SWEEP_FAMILIES}
    record_run(textfile, lambda samples: samples.update(fresh))


def record_after_run(
    textfile: Path,
    record: Callable[[Samples], None],
    *,
    stream: TextIO,
    on_failure: Callable[[Path, str], None],
) -> None:
    """Best effort: metrics not written are on_failure(textfile, cause), never a failure."""
    found = untrusted(textfile.parent)
    if found is not None and textfile not in _WARNED:
        _WARNED.add(textfile)  # once per run: every write there is safe, this says why
        print(
            f"gpugate: warning: metrics_textfile {textfile}: {why_untrusted(found)}: gpugate "
            "writes there only through the folder's descriptor, never following a link and "
            f"replacing files by rename ({RULE})",
            file=stream,
        )
    try:
        record_run(textfile, record)
    except OSError as exc:  # TimeoutError (the lock) is one too
        on_failure(textfile, exc.strerror or str(exc))
