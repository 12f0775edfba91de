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
from gpugate.untrusted import cut

RUNNING = frozenset({"active", "activating", "reloading", "refreshing"})
MAX_LISTED = 5  # processes a manual-run refusal lists before "and N more"
MAX_LISTED_TEXT = 120  # characters of each


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
    """The running unit's ActiveState where this run must not kill (the refusal's fact; the
    words are report/'s), or None where it may: --force, --dry-run, the unit's own hook
    (systemd is not even asked), or a unit that is not running."""
    if not phase.traits.guards_manual_run or force or dry_run:
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
    # Each already shown (escaped) by describe(); one line, each short.
    shown = [cut(re.sub(r"\s+", " ", text), MAX_LISTED_TEXT) for text in would_kill]
    listed = "; ".join(shown[:MAX_LISTED]) + (
        f"; and {len(shown) - MAX_LISTED} more" if len(shown) > MAX_LISTED else ""
    )
    what = (
        f"it would kill {len(shown)} process(es): {listed}"
        if shown
        else "it would kill nothing now"
    )
    return ManualRunRefused(
        f"{unit} is {state} and this `gpugate {phase}` is not its {phase} hook "
        f"(not in the unit's cgroup with INVOCATION_ID set); {what}; nothing killed. To do it "
        f"on purpose: gpugate {phase} {unit} --force"
    )
