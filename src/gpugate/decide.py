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
    return role_of(
        holder.info,
        discovery,
        config,
        member=Source.CGROUP in holder.sources,
        own_container=Source.CONTAINER in holder.sources and holder.container is not None,
    )


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
        if role is Role.PROTECTED:
            choice = Choice(holder, role, Verdict.SPARE, "protected by configuration")
        elif role is Role.UNIT:
            choice = Choice(holder, role, Verdict.KILL, f"in {discovery.unit}'s cgroup")
        elif role is Role.UNIT_CONTAINER and holder.container is not None:
            reason = f"in {holder.container.label}, one of {discovery.unit}'s (containers)"
            choice = Choice(holder, role, Verdict.KILL, reason)
        elif not on_owned:
            why = "holds only control devices" if holder.control_devices else "holds no GPU"
            choice = Choice(holder, role, Verdict.SPARE, f"{why} of {discovery.unit}")
        elif foreign:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"holds GPU {gpus} but also GPU {', '.join(map(str, foreign))}, "
                f"which {discovery.unit} does not own",
            )
        elif role is Role.OTHER_UNIT:
            other = unit_of_cgroup(info.cgroup or "/")
            container = holder.container
            if config.kill_other_units:
                who = container.label if container else other
                choice = Choice(holder, role, Verdict.KILL, f"{who} holds GPU {gpus}")
            elif container is not None:
                why = (
                    f"{container.label} holds GPU {gpus} (scope {other}; kill_other_units = "
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
                    f"active unit {other} holds GPU {gpus} (kill_other_units = false)",
                )
        elif policy.kill_orphans:
            choice = Choice(holder, role, Verdict.KILL, f"orphan holding GPU {gpus}")
        else:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"orphan holding GPU {gpus} ({phase}.kill_orphans = false)",
            )
        decision.choices.append(choice)

    if policy.kill_app_tree:
        _add_app_trees(decision, discovery, config, tree)
    return decision


def _add_app_trees(
    decision: Decision, discovery: Discovery, config: GateConfig, tree: ProcessTree
) -> None:
    chosen = {choice.holder.pid for choice in decision.choices}
    owned = discovery.owned_indices
    seeds = [
        choice
        for choice in decision.targets
        if choice.role in (Role.ORPHAN, Role.OTHER_UNIT) and choice.holder.using & owned
    ]
    for seed in seeds:
        members = app_tree(seed.holder.info, tree, discovery, config)
        foreign = [
            pid
            for pid in members
            if pid in discovery.holders and discovery.holders[pid].using - owned
        ]
        if foreign:
            # Taking the rest of this application would reach GPUs the unit does not own.
            continue
        for pid, info in members.items():
            if pid in chosen:
                continue
            chosen.add(pid)
            holder = discovery.holders.get(pid) or Holder(info)
            holder.sources.add(Source.APP_TREE)
            decision.choices.append(
                Choice(
                    holder, seed.role, Verdict.KILL, f"same application as PID {seed.holder.pid}"
                )
            )


def _is_boundary(
    candidate: ProcInfo | None,
    below: ProcInfo,
    holder: ProcInfo,
    discovery: Discovery,
    config: GateConfig,
) -> bool:
    """Where an application ends: its launcher (a shell, a multiplexer, sshd, PID 1) is not it."""
    return (
        candidate is None
        or candidate.pid <= 1
        or candidate.kernel_thread
        or candidate.pid in discovery.self_chain
        or candidate.cgroup != holder.cgroup
        or candidate.uid != holder.uid
        or candidate.pid == candidate.session  # session leaders: login shells, sshd, tmux
        or candidate.pgrp != below.pgrp  # a job-control shell puts each job in its own group
        or role_of(candidate, discovery, config) is Role.PROTECTED
    )


def app_tree(
    holder: ProcInfo, tree: ProcessTree, discovery: Discovery, config: GateConfig
) -> dict[int, ProcInfo]:
    """The holder's application: ancestors up to the nearest boundary, and their descendants."""
    top = holder
    seen = {holder.pid}
    while True:
        parent = tree.info(top.ppid)
        if parent is None or parent.pid in seen:
            break
        if _is_boundary(parent, top, holder, discovery, config):
            break
        seen.add(parent.pid)
        top = parent
    members: dict[int, ProcInfo] = {top.pid: top}
    queue: list[ProcInfo] = [top]
    while queue:
        current = queue.pop()
        for child_pid in _unique(tree.children(current.pid)):
            if child_pid in members:
                continue
            child = tree.info(child_pid)
            if child is None or _is_boundary(child, current, holder, discovery, config):
                continue
            members[child_pid] = child
            queue.append(child)
    return members


def _unique(pids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(pids))
