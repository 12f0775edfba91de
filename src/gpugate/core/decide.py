"""Decision: which holders gpugate kills, spares, or is stopped by, and by which rule: pure
logic over what `discover` found and a view of the process tree."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple

from gpugate.compat import StrEnum
from gpugate.config.file import Config
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import ProcessTree, Role, app_tree, holder_role
from gpugate.host.scan import ProcessId
from gpugate.host.systemd import system_unit_of_cgroup
from gpugate.phase import Phase


class Verdict(Enum):
    KILL = "kill"
    SPARE = "spare"  # left alone; it does not hold the unit's GPUs or is protected
    BLOCK = "block"  # holds the unit's GPUs but policy forbids killing it


class Rule(StrEnum):
    """The journal's GPUGATE_REASON and `status --json`'s "reason" (words: report/narrate.py)."""

    PROTECTED = "protected"  # protected_executables / protected_units
    WATCHER = "watcher"  # device files open, NVML lists it nowhere (nvidia-smi -l, nvtop)
    CGROUP = "cgroup"  # in the unit's own cgroup
    UNIT_CONTAINER = "unit-container"  # in one of the unit's containers (`containers`)
    NOT_OWNED = "not-owned"  # holds no GPU (or only control devices) of the unit
    STRADDLES = "straddles"  # holds the unit's GPUs and GPUs the unit does not own
    OTHER_UNIT = "other-unit"  # another active unit's process (kill_other_units)
    OTHER_CONTAINER = "other-container"  # another scope's container, not named in `containers`
    ORPHAN = "orphan"  # outside any unit (kill_orphans)
    APP_TREE = "app-tree"  # the rest of an orphan's or other unit's application
    OTHER_ACCOUNT = "other-account"  # not the account a `gpugate run` acts for (--for-uid)
    SHARER = "sharer"  # another workload's process on a GPU the run shares on purpose


class Choice(NamedTuple):
    holder: Holder
    role: Role
    verdict: Verdict
    rule: Rule
    on_owned: tuple[int, ...] = ()  # the unit's GPUs it holds
    foreign: tuple[int, ...] = ()  # GPUs it holds that the unit does not own
    other_unit: str | None = None  # OTHER_UNIT, OTHER_CONTAINER: the unit its cgroup is in
    seed_pid: int | None = None  # APP_TREE: the holder whose application it is part of
    for_uid: int | None = None  # OTHER_ACCOUNT: the account the run acts for


class Decision(NamedTuple):
    """Every holder's choice, in PID order (the application trees' members after them)."""

    choices: list[Choice]

    @property
    def targets(self) -> list[Choice]:
        return [choice for choice in self.choices if choice.verdict is Verdict.KILL]

    @property
    def blockers(self) -> list[Choice]:
        return [choice for choice in self.choices if choice.verdict is Verdict.BLOCK]

    @property
    def spared(self) -> list[Choice]:
        return [choice for choice in self.choices if choice.verdict is Verdict.SPARE]

    @property
    def refused(self) -> bool:
        """Another unit, or another account than the run's, holds the GPUs: kill nothing."""
        return any(
            choice.role is Role.OTHER_UNIT or choice.rule is Rule.OTHER_ACCOUNT
            for choice in self.blockers
        )


