"""Decision: which holders gpugate kills, which it spares, and which stop it.

Pure logic over what `discover` found and a view of the process tree; nothing here reads
/proc or signals, so the rules can be tested over arbitrary process tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from gpugate.config import GateConfig
from gpugate.discover import Discovery, Holder, Source
from gpugate.procfs import ProcInfo
from gpugate.units import is_user_cgroup, unit_of_cgroup


class ProcessTree(Protocol):
    def info(self, pid: int) -> ProcInfo | None: ...

    def children(self, pid: int) -> list[int]: ...


class Role(StrEnum):
    UNIT = "unit"  # in the unit's own cgroup
    UNIT_CONTAINER = "unit-container"  # in a container its config names (`containers`)
    ORPHAN = "orphan"  # outside any other service: a login session, a user scope, the root
    OTHER_UNIT = "other-unit"  # inside another active service or scope
    PROTECTED = "protected"  # a driver daemon or monitoring tool: never killed
    WATCHER = "watcher"  # outside the unit, holds device files, NVML lists it on no GPU


class Verdict(StrEnum):
    KILL = "kill"
    SPARE = "spare"  # left alone; it does not hold the unit's GPUs or is protected
    BLOCK = "block"  # holds the unit's GPUs but policy forbids killing it


@dataclass(frozen=True)
class Choice:
    holder: Holder
    role: Role
    verdict: Verdict
    reason: str


@dataclass
class Decision:
    choices: list[Choice] = field(default_factory=list)

    def _with(self, verdict: Verdict) -> list[Choice]:
        return [choice for choice in self.choices if choice.verdict is verdict]

    @property
    def targets(self) -> list[Choice]:
        return self._with(Verdict.KILL)

    @property
    def blockers(self) -> list[Choice]:
        return self._with(Verdict.BLOCK)

    @property
    def spared(self) -> list[Choice]:
        return self._with(Verdict.SPARE)

    @property
    def refused(self) -> bool:
        """Another unit holds the GPUs: kill nothing at all."""
        return any(choice.role is Role.OTHER_UNIT for choice in self.blockers)


def in_cgroup(cgroup: str | None, top: str) -> bool:
    return cgroup is not None and (cgroup == top or cgroup.startswith(top.rstrip("/") + "/"))


def role_of(
    info: ProcInfo,
    discovery: Discovery,
    config: GateConfig,
    *,
    member: bool = False,
    own_container: bool = False,
) -> Role:
    """member: found in the unit's cgroup.procs (which is what counts, also under a stand-in
    cgroup root whose paths /proc does not show); own_container: in the cgroup of a container
    the unit's config names."""
    cgroup = info.cgroup or "/"
    unit = unit_of_cgroup(cgroup)
    if (info.exe is not None and info.exe in config.protected_executables) or (
        unit is not None and unit in config.protected_units
    ):
        return Role.PROTECTED
    if member or in_cgroup(cgroup, discovery.unit_cgroup):
        return Role.UNIT
    if own_container:
        return Role.UNIT_CONTAINER
    if unit is not None and not is_user_cgroup(cgroup) and unit != "init.scope":
        return Role.OTHER_UNIT
    return Role.ORPHAN


def holder_role(holder: Holder, discovery: Discovery, config: GateConfig) -> Role:
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


def decide(discovery: Discovery, config: GateConfig, phase: str, tree: ProcessTree) -> Decision:
    policy = config.policy(phase)
    owned = discovery.owned_indices
    decision = Decision()
    for holder in sorted(discovery.holders.values(), key=lambda h: h.pid):
        info = holder.info
        if info.pid <= 1 or info.pid in discovery.self_chain or info.kernel_thread:
            continue
        role = holder_role(holder, discovery, config)
        on_owned = sorted(holder.using & owned)
        foreign = sorted(holder.using - owned)
        gpus = ", ".join(str(index) for index in on_owned)
        held = " and ".join(
            part
            for part in (
                f"GPU {gpus}" if on_owned else "",
                f"port {', '.join(map(str, sorted(holder.ports)))}" if holder.ports else "",
            )
            if part
        )
        if role is Role.PROTECTED:
            choice = Choice(holder, role, Verdict.SPARE, "protected by configuration")
        elif role is Role.WATCHER:
            choice = Choice(
                holder, role, Verdict.SPARE, "a watcher: NVML lists it on no GPU, with no memory"
            )
        elif role is Role.UNIT:
            choice = Choice(holder, role, Verdict.KILL, f"in {discovery.unit}'s cgroup")
        elif role is Role.UNIT_CONTAINER and holder.container is not None:
            reason = f"in {holder.container.label}, one of {discovery.unit}'s (containers)"
            choice = Choice(holder, role, Verdict.KILL, reason)
        elif not on_owned and not holder.ports:
            why = "holds only control devices" if holder.control_devices else "holds no GPU"
            choice = Choice(holder, role, Verdict.SPARE, f"{why} of {discovery.unit}")
        elif foreign:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"holds {held or 'no GPU of it'} but also GPU {', '.join(map(str, foreign))}, "
                f"which {discovery.unit} does not own",
            )
        elif role is Role.OTHER_UNIT:
            other = unit_of_cgroup(info.cgroup or "/")
            container = holder.container
            if config.kill_other_units:
                who = container.label if container else other
                choice = Choice(holder, role, Verdict.KILL, f"{who} holds {held}")
            elif container is not None:
                why = (
                    f"{container.label} holds {held} (scope {other}; kill_other_units = "
                    f'false); if it is {discovery.unit}\'s, set containers = ["{container.handle}"]'
                    f" in its gpugate config (gpugate install {discovery.unit} --container "
                    f"{container.handle})"
                )
                choice = Choice(holder, role, Verdict.BLOCK, why)
            else:
                choice = Choice(
                    holder,
                    role,
                    Verdict.BLOCK,
                    f"active unit {other} holds {held} (kill_other_units = false)",
                )
        elif policy.kill_orphans:
            choice = Choice(holder, role, Verdict.KILL, f"orphan holding {held}")
        else:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"orphan holding {held} ({phase}.kill_orphans = false)",
            )
        decision.choices.append(choice)

    if policy.kill_app_tree:
        _add_app_trees(decision, discovery, config, tree)
    return decision


