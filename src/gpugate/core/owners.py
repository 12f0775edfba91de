"""Who owns each GPU holder between starts (`gpugate sweep`): an active unit, a Slurm job, a
container of a known runtime, protected, a watcher, or nobody. It is `status`'s role
(roles.holder_role, judged with no unit asked about), read once more for what owns the
process: pure logic over what `discover` found."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpugate.compat import StrEnum
from gpugate.config.file import Config
from gpugate.core.discover import Discovery, Holder
from gpugate.core.roles import Role, holder_role

# Slurm's cgroup/v2 plugin: /system.slice/slurmstepd.scope/job_ID, or NODE_slurmstepd.scope
# (Debian's multiple-slurmd build), with step_*/ below (integrations/slurm.py).
JOB_CGROUP = re.compile(r"/system\.slice/(?:[^/]+_)?slurmstepd\.scope/job_[0-9]+(?:/.*)?")


class Owner(StrEnum):
    UNIT = "unit"  # an active systemd unit's cgroup (a leased one, `gpugate run`'s)
    JOB = "job"  # a Slurm job's cgroup
    CONTAINER = "container"  # a docker or podman container's scope
    PROTECTED = "protected"  # protected_executables / protected_units
    WATCHER = "watcher"  # device files only: NVML lists it on no GPU
    NOBODY = "nobody"  # a login session, a user's scope, init.scope: nothing to stop it


OWNERS = tuple(Owner)


def owner_of(holder: Holder, discovery: Discovery, config: Config) -> Owner:
    """discovery: one made without a unit (status's, the sweep's)."""
    role = holder_role(holder, discovery, config)
    if role is Role.PROTECTED:
        return Owner.PROTECTED
    if role is Role.WATCHER:
        return Owner.WATCHER
    if holder.container is not None:
        return Owner.CONTAINER
    if JOB_CGROUP.fullmatch(holder.info.cgroup or "/"):
        return Owner.JOB
    if role is Role.ORPHAN:
        return Owner.NOBODY
    return Owner.UNIT


@dataclass(frozen=True)
class Holding:
    """A holder and its owner; mib: NVML's MiB for it over every GPU (None: not said)."""

    holder: Holder
    owner: Owner

    @property
    def mib(self) -> int | None:
        known = [mib for mib in self.holder.used_mib.values() if mib is not None]
        return sum(known) if known else None
