"""Where each holder stands (the unit's cgroup or containers, an orphan, another unit,
protected, a watcher) and, between starts (`gpugate sweep`, `status`), what owns it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from gpugate.compat import StrEnum
from gpugate.config.file import Config
from gpugate.config.values import MPS_SERVER_NAME
from gpugate.core.discover import Discovery, Holder, Source, memory_accounted
from gpugate.host.logind import Logind, SessionState, session_of_cgroup
from gpugate.host.nvml import mig_parent
from gpugate.host.scan import ProcessId, ProcInfo
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


def role_of(info: ProcInfo, discovery: Discovery, config: Config) -> Role:
    # A unit name counts only where PID 1 made it: a user unit may take any name.
    cgroup = info.cgroup or "/"
    unit = system_unit_of_cgroup(cgroup)
    if info.exe in config.protected_executables or unit in config.protected_units:
        return Role.PROTECTED
    if in_cgroup(cgroup, discovery.unit_cgroup):
        return Role.UNIT
    if unit is not None and unit != "init.scope":
        return Role.OTHER_UNIT
    return Role.ORPHAN


def own_role(holder: Holder, discovery: Discovery, config: Config) -> Role:
    """role_of, and membership of the unit's cgroup.procs or named containers as found."""
    role = role_of(holder.info, discovery, config)
    if role in (Role.PROTECTED, Role.UNIT):
        return role
    if Source.CGROUP in holder.sources:
        return Role.UNIT
    if Source.CONTAINER in holder.sources and holder.container is not None:
        return Role.UNIT_CONTAINER
    return role


def holder_role(
    holder: Holder,
    discovery: Discovery,
    config: Config,
    earlier: Mapping[ProcessId, Role] | None = None,
) -> Role:
    """The holder's role; a watcher as docs/what-gets-killed.md says (memory listed for nobody,
    as a fork that kept a dead parent's context leaves, makes none). earlier: this run's first
    roles: a watcher there stays one while NVML lists it on no GPU, as the driver frees a
    killed holder's memory late (seconds), listed for nobody meanwhile."""
    role = own_role(holder, discovery, config)
    if role not in (Role.ORPHAN, Role.OTHER_UNIT):
        return role
    keys, usage = holder.gpus & discovery.owned_indices, discovery.usage
    on_owned = {key: usage[key] for key in keys if key in usage}
    accounted = keys <= usage.keys() and memory_accounted(on_owned, (), config.free_mib)
    if _device_files_only(holder, discovery) and (not keys or accounted):
        return Role.WATCHER
    was_watcher = earlier is not None and earlier.get(holder.info.ident) is Role.WATCHER
    if was_watcher and Source.NVML not in holder.sources and not holder.ports:
        return Role.WATCHER
    return role


def _device_files_only(holder: Holder, discovery: Discovery) -> bool:
    """NVML's complete lists name it on no GPU, it holds device files, listens on no port.
    Where NVML cannot list processes, device files are all the evidence: no watchers."""
    return (
        discovery.nvml_lists_processes
        and Source.NVML not in holder.sources
        and bool(holder.sources & {Source.DEVICE_FD, Source.DEVICE_MAP})
        and not holder.ports
    )


class ProcessTree(Protocol):
    def info(self, pid: int) -> ProcInfo | None: ...

    def children(self, pid: int) -> list[int]: ...


def _outside(candidate: ProcInfo, holder: ProcInfo, discovery: Discovery, config: Config) -> bool:
    return (
        candidate.pid <= 1
        or candidate.kernel_thread
        or candidate.pid in discovery.self_chain
        or candidate.cgroup != holder.cgroup
        or candidate.uid != holder.uid
        or role_of(candidate, discovery, config) is Role.PROTECTED
    )


def _leads_terminal_session(info: ProcInfo) -> bool:
    """A session of its own on a controlling terminal: a login, a tmux/screen pane, an ssh pty."""
    return info.pid == info.session and info.tty_nr != 0


def _hosts_terminals(info: ProcInfo, tree: ProcessTree) -> bool:
    """A tmux or screen server, sshd, login: a child of it leads a session on a terminal."""
    children = (tree.info(pid) for pid in tree.children(info.pid))
    return any(child is not None and _leads_terminal_session(child) for child in children)


def _hosts(parent: ProcInfo, child: ProcInfo, tree: ProcessTree) -> bool:
    """parent launches more than one application: a job-control shell or a terminal host (by
    any of its children), an orphan-adopting subreaper, a supervisor of sessions."""
    kids = [kid for kid in map(tree.info, tree.children(parent.pid)) if kid is not None]
    if any(_leads_terminal_session(kid) for kid in kids):
        return True
    # A job-control shell starts each job in a process group of its own: any child says so.
    if any(k.session == parent.session and k.pgrp != parent.pgrp for k in [child, *kids]):
        return True
    if child.session == parent.session:
        return False
    if child.pid != child.session:
        return True  # child is in a session it does not lead: parent adopted an orphan
    # several sessions of its own: a supervisor, not one application's launcher
    return any(k.pid != child.pid and k.pid == k.session for k in kids)


