"""Lines more than one command prints beside a run's journal: the `gpugate:` and warning
prefixes, install's plan, a failed job's detail, an internal error. A line printed in one
place is written where it is printed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpugate.errors import ExitCode
from gpugate.untrusted import MARK, line

if TYPE_CHECKING:
    from gpugate.core.outcome import RunSummary

MAX_LISTED_PIDS = 10  # PIDs a line lists before "..."
MAX_LISTED_HOLDERS = 3  # processes named as a file's other holders


def error(text: str) -> str:
    """The one line of an error that ends a command."""
    return f"gpugate: {text}"


def warning(text: str) -> str:
    return f"gpugate: warning: {text}"


def failure_detail(summary: RunSummary | None) -> str:
    """What went wrong, naming the GPUs and MiB where memory stayed used (a drain reason)."""
    if summary is None:
        return "failed"
    exit_code = summary.exit_code
    gpus = ",".join(str(gpu.index) for gpu in summary.owned) or "none"
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
}


def change(action: str, path: object, note: str, *, dry_run: bool, detail: str = "") -> str:
    """One file of install's or uninstall's plan: action and note are install's codes, detail
    the note's fact."""
    verb = CHANGE_VERBS[action][0 if dry_run else 1]
    shown = f" ({CHANGE_NOTES[note].format(detail=detail)})" if note else ""
    return f"{verb} {path}{shown}"


def internal_error_text(exc: BaseException) -> str:
    return (
        f"internal error: {type(exc).__name__}: {line(str(exc))} "
        "(set GPUGATE_DEBUG=1 for a traceback, and please report it)"
    )


def unreadable_holders(pids: Sequence[int], limit: int = MAX_LISTED_PIDS) -> str:
    """Not root: holders among the processes whose open files it may not read are missing."""
    shown = ", ".join(map(str, pids[:limit]))
    more = f", {MARK}" if len(pids) > limit else ""
    return warning(
        f"not permitted to read the open files of {len(pids)} process(es) (PID {shown}{more}): "
        "GPU holders among them are not shown; run as root"
    )
