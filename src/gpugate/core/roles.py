"""Where each holder stands: in the unit's cgroup, in one of its containers, an orphan, in
another unit, protected, or a watcher. Pure logic over what `discover` found."""

from __future__ import annotations

from collections.abc import Mapping

from gpugate.compat import StrEnum
from gpugate.config.models import Config
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.host.procfs import ProcessId, ProcInfo
from gpugate.host.systemd import system_unit_of_cgroup


class Role(StrEnum):
    UNIT = "unit"  # in the unit's own cgroup
    UNIT_CONTAINER = "unit-container"  # in a container its config names (`containers`)
    ORPHAN = "orphan"  # outside any other service: a login session, a user scope, the root
    OTHER_UNIT = "other-unit"  # inside another active service or scope
    PROTECTED = "protected"  # a driver daemon or monitoring tool: never killed
    WATCHER = "watcher"  # outside the unit, holds device files, NVML lists it on no GPU


def in_cgroup(cgroup: str | None, top: str) -> bool:
    return cgroup is not None and (cgroup == top or cgroup.startswith(top.rstrip("/") + "/"))


def role_of(
    info: ProcInfo,
    discovery: Discovery,
    config: Config,
    *,
    member: bool = False,
    own_container: bool = False,
) -> Role:
    """member: found in the unit's cgroup.procs (which is what counts, also under a stand-in
    cgroup root whose paths /proc does not show); own_container: in the cgroup of a container
    the unit's config names."""
    # A unit name counts only where PID 1 made the unit (slices above it) outside every
    # account's own tree: a user unit may take any name, nvidia-persistenced.service too.
    cgroup = info.cgroup or "/"
    unit = system_unit_of_cgroup(cgroup)
    if (info.exe is not None and info.exe in config.protected_executables) or (
        unit is not None and unit in config.protected_units
    ):
        return Role.PROTECTED
    if member or in_cgroup(cgroup, discovery.unit_cgroup):
        return Role.UNIT
    if own_container:
        return Role.UNIT_CONTAINER
    if unit is not None and unit != "init.scope":
        return Role.OTHER_UNIT
    return Role.ORPHAN


def holder_role(holder: Holder, discovery: Discovery, config: Config) -> Role:
    role = role_of(
        holder.info,
        discovery,
        config,
        member=Source.CGROUP in holder.sources,
        own_container=Source.CONTAINER in holder.sources and holder.container is not None,
    )
    if role in (Role.ORPHAN, Role.OTHER_UNIT) and is_watcher(holder, discovery, config.free_mib):
        return Role.WATCHER
    return role


def stable_role(
    holder: Holder, discovery: Discovery, config: Config, earlier: Mapping[ProcessId, Role]
) -> Role:
    """holder_role, kept stable within a run: a process judged a watcher earlier in this run
    stays one while NVML lists it on no GPU. After a holder is killed the driver frees its
    memory late (seconds); meanwhile that memory is listed for nobody and the watcher test
    (memory accounted for by the listed processes) cannot pass, though the watcher did not
    change. Once NVML lists it, it uses a GPU and is judged again."""
    role = holder_role(holder, discovery, config)
    if (
        role in (Role.ORPHAN, Role.OTHER_UNIT)
        and earlier.get(holder.info.ident) is Role.WATCHER
        and Source.NVML not in holder.sources
        and not holder.ports
    ):
        return Role.WATCHER
    return role


def is_watcher(holder: Holder, discovery: Discovery, free_mib: int) -> bool:
    """Holds NVIDIA device files only (nvidia-smi -l, nvtop, an exporter): NVML's complete
    process lists name it on no GPU, and on each GPU whose file it holds the memory used is
    accounted for by the processes NVML lists (a forked child that kept a dead parent's
    context holds memory that nobody is listed for: not a watcher)."""
    if (
        not discovery.nvml_lists_processes
        or Source.NVML in holder.sources
        or not holder.sources & {Source.DEVICE_FD, Source.DEVICE_MAP}
        or holder.ports
    ):
        return False
    for index in holder.gpus:
        usage = discovery.usage.get(index)
        if usage is None:
            return False
        listed = [process.used_mib for process in usage.processes]
        if any(mib is None for mib in listed):
            return False  # per-process memory not reported: cannot tell
        if usage.used_mib - sum(mib or 0 for mib in listed) > free_mib:
            return False
    return True
