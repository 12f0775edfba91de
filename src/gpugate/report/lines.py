"""The lines the commands print beside a run's journal: warnings and notes on stderr, what
install and `config check` say, a Slurm node's drain reason. The commands say what happened;
this module says it in words."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpugate.errors import ExitCode
from gpugate.report.untrusted import MARK, line

if TYPE_CHECKING:
    from gpugate.core.outcome import RunSummary

MAX_LISTED_PIDS = 10  # PIDs a line lists before "..."
MAX_LISTED_HOLDERS = 3  # processes named as a file's other holders


def gpu_list(indices: Iterable[int]) -> str:
    """GPUs by index, as every line names them: `0, 1, 3`, or `none`."""
    return ", ".join(str(index) for index in sorted(indices)) or "none"


def error(text: str) -> str:
    """The one line of an error that ends a command."""
    return f"gpugate: {text}"


def warning(text: str) -> str:
    return f"gpugate: warning: {text}"


def program_failed(program: str, code: int, said: str) -> str:
    return warning(f"{program} exited {code}: {said}")


def metrics_not_written(path: object, cause: str) -> str:
    return warning(f"metrics not written to {path}: {cause}")


def failure_detail(summary: RunSummary | None) -> str:
    """What went wrong, naming the GPUs and MiB where memory stayed used (a drain reason)."""
    if summary is None:
        return "failed"
    exit_code = summary.exit_code
    gpus = gpu_list(gpu.index for gpu in summary.owned)
    if summary.busy:
        return "; ".join(
            f"GPU {item.gpu.index} ({item.gpu.uuid}) still {item.used_mib} MiB used"
            for item in summary.busy
        )
    if exit_code is ExitCode.UNKILLABLE:
        return f"GPU {gpus}: processes survived SIGKILL (D state?)"
    if exit_code is ExitCode.HELD_BY_OTHERS:
        return f"GPU {gpus}: held by processes gpugate may not kill (another job or unit)"
    return f"GPU {gpus}: {exit_code.name.lower()}"


def drain_reason(phase: str, job_id: int | None, detail: str, code: int) -> str:
    """A failed prolog's or epilog's reason for `scontrol update State=DRAIN`."""
    who = f" job {job_id}" if job_id is not None else ""
    return f"gpugate {phase}{who}: {detail} (exit {code})"


def lease_overridden(indices: Sequence[int], holder: str) -> str:
    shown = ", ".join(map(str, indices))
    return warning(f"GPU {shown} leased to {holder}; --force: running anyway")


def install_unit_unknown_forced(unit: str) -> str:
    return warning(
        f"unit {unit}: systemd knows no such unit (systemctl list-unit-files); installing "
        "anyway (--force)"
    )


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
}


def change(action: str, path: object, note: str, *, dry_run: bool, detail: str = "") -> str:
    """One file of install's or uninstall's plan: action and note are install's codes, detail
    the note's fact."""
    verb = CHANGE_VERBS[action][0 if dry_run else 1]
    shown = f" ({CHANGE_NOTES[note].format(detail=detail)})" if note else ""
    return f"{verb} {path}{shown}"


def said_under(text: str) -> str:
    """A line of report's own words under a file of install's plan (narrate_install)."""
    return f"  {text}"


def not_executable_here(path: object) -> str:
    return warning(f"{path} is not an executable here")


def takes_effect(unit: str) -> str:
    return f"takes effect at the next start: systemctl restart {unit}"


def effective_config(source: str) -> str:
    return f"# effective configuration, from {source}"


def unit_gpus(unit: str, gpus: str | Sequence[object], source: str) -> str:
    shown = gpus if isinstance(gpus, str) else ", ".join(map(str, gpus)) or "none"
    return f"# {unit}'s GPUs: {shown}, from {source}"


def watch_header(unit: str | None) -> str:
    return f"every 1 s: gpugate status{' ' + unit if unit else ''}    (Ctrl-C ends)"


def internal_error_text(exc: BaseException) -> str:
    return (
        f"internal error: {type(exc).__name__}: {line(str(exc))} "
        "(set GPUGATE_DEBUG=1 for a traceback, and please report it)"
    )


def internal_error(exc: BaseException) -> str:
    return error(internal_error_text(exc))


def unit_or_containers(command: str) -> str:
    return f"gpugate {command}: give a UNIT or --containers"


def not_a_uid(value: str) -> str:
    return f"{value[:20]!r} is not a uid"


def not_a_port(value: str) -> str:
    return f"{value!r} is not a TCP port (1-65535)"


def unreadable_holders(pids: Sequence[int], limit: int = MAX_LISTED_PIDS) -> str:
    """Not root: holders among the processes whose open files it may not read are missing."""
    shown = ", ".join(map(str, pids[:limit]))
    more = f", {MARK}" if len(pids) > limit else ""
    return warning(
        f"not permitted to read the open files of {len(pids)} process(es) (PID {shown}{more}): "
        "GPU holders among them are not shown; run as root"
    )