def decide(
    discovery: Discovery,
    config: Config,
    phase: Phase,
    tree: ProcessTree,
    earlier: Mapping[ProcessId, Role] | None = None,
    *,
    for_uid: int | None = None,
    shared: frozenset[int] = frozenset(),
) -> Decision:
    """earlier: this run's first roles (roles.holder_role); for_uid: `gpugate run`'s account;
    shared: the owned GPU keys the run shares on purpose (docs/what-gets-killed.md)."""
    policy = config.policy(phase)
    decision = Decision([])
    for holder in sorted(discovery.holders.values(), key=lambda h: h.pid):
        info = holder.info
        if info.pid <= 1 or info.pid in discovery.self_chain or info.kernel_thread:
            continue
        role = holder_role(holder, discovery, config, earlier)
        decision.choices.append(
            choose(holder, role, discovery, config, policy.kill_orphans, shared)
        )
    if policy.kill_app_tree:
        _add_app_trees(decision, discovery, config, tree)
    if for_uid is not None:
        # A run for an account kills only what kill(2) lets that account signal (its real
        # uid); anything else is refused. The unit's own cgroup stays the unit's: only
        # systemd puts processes there.
        decision = Decision(
            [
                choice._replace(verdict=Verdict.BLOCK, rule=Rule.OTHER_ACCOUNT, for_uid=for_uid)
                if choice.verdict is Verdict.KILL
                and choice.rule is not Rule.CGROUP
                and choice.holder.info.uid != for_uid
                else choice
                for choice in decision.choices
            ]
        )
    return decision


# Roles whose verdict the role alone gives.
BY_ROLE = {
    Role.PROTECTED: (Verdict.SPARE, Rule.PROTECTED),
    Role.WATCHER: (Verdict.SPARE, Rule.WATCHER),
    Role.UNIT: (Verdict.KILL, Rule.CGROUP),
}


def choose(
    holder: Holder,
    role: Role,
    discovery: Discovery,
    config: Config,
    kill_orphans: bool,
    shared: frozenset[int] = frozenset(),
) -> Choice:
    """One holder's verdict: the first rule that applies, in this order."""
    owned = discovery.owned_indices
    on_owned, foreign = tuple(sorted(holder.using & owned)), tuple(sorted(holder.using - owned))

    def choice(verdict: Verdict, rule: Rule, other_unit: str | None = None) -> Choice:
        return Choice(holder, role, verdict, rule, on_owned, foreign, other_unit)

    fixed = BY_ROLE.get(role)
    if fixed is not None:
        return choice(*fixed)
    if role is Role.UNIT_CONTAINER and holder.container is not None:
        return choice(Verdict.KILL, Rule.UNIT_CONTAINER)
    if not on_owned and not holder.ports:
        return choice(Verdict.SPARE, Rule.NOT_OWNED)
    if role is Role.OTHER_UNIT and on_owned and set(on_owned) <= shared and not holder.ports:
        return choice(Verdict.SPARE, Rule.SHARER, system_unit_of_cgroup(holder.info.cgroup or "/"))
    if foreign:
        return choice(Verdict.BLOCK, Rule.STRADDLES)
    if role is Role.OTHER_UNIT:
        other = system_unit_of_cgroup(holder.info.cgroup or "/")
        if config.kill_other_units:
            return choice(Verdict.KILL, Rule.OTHER_UNIT, other)
        rule = Rule.OTHER_CONTAINER if holder.container is not None else Rule.OTHER_UNIT
        return choice(Verdict.BLOCK, rule, other)
    return choice(Verdict.KILL if kill_orphans else Verdict.BLOCK, Rule.ORPHAN)


def _add_app_trees(
    decision: Decision, discovery: Discovery, config: Config, tree: ProcessTree
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
        # Not where taking the rest of this application would reach GPUs the unit does not own.
        if any(
            pid in discovery.holders
            and pid not in watchers
            and discovery.holders[pid].using - owned
            for pid in members
        ):
            continue
        for pid, info in members.items():
            if pid in chosen:
                continue
            chosen.add(pid)
            if pid in watchers:
                decision.choices.remove(watchers.pop(pid))
            holder = discovery.holders.get(pid) or Holder(info)
            holder.sources.add(Source.APP_TREE)
            on_owned = tuple(sorted(holder.using & owned))
            member = Choice(
                holder, seed.role, Verdict.KILL, Rule.APP_TREE, on_owned, seed_pid=seed.holder.pid
            )
            decision.choices.append(member)


def spared_for_good(decision: Decision) -> set[int]:
    """The spared PIDs but watchers: neither they nor their memory are waited on."""
    return {c.holder.pid for c in decision.spared if c.role is not Role.WATCHER}
