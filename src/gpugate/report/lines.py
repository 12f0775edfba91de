"""Lines more than one command prints beside a run's journal: the `gpugate:` and warning
prefixes, install's plan, a failed job's detail, an internal error. A line printed in one
place is written where it is printed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpugate.core.outcome import UNKILLABLE
from gpugate.untrusted import CGROUP, MARK, REASON, Kind, line, shown

if TYPE_CHECKING:
    from gpugate.core.outcome import BusyGpu, Held, RunSummary

MAX_LISTED_PIDS = 10  # PIDs a line lists before "..."
MAX_LISTED_HOLDERS = 3  # processes named as a file's other holders
MAX_REASON_HOLDERS = 3  # processes a drain reason names
SLURM_JOB_CGROUP = re.compile(r"slurmstepd\.scope/job_([0-9]{1,10})(?:/|$)")
HELD_RULES = {
    "protected": "protected (protected_executables/protected_units)",
    "orphan": "an orphan gpugate may not kill here",
    "other-account": "another account's",
    "watcher": "a watcher",
}


def gpu_list(indices: Iterable[int]) -> str:
    """GPUs by index, as every line names them: `0, 1, 3`, or `none`."""
    return ", ".join(str(index) for index in sorted(indices)) or "none"


def error(text: str) -> str:
    """The one line of an error that ends a command."""
    return f"gpugate: {text}"


def warning(text: str) -> str:
    return f"gpugate: warning: {text}"


def metrics_not_written(path: object, cause: str) -> str:
    return warning(f"metrics not written to {path}: {cause}")


def failure_detail(summary: RunSummary | None) -> str:
    """What still holds the run's GPUs, for a Slurm node's drain reason: each process that
    kept one (up to MAX_REASON_HOLDERS: PID, account, the GPUs, the rule), each GPU whose
    memory stayed used; only those GPUs."""
    if summary is None:
        return "failed"
    parts = [held_text(item) for item in summary.held[:MAX_REASON_HOLDERS]]
    if len(summary.held) > MAX_REASON_HOLDERS:
        parts.append(f"{len(summary.held) - MAX_REASON_HOLDERS} more PID(s)")
    parts.extend(busy_text(item) for item in summary.busy)
    if parts:
        return "; ".join(parts)
    gpus = ",".join(str(gpu.index) for gpu in summary.owned) or "none"
    return f"GPU {gpus}: {summary.exit_code.name.lower()}"


def held_text(item: Held) -> str:
    gpus = f" on GPU {','.join(map(str, item.gpus))}" if item.gpus else ""
    return f"PID {item.pid} ({item.user or '?'}){gpus}: {held_rule(item)}"


def held_rule(item: Held) -> str:
    """The rule in an admin's words: why gpugate left the process alive."""
    if item.rule == UNKILLABLE:
        return "unkillable (survived SIGKILL)"
    if item.rule == "straddles":
        return f"straddles GPU {','.join(map(str, item.foreign))}, not this job's"
    if item.rule in ("other-unit", "other-container"):
        job = SLURM_JOB_CGROUP.search(item.cgroup or "")
        if job:
            return f"in another job ({job.group(1)})"
        return f"in another unit ({shown(item.other or item.cgroup, CGROUP)})"
    return HELD_RULES.get(item.rule, item.rule)


def busy_text(item: BusyGpu) -> str:
    pids = ", ".join(map(str, item.pids[:MAX_REASON_HOLDERS]))
    listed = f", NVML lists PID {pids}" if pids else ""
    return (
        f"GPU {item.gpu.shown} ({item.gpu.uuid}) still {item.used_mib} MiB used: "
        f"memory not freed{listed}"
    )


def drain_reason(phase: str, job_id: int | None, detail: str, code: int) -> str:
    """A failed prolog's or epilog's reason for `scontrol update State=DRAIN`: escaped, no
    double quote (scontrol strips one at either end), at most REASON.chars; the exit code
    stays whole where the detail is cut."""
    who = f" job {job_id}" if job_id is not None else ""
    head, tail = f"gpugate {phase}{who}: ", f" (exit {code})"
    room = REASON.chars - len(head) - len(tail)
    return head + shown(detail.replace('"', "'"), Kind("drain detail", room, room)) + tail


def slurm_no_gpus(said: str) -> str:
    return f"no GPUs to gate ({said})"


def slurm_gpus_unresolved(variable: str, numbers: str, why: str) -> str:
    return (
        f"{variable}={numbers}: slurmd's GPU numbers not resolved ({why}); "
        "only the job's own cgroup is cleaned, nothing outside it is killed"
    )


def slurm_shm(private: bool, plugin: str, dirs: str) -> str:
    if private:
        return f"/dev/shm: private to each job (JobContainerType={plugin}, Dirs={dirs})"
    if plugin:
        return (
            f"/dev/shm: shared by the node's jobs (JobContainerType={plugin}, Dirs={dirs or '-'}); "
            "gpugate removes only the segments of processes it killed"
        )
    return (
        "/dev/shm: shared by the node's jobs (no JobContainerType); gpugate removes only the "
        "segments of processes it killed: JobContainerType=job_container/tmpfs gives each job "
        "its own"
    )


