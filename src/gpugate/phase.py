"""The four phases and what each does: code asks a phase's traits, never its name."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class PhaseTraits(NamedTuple):
    before_start: bool = False  # the workload starts next: /dev/shm must have its shm_min_free_mib
    kills_orphans: bool = False  # the default of [phase].kill_orphans (and of kill_app_tree)
    checks_ports: bool = False  # the unit's `ports` are holders too: only before a unit starts
    stops_containers: bool = False  # the unit's own containers stop through their runtime first
    takes_lease: bool = False  # checks other units' GPU leases, takes the unit's on success
    releases_lease: bool = False  # the unit's lease ends with it
    records_failed_start: bool = False  # a failure is recorded for the post of the same start
    reads_failed_start: bool = False  # does not wait again on what the failed pre waited for
    guards_manual_run: bool = False  # a hand-typed run against a running unit is refused
    systemd: bool = False  # a systemd unit's hook (else a Slurm job's)
    # Its state (locks, lease, failed-start record) must be writable before it kills: a
    # start it could not record would run ungated. False: after a stop, the kills and
    # removals need no space; what it cannot record is a warning (docs/hardening.md).
    state_required: bool = False


class Phase(Enum):
    PRE = "pre"
    POST = "post"
    PROLOG = "prolog"
    EPILOG = "epilog"

    @property
    def traits(self) -> PhaseTraits:
        return _TRAITS[self]

    def __str__(self) -> str:
        return self.value


_TRAITS = {
    Phase.PRE: PhaseTraits(
        before_start=True,
        kills_orphans=True,
        checks_ports=True,
        stops_containers=True,
        takes_lease=True,
        records_failed_start=True,
        guards_manual_run=True,
        systemd=True,
        state_required=True,
    ),
    # After a stop it kills only what the unit left, not a stranger's server: no orphans.
    Phase.POST: PhaseTraits(
        releases_lease=True, reads_failed_start=True, guards_manual_run=True, systemd=True
    ),
    # Slurm gives out its GPUs itself: no leases, no failed-start records.
    Phase.PROLOG: PhaseTraits(before_start=True, kills_orphans=True, state_required=True),
    Phase.EPILOG: PhaseTraits(kills_orphans=True),  # the job is over: its leftovers die too
}