def app_tree(
    holder: ProcInfo, tree: ProcessTree, discovery: Discovery, config: Config
) -> dict[int, ProcInfo]:
    """The holder's application: its ancestors up to the nearest host (`_hosts`; same cgroup
    and user, not protected), and their descendants but a session on a terminal or a
    terminal's host. A launcher that started it in a session of its own is left out while its
    process group's leader lives and is not taken (sshd's user process, in its monitor's)."""
    chain = [holder]
    while True:
        top = chain[-1]
        parent = tree.info(top.ppid)
        if parent is None or parent in chain or _outside(parent, holder, discovery, config):
            break
        if _hosts(parent, top, tree):
            break
        chain.append(parent)
    taken = {info.pid for info in chain}
    while len(chain) > 1 and chain[-1].session != chain[-2].session:
        top = chain[-1]
        leader = tree.info(top.pgrp) if top.pgrp != top.pid else None
        if leader is None or leader.state in ("Z", "X") or leader.pid in taken:
            break  # a dead (or zombie) leader leads nothing
        taken.discard(top.pid)
        chain.pop()
    top = chain[-1]
    members: dict[int, ProcInfo] = {top.pid: top}
    queue: list[ProcInfo] = [top]
    while queue:
        current = queue.pop()
        for child_pid in dict.fromkeys(tree.children(current.pid)):
            if child_pid in members:
                continue
            child = tree.info(child_pid)
            if (
                child is None
                or _outside(child, holder, discovery, config)
                or (
                    child.pid != holder.pid
                    and (_leads_terminal_session(child) or _hosts_terminals(child, tree))
                )
            ):
                continue
            members[child_pid] = child
            queue.append(child)
    return members


# Slurm's cgroup/v2 plugin: /system.slice/slurmstepd.scope/job_ID, or NODE_slurmstepd.scope
# (Debian's multiple-slurmd build), with step_*/ below (front/commands/slurm.py).
JOB_CGROUP = re.compile(r"/system\.slice/(?:[^/]+_)?slurmstepd\.scope/job_[0-9]+(?:/.*)?")


class Owner(StrEnum):
    """Who owns a holder between starts: holder_role with no unit asked about."""

    UNIT = "unit"  # an active systemd unit's cgroup (a leased one, `gpugate run`'s)
    JOB = "job"  # a Slurm job's cgroup
    CONTAINER = "container"  # a docker or podman container's scope
    PROTECTED = "protected"  # protected_executables / protected_units
    WATCHER = "watcher"  # device files only: NVML lists it on no GPU, it maps no GPU's memory
    SESSION = "session"  # in a logind session its user is still logged in to (attended)
    NOBODY = "nobody"  # a closed session's scope, a user's scope, init.scope: nothing to stop it


OWNERS = tuple(Owner)


def owner_of(
    holder: Holder, discovery: Discovery, config: Config, logind: Logind | None = None
) -> Owner:
    """discovery: one made without a unit (status's, the sweep's); logind: where sessions'
    states are read (None: the host's)."""
    role = own_role(holder, discovery, config)
    if role is Role.PROTECTED:
        return Owner.PROTECTED
    # The sweep's watcher, whatever the GPUs' memory says: it maps no GPU's memory either.
    watching = _device_files_only(holder, discovery) and not holder.mapped
    if role in (Role.ORPHAN, Role.OTHER_UNIT) and watching:
        return Owner.WATCHER
    if holder.container is not None:
        return Owner.CONTAINER
    if JOB_CGROUP.fullmatch(holder.info.cgroup or "/"):
        return Owner.JOB
    if role is Role.ORPHAN:
        session = session_of_cgroup(holder.info.cgroup)
        if session is not None and (logind or Logind()).state(session) is not SessionState.CLOSED:
            return Owner.SESSION
        return Owner.NOBODY
    return Owner.UNIT


def holds_memory(holder: Holder, key: int, discovery: Discovery) -> bool:
    """Evidence that holder has memory on GPU (or slice) key: NVML lists it there with memory
    (or with an amount it does not say), or it maps the GPU's /dev/nvidiaN. Where NVML cannot
    list processes, holding the GPU's device files is the evidence."""
    if not discovery.nvml_lists_processes:
        return key in holder.gpus
    mapped = key in holder.mapped or mig_parent(key) in holder.mapped
    return mapped or holder.used_mib.get(key, 0) != 0


class HolderOwner(NamedTuple):
    """A holder and the owner `gpugate sweep` attributes it to."""

    holder: Holder
    owner: Owner

    @property
    def mib(self) -> int | None:
        """Return NVML's MiB for the holder over every GPU, or None where NVML said none."""
        known = [mib for mib in self.holder.used_mib.values() if mib is not None]
        return sum(known) if known else None


def is_mps_server(info: ProcInfo, config: Config) -> bool:
    """A CUDA MPS server (docs/mps.md): its executable (the kernel's /proc/PID/exe) is a
    protected one, named as NVIDIA names the server (only root's config makes one protected)."""
    exe = info.exe
    return (
        exe is not None
        and exe in config.protected_executables
        and os.path.basename(exe) == MPS_SERVER_NAME
    )


def mps_served(discovery: Discovery, config: Config) -> frozenset[int]:
    """The run's owned GPU keys that an MPS server holds (NVML's list where it names the
    server, else its device files: Holder.using): shared on purpose for every run, beside
    what its Workload share (rule (c) of docs/what-gets-killed.md)."""
    owned = discovery.owned_indices
    servers = (h for h in discovery.holders.values() if is_mps_server(h.info, config))
    return frozenset(key for server in servers for key in server.using & owned)


def config_shares(discovery: Discovery, config: Config) -> frozenset[int]:
    """What a run's config alone shares, where its surroundings are not at hand (`status`,
    `gpugate run`'s check before the start): with share_gpus every owned GPU, and the GPUs an
    MPS server holds."""
    owned = frozenset(discovery.owned_indices) if config.share_gpus else frozenset()
    return owned | mps_served(discovery, config)