def slurm_shm_unknown(why: str) -> str:
    return f"/dev/shm: not known ({why})"


def slurm_gres_unresolved(node: str, why: str) -> str:
    return (
        f"GPUs of node {node}: slurmd's numbers not resolved ({why}); the hooks clean only a "
        "job's own cgroup"
    )


def slurm_gres_resolved(node: str, path: str, nvml_order: bool) -> str:
    order = "AutoDetect=nvml: NVML's order" if nvml_order else "File= order"
    return f"GPUs of node {node}, as slurmd numbers them ({path}, {order}):"


def slurm_gpu_number(number: int, file: str | None, gpu: str) -> str:
    where = f" {file} =" if file else ""
    return f"  {number} ={where} {gpu}"


def lease_overridden(indices: Sequence[int], holder: str) -> str:
    shown = ", ".join(map(str, indices))
    return warning(f"GPU {shown} leased to {holder}; --force: running anyway")


def reloaded(done: bool) -> str:
    if done:
        return "reloaded systemd (systemctl daemon-reload)"
    return "systemd not reloaded (not running here, or --no-reload)"


CHANGE_VERBS = {
    "write": ("would write", "wrote"),
    "unchanged": ("unchanged", "unchanged"),
    "keep": ("would keep", "kept"),
    "remove": ("would remove", "removed"),
    "absent": ("not there", "not there"),
}
CHANGE_NOTES = {
    "edited": "yours (edited): kept",
    "edited-removable": "yours (edited): kept; --force removes",
    "edited-forced": "replacing your edited file (--force)",
    "runtime-there": "runtime gpugate there",
    "runtime-added": "runtime gpugate: {detail}; every other key kept",
    "runtime-absent": "no runtime gpugate",
    "runtime-removed": "runtime gpugate taken out; every other key kept",
    "containerd-runtime-added": "runtime gpugate with {detail}'s settings; every other line kept",
    "containerd-runtime-default": (
        "runtime gpugate with {detail}'s settings, the CRI default; every other line kept"
    ),
    "containerd-runtime-removed": "runtime gpugate taken out; every other line as it was",
    "containerd-made": "made by gpugate install from `containerd config default`",
    "runs": "gpugate-oci-runtime runs {detail}",
}


def change(action: str, path: object, note: str, *, dry_run: bool, detail: str = "") -> str:
    """One file of install's or uninstall's plan: action and note are install's codes, detail
    the note's fact."""
    verb = CHANGE_VERBS[action][0 if dry_run else 1]
    shown = f" ({CHANGE_NOTES[note].format(detail=detail)})" if note else ""
    return f"{verb} {path}{shown}"


def wrapped_runtime(record: object, recorded: str, name: str, path: str | None) -> str:
    """`config check`'s line on the runtime gpugate-oci-runtime runs (host/wrapped_runtime)."""
    runs = path or f"no {name} installed"
    instead = "" if name == recorded else f"; {recorded} is not installed or is the caller"
    where = f'runtime = "{recorded}" in {record}{instead}'
    return f"# containers: gpugate-oci-runtime runs {runs} ({where})"


def internal_error_text(exc: BaseException) -> str:
    return (
        f"internal error: {type(exc).__name__}: {line(str(exc))} "
        "(set GPUGATE_DEBUG=1 for a traceback, and please report it)"
    )


def unit_or_containers(command: str) -> str:
    return f"gpugate {command}: give a UNIT or --containers (or --sweep), one of them"


def unreadable_holders(pids: Sequence[int], limit: int = MAX_LISTED_PIDS) -> str:
    """Not root: holders among the processes whose open files it may not read are missing."""
    shown = ", ".join(map(str, pids[:limit]))
    more = f", {MARK}" if len(pids) > limit else ""
    return warning(
        f"not permitted to read the open files of {len(pids)} process(es) (PID {shown}{more}): "
        "GPU holders among them are not shown; run as root"
    )


def sweep_timer(*, enabled: bool) -> str:
    if enabled:
        return "enabled gpugate-sweep.timer: a gpugate sweep every minute"
    return "disabled gpugate-sweep.timer: no more sweeps"


def sweep_drain_reason(gpus: Sequence[int], pids: Sequence[int], seconds: float) -> str:
    """scontrol's Reason= for a node whose GPU memory nobody has owned for long (at most
    slurm.MAX_REASON characters: the PIDs are cut first)."""
    listed = ",".join(map(str, pids))
    head = f"gpugate: GPU {','.join(map(str, gpus))} held by nobody for {seconds:.0f}s, PID "
    return head + (listed if len(head) + len(listed) <= 250 else listed[: 249 - len(head)] + "+")


def sweep_unkillable_reason(gpus: Sequence[int], pids: Sequence[int]) -> str:
    listed = ",".join(map(str, pids))
    head = f"gpugate: sweep's reap on GPU {','.join(map(str, gpus))} left unkillable PID "
    return head + (listed if len(head) + len(listed) <= 250 else listed[: 249 - len(head)] + "+")
