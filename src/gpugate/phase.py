"""The four phases and what each one does; the only place that tells one phase from another.

Everything that behaves differently before a start and after a stop asks the phase's traits
(`phase.checks_ports`, `phase.takes_lease`, ...), never its name: a phase gpugate does not
know cannot be constructed (`Phase("prestart")` raises ValueError; the command line offers
only these four).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class PhaseTraits:
    before_start: bool  # the workload starts next: /dev/shm must have its shm_min_free_mib
    kills_orphans: bool  # the default of [phase].kill_orphans (and of kill_app_tree)
    checks_ports: bool  # the unit's `ports` are holders too: only before a systemd unit starts
    stops_containers: bool  # the unit's own containers stop through their runtime first
    takes_lease: bool  # checks other units' GPU leases, takes the unit's on success
    releases_lease: bool  # the unit's lease ends with it
    records_failed_start: bool  # a failure is recorded for the post of the same start
    reads_failed_start: bool  # does not wait again on what the failed pre waited for
    guards_manual_run: bool  # a hand-typed run against a running unit is refused
    systemd: bool  # a systemd unit's hook (else a Slurm job's)
    # Its state (locks, lease, failed-start record) must be writable before it kills: a
    # start it could not record would run ungated. False: after a stop, the kills and
    # removals need no space; what it cannot record is a warning (docs/hardening.md).
    state_required: bool


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
        releases_lease=False,
        records_failed_start=True,
        reads_failed_start=False,
        guards_manual_run=True,
        systemd=True,
        state_required=True,
    ),
    Phase.POST: PhaseTraits(
        before_start=False,
        kills_orphans=False,  # after a stop: only what the unit left, not a stranger's server
        checks_ports=False,
        stops_containers=False,
        takes_lease=False,
        releases_lease=True,
        records_failed_start=False,
        reads_failed_start=True,
        guards_manual_run=True,
        systemd=True,
        state_required=False,
    ),
    # Slurm gives out its GPUs itself: no leases, no failed-start records.
    Phase.PROLOG: PhaseTraits(
        before_start=True,
        kills_orphans=True,
        checks_ports=False,
        stops_containers=False,
        takes_lease=False,
        releases_lease=False,
        records_failed_start=False,
        reads_failed_start=False,
        guards_manual_run=False,
        systemd=False,
        state_required=True,
    ),
    Phase.EPILOG: PhaseTraits(
        before_start=False,
        kills_orphans=True,  # the job is over at the epilog: its leftovers die too
        checks_ports=False,
        stops_containers=False,
        takes_lease=False,
        releases_lease=False,
        records_failed_start=False,
        reads_failed_start=False,
        guards_manual_run=False,
        systemd=False,
        state_required=False,
    ),
}
