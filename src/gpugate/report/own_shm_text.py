"""What is said of a unit's own /dev/shm: in `post`'s journal (it went with the unit's
processes) and in `gpugate status` (its size and use)."""

from __future__ import annotations

from typing import Any

from gpugate.host.shm import OwnShm
from gpugate.report.journal import PRIORITY_INFO, Event, Reporter
from gpugate.report.narrate_shm import size_text


def say_own_shm_gone(reporter: Reporter, seen: OwnShm | None) -> None:
    """post, in a unit with a /dev/shm of its own: it goes with the unit's last process.
    seen: what it held, read through a process of the unit still there when post began."""
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
        priority=PRIORITY_INFO,
        **sized,
    )


def own_shm_line(entry: dict[str, Any], shown: Any) -> str:
    """status's table: `/dev/shm of vllm.service (its own): 8.0K used of 64.0G, 2 file(s)`.
    shown: the table's byte formatter."""
    return (
        f"/dev/shm of {entry['unit']} (its own, through PID {entry['pid']}): "
        f"{shown(entry['used_bytes'])} used of {shown(entry['total_bytes'])}, "
        f"{entry['files']} file(s)"
    )
