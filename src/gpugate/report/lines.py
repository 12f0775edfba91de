"""Lines more than one command prints, and the narration off a plain pre's path: `sweep`,
post's own /dev/shm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpugate.core.discover import Holder
from gpugate.host.scan import ProcessId
from gpugate.host.shm import OwnShm
from gpugate.report.journal import PRIORITY_WARNING, Event, Reporter
from gpugate.report.narrate import gpu_list, size_text
from gpugate.untrusted import COMMAND, field_bytes, printable, safe_line


def error(text: str) -> str:
    return f"gpugate: {text}"


def warning(text: str) -> str:
    return f"gpugate: warning: {text}"


def internal_error_text(exc: BaseException) -> str:
    return (
        f"internal error: {type(exc).__name__}: {safe_line(str(exc))} "
        "(set GPUGATE_DEBUG=1 for a traceback, and please report it)"
    )


def unowned_seen(reporter: Reporter, holder: Holder, mib: int | None) -> None:
    """`gpugate sweep`: a holder first seen unowned (said once, not once a minute)."""
    info = holder.info
    used = "unknown MiB" if mib is None else f"{mib} MiB"
    reporter.event(
        Event.UNOWNED_SEEN,
        f"PID {info.pid} ({info.user}) holds GPU {gpu_list(holder.using, ',', '-')} ({used}) and "
        f"no unit, job or container owns it: {printable(info.command, COMMAND)}",
        priority=PRIORITY_WARNING,
        pid=info.pid,
        gpus=sorted(holder.using),
        used_mib=mib,
        start_time=info.start_time,
        account=info.user,
        command=field_bytes(info.command, COMMAND),
    )


def unowned_gone(reporter: Reporter, ident: ProcessId, gpus: Sequence[int], seconds: float) -> None:
    reporter.event(
        Event.UNOWNED_GONE,
        f"PID {ident.pid}, unowned on GPU {gpu_list(gpus, ',', '-')} for {seconds:.0f} s, "
        "holds no GPU now",
        pid=ident.pid,
        gpus=list(gpus),
        start_time=ident.start_time,
        unowned_s=f"{seconds:.0f}",
    )


def sweep_state_refused(reporter: Reporter, path: object, why: str) -> None:
    reporter.warn(
        "sweep-state-refused",
        f"{path}: not the sweep's state ({why}): every unowned holder is new again",
    )


def sweep_state_unwritten(reporter: Reporter, path: object, cause: str) -> None:
    reporter.warn(
        "sweep-state-unwritten",
        f"sweep state not written to {path}: {cause}; unowned time starts again next sweep",
    )


def sweep_status(
    reporter: Reporter, unowned: int, gpus: Sequence[int], reaped: Sequence[int]
) -> None:
    """The sweep unit's STATUS= (`systemctl status gpugate-sweep`)."""
    text = f"{unowned} unowned holder(s) on GPU {gpu_list(gpus, ',', '-')}"
    text = text if unowned else "no process holds a GPU unowned"
    reporter.status(text + (f"; reaped GPU {gpu_list(reaped, ',', '-')}" if reaped else ""))


def say_own_shm_gone(reporter: Reporter, seen: OwnShm | None) -> None:
    """post, in a unit with a /dev/shm of its own; seen: read through a process of the unit."""
    if seen is None:
        held = "its processes were gone when post began"
        sized: dict[str, Any] = {}
    else:
        held = (
            f"{seen.files} file(s), {size_text(seen.used_bytes)} in use, "
            f"seen through PID {seen.pid}"
        )
        sized = {"shm_files": seen.files, "shm_bytes": seen.used_bytes, "pid": seen.pid}
    reporter.event(
        Event.SHM_OWN,
        f"the unit's own /dev/shm ({held}) goes with its last process: "
        "none of it is in the host's /dev/shm",
        **sized,
    )


def hook_failed(stage: str, text: str) -> str:
    """`gpugate oci-hook STAGE`'s one line on stderr: the runtime shows it as the hook's error."""
    return f"gpugate: oci-hook {stage}: {text}"