def _add_app_trees(
    decision: Decision, discovery: Discovery, config: GateConfig, tree: ProcessTree
) -> None:
    # A watcher is not killed on its own account, but goes with an application it is part of.
    watchers = {c.holder.pid: c for c in decision.choices if c.role is Role.WATCHER}
    chosen = {choice.holder.pid for choice in decision.choices} - set(watchers)
    owned = discovery.owned_indices
    seeds = [
        choice
        for choice in decision.targets
        if choice.role in (Role.ORPHAN, Role.OTHER_UNIT)
        and (choice.holder.using & owned or choice.holder.ports)
    ]
    for seed in seeds:
        members = app_tree(seed.holder.info, tree, discovery, config)
        foreign = [
            pid
            for pid in members
            if pid in discovery.holders
            and pid not in watchers
            and discovery.holders[pid].using - owned
        ]
        if foreign:
            # Taking the rest of this application would reach GPUs the unit does not own.
            continue
        for pid, info in members.items():
            if pid in chosen:
                continue
            chosen.add(pid)
            if pid in watchers:
                decision.choices.remove(watchers.pop(pid))
            holder = discovery.holders.get(pid) or Holder(info)
            holder.sources.add(Source.APP_TREE)
            decision.choices.append(
                Choice(
                    holder, seed.role, Verdict.KILL, f"same application as PID {seed.holder.pid}"
                )
            )


def _outside(
    candidate: ProcInfo | None, holder: ProcInfo, discovery: Discovery, config: GateConfig
) -> bool:
    """Never part of a holder's application, whatever the tree looks like."""
    return (
        candidate is None
        or candidate.pid <= 1
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
    for child_pid in tree.children(info.pid):
        child = tree.info(child_pid)
        if child is not None and _leads_terminal_session(child):
            return True
    return False


def _hosts(parent: ProcInfo, child: ProcInfo, tree: ProcessTree) -> bool:
    """parent is the launcher of something other than one application: a job-control shell, a
    terminal host (sshd, tmux or screen server, login), an orphan-adopting subreaper, or a
    process running several sessions (a supervisor)."""
    if child.session == parent.session:
        # A job-control shell starts each job in a process group of its own.
        return child.pgrp != parent.pgrp
    if child.pid != child.session:
        return True  # child is in a session it does not lead: parent adopted an orphan
    if child.tty_nr != 0:
        return True  # parent gave child a terminal: sshd, tmux, screen, login, script
    for sibling_pid in tree.children(parent.pid):
        sibling = tree.info(sibling_pid)
        if sibling is not None and sibling.pid != child.pid and sibling.pid == sibling.session:
            return True  # several sessions of its own: a supervisor, not one app's launcher
    return False


def app_tree(
    holder: ProcInfo, tree: ProcessTree, discovery: Discovery, config: GateConfig
) -> dict[int, ProcInfo]:
    """The holder's application: its ancestors up to the nearest host, and their descendants.

    An ancestor is taken while it only launched this application: same cgroup and user, not
    protected, not PID 1 or gpugate, and not a host of other things (see `_hosts`). A launcher
    that started the application in a session of its own is left out while its process group's
    leader lives and is not taken (sshd's user process sits in its root monitor's group). Below
    the top every descendant is taken except what leaves the cgroup or user, a session on a
    terminal, and a terminal's host (a pane, a login, a tmux server started from inside)."""
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
        for child_pid in _unique(tree.children(current.pid)):
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


def _unique(pids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(pids))
