"""The wording of what a systemd unit's surroundings do (integrations/unit.py): its GPU leases,
this start's failed pre. The steps say what happened; this module says it in words."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpugate.report.journal import PRIORITY_ERR, PRIORITY_WARNING, Event, Reporter
from gpugate.report.lines import gpu_list
from gpugate.untrusted import FILE, STATE, shown

if TYPE_CHECKING:
    from gpugate.errors import GateError
    from gpugate.host.nvml import Gpu


class UnitNarration:
    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter

    def not_recorded(self, error: GateError) -> None:
        """After a stop: a lease or failed-start record that could not be removed (a read-only
        lock_dir). The run's result stands; the lease is stale once the unit is inactive."""
        self.reporter.event(
            Event.WARNING,
            f"{error.message}; not recorded, {self.reporter.phase} goes on",
            priority=PRIORITY_WARNING,
            reason="state-not-recorded",
            problem=error.code,
        )

    def lease_unreadable(self, path: Path, why: str = "") -> None:
        self.reporter.event(
            Event.WARNING,
            unreadable_record_text(path, "a gpugate lease", why),
            priority=PRIORITY_WARNING,
            reason="lease-unreadable",
        )

    def failed_start_unreadable(self, path: Path, why: str) -> None:
        self.reporter.event(
            Event.WARNING,
            unreadable_record_text(path, "a gpugate failed-start record", why),
            priority=PRIORITY_WARNING,
            reason="failed-start-unreadable",
        )

    def lease_stale(
        self, lease_unit: str, gpus: Sequence[int], state: str, *, dry_run: bool
    ) -> None:
        self.reporter.event(
            Event.WARNING,
            f"GPU lease of {shown(lease_unit, STATE)} on GPU {gpu_list(gpus)} is stale "
            f"({shown(lease_unit, STATE)} is {state}); {'would take' if dry_run else 'taking'} "
            "it over",
            priority=PRIORITY_WARNING,
            gpus=list(gpus),
            reason="lease-stale",
            lease_unit=lease_unit,
            lease_unit_state=state,
        )

    def gpus_shared(self, lease_unit: str, gpus: Sequence[int]) -> None:
        self.reporter.event(
            Event.PROCESS_SPARED,
            f"GPU {gpu_list(gpus)} shared with {shown(lease_unit, STATE)} (share_gpus in both)",
            gpus=list(gpus),
            reason="shared",
            lease_unit=lease_unit,
        )

    def lease_refused(self, refusal: str, gpus: Sequence[int], *, first: bool = True) -> None:
        """first: the run's refusal (STATUS= says it); False: another unit's processes refused
        the run already (the narrator set STATUS=), and its lease holds the GPUs too."""
        self.reporter.event(
            Event.REFUSED,
            f"not starting {self.reporter.unit}: {refusal}",
            priority=PRIORITY_ERR,
            gpus=sorted(gpus),
            reason="leased",
        )
        if first:
            self.reporter.status(f"refused: {refusal}")

    def lease_overridden(self, lease_unit: str, holder: str, gpus: Sequence[int]) -> None:
        self.reporter.event(
            Event.WARNING,
            f"GPU {gpu_list(gpus)} leased to {holder}; starting {self.reporter.unit} anyway "
            "(gpugate run --force)",
            priority=PRIORITY_WARNING,
            gpus=list(gpus),
            reason="lease-forced",
            lease_unit=lease_unit,
        )

    def start_failed_earlier(self, reason: str) -> None:
        # Last, so that `systemctl status` (STATUS= and the journal's tail) shows it.
        text = f"start failed in gpugate pre: {reason}"
        self.reporter.event(
            Event.ERROR, text, priority=PRIORITY_ERR, reason="failed-start", failed_start=reason
        )
        self.reporter.status(text)

    def waiting_skipped(self, gpus: Sequence[Gpu]) -> None:
        self.reporter.event(
            Event.TIMEOUT,
            f"not waiting again on GPU {gpu_list(g.index for g in gpus)}: this start's pre "
            "already waited its wait_timeout_s for that memory",
            priority=PRIORITY_WARNING,
            gpus=[gpu.index for gpu in gpus],
            reason="failed-start",
        )


def unreadable_record_text(path: Path, what: str, why: str) -> str:
    """A state file gpugate reads back that is not one of its records: said once, ignored."""
    because = f" ({why})" if why else ""
    return f"{shown(str(path), FILE)}: not {what}{because}; ignored"


def failed_start_text(
    exit_code: int, exit_name: str, busy: Sequence[tuple[str, int, Sequence[int]]], timeout_s: float
) -> str:
    """What a failed pre records for its post to say: busy is (GPU label, MiB used, PIDs)."""
    if busy:
        return "; ".join(
            f"{label} still {used_mib} MiB used after {timeout_s:g} s"
            f" (PIDs {', '.join(map(str, pids)) or 'none listed'})"
            for label, used_mib, pids in busy
        )
    return f"exit {exit_code} ({exit_name.lower()}); see journalctl for its entries"


def lease_refusal_text(
    conflicts: Sequence[tuple[Sequence[int], str]], *, containers: bool = False
) -> str:
    """Why a start is refused: conflicts are (GPU indices, who holds their lease); containers:
    every lease is a running container's."""
    parts = [f"GPU {', '.join(map(str, gpus))} leased to {holder}" for gpus, holder in conflicts]
    if containers:
        return "; ".join(parts) + (
            ": that container is still running and holds them until it stops;"
            " stop it first, or set share_gpus = true in both configs"
        )
    return (
        "; ".join(parts) + ": that unit is still active or activating and holds them until"
        " its post; stop it first, or set share_gpus = true in both units' configs"
    )
