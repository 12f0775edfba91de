"""Manual runs: `gpugate pre|post UNIT` typed in a shell against a running unit.

systemd runs a unit's ExecStartPre= and ExecStopPost= in the unit's own cgroup with
INVOCATION_ID set; a run that has neither is not the unit's hook. Against a unit that is
active or activating such a run would kill the running service, so it refuses unless given
--force. --dry-run is always allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

from gpugate.errors import GateError, ManualRunRefused
from gpugate.host.systemd import own_unit
from gpugate.phase import Phase
from gpugate.report.untrusted import cut

RUNNING = frozenset({"active", "activating", "reloading", "refreshing"})


def in_own_hook(unit: str, environ: Mapping[str, str], proc_root: Path = Path("/proc")) -> bool:
    return bool(environ.get("INVOCATION_ID")) and own_unit(proc_root) == unit


def manual_run_guard(
    phase: Phase,
    unit: str,
    unit_state: Callable[[str], str | None],
    environ: Mapping[str, str],
    *,
    force: bool,
    dry_run: bool,
    proc_root: Path = Path("/proc"),
) -> str | None:
    """Why this run must not kill, or None where it may: --force, --dry-run, the unit's own
    hook (systemd is not even asked), or a unit that is not running."""
    if not phase.traits.guards_manual_run or force or dry_run:
        return None
    if in_own_hook(unit, environ, proc_root):
        return None
    active_state = unit_state(unit)
    if active_state not in RUNNING:
        return None
    return (
        f"{unit} is {active_state} and this `gpugate {phase}` is not its {phase} hook "
        "(not in the unit's cgroup with INVOCATION_ID set)"
    )


def refusal(reason: str, phase: str, unit: str, would_kill: list[str]) -> GateError:
    # Each already shown (escaped) by describe(); one line, each short.
    would_kill = [cut(re.sub(r"\s+", " ", text), 120) for text in would_kill]
    listed = "; ".join(would_kill[:5]) + (
        f"; and {len(would_kill) - 5} more" if len(would_kill) > 5 else ""
    )
    what = (
        f"it would kill {len(would_kill)} process(es): {listed}"
        if would_kill
        else "it would kill nothing now"
    )
    return ManualRunRefused(
        f"{reason}; {what}; nothing killed. To do it on purpose: gpugate {phase} {unit} --force"
    )
