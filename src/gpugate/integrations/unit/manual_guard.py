"""Manual runs: `gpugate pre|post UNIT` typed in a shell against a running unit.

systemd runs a unit's ExecStartPre= and ExecStopPost= in the unit's own cgroup with
INVOCATION_ID set; a run that has neither is not the unit's hook. Against a unit that is
active or activating such a run would kill the running service, so it refuses unless given
--force. --dry-run is always allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from gpugate.errors import GateError, ManualRunRefused, Problem
from gpugate.host.systemd import own_unit
from gpugate.phase import Phase

RUNNING = frozenset({"active", "activating", "reloading", "refreshing"})


def in_own_hook(unit: str, environ: Mapping[str, str], proc_root: Path = Path("/proc")) -> bool:
    return bool(environ.get("INVOCATION_ID")) and own_unit(proc_root) == unit


def manual_run_guard(
    phase: Phase,
    unit: str,
    unit_state: Callable[[str], str | None],
    environ: Mapping[str, str],
    proc_root: Path = Path("/proc"),
) -> str | None:
    """The running unit's ActiveState where this hand-typed run (not --force, not --dry-run)
    must not kill (the refusal's fact; the words are report/'s), or None where it may: the
    unit's own hook (systemd is not even asked), or a unit that is not running."""
    if not phase.traits.guards_manual_run:
        return None
    if in_own_hook(unit, environ, proc_root):
        return None
    active_state = unit_state(unit)
    if active_state not in RUNNING:
        return None
    return active_state


def refusal(state: str, phase: str, unit: str, would_kill: list[str]) -> GateError:
    """state: the unit's ActiveState, as manual_run_guard found it; would_kill: each target
    as the journal names it."""
    return ManualRunRefused(
        Problem.MANUAL_RUN, unit=unit, state=state, phase=phase, would_kill=would_kill
    )
