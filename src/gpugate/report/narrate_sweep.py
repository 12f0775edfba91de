"""What `gpugate sweep` says: a holder first seen unowned and gone again (the journal, once
each, not once a minute), the sweep's STATUS=, the lines it prints, and `status`'s note of how
long a holder has been unowned."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.core.discover import Holder
from gpugate.host.procfs import ProcessId
from gpugate.report.journal import PRIORITY_INFO, PRIORITY_WARNING, Event, Reporter
from gpugate.report.lines import warning
from gpugate.untrusted import COMMAND, exact, shown


def _gpus(indices: Sequence[int]) -> str:
    return ",".join(str(index) for index in sorted(indices)) or "-"


def unowned_seen(reporter: Reporter, holder: Holder, mib: int | None) -> None:
    info = holder.info
    used = "unknown MiB" if mib is None else f"{mib} MiB"
    reporter.event(
        Event.UNOWNED_SEEN,
        f"PID {info.pid} ({info.user}) holds GPU {_gpus(sorted(holder.gpus))} ({used}) and "
        f"no unit, job or container owns it: {shown(info.command, COMMAND)}",
        priority=PRIORITY_WARNING,
        pid=info.pid,
        gpus=sorted(holder.gpus),
        used_mib=mib,
        start_time=info.start_time,
        account=info.user,
        command=exact(info.command, COMMAND),
    )


def unowned_gone(reporter: Reporter, ident: ProcessId, gpus: Sequence[int], seconds: float) -> None:
    reporter.event(
        Event.UNOWNED_GONE,
        f"PID {ident.pid}, unowned on GPU {_gpus(gpus)} for {seconds:.0f} s, holds no GPU now",
        priority=PRIORITY_INFO,
        pid=ident.pid,
        gpus=list(gpus),
        start_time=ident.start_time,
        unowned_s=f"{seconds:.0f}",
    )


def sweep_status(
    reporter: Reporter, unowned: int, gpus: Sequence[int], reaped: Sequence[int]
) -> None:
    """The sweep unit's STATUS= (`systemctl status gpugate-sweep`)."""
    if not unowned:
        text = "no process holds a GPU unowned"
    else:
        text = f"{unowned} unowned holder(s) on GPU {_gpus(gpus)}"
    reporter.status(text + (f"; reaped GPU {_gpus(reaped)}" if reaped else ""))


def state_refused(path: object, why: str) -> str:
    return warning(f"{path}: not the sweep's state ({why}): every unowned holder is new again")


def state_unwritable(path: object, cause: str) -> str:
    return warning(f"sweep state not written to {path}: {cause}")


def unowned_line(pid: int, seconds: int | None) -> str:
    """`status`'s note under the table."""
    since = "?" if seconds is None else f"{seconds} s"
    return f"(PID {pid}: held by nobody, seen unowned by gpugate sweep for {since})"
