"""Decision: which holders gpugate kills, which it spares, and which stop it.

Pure logic over what `discover` found and a view of the process tree; nothing here reads
/proc or signals, so the rules can be tested over arbitrary process tables. Each holder's
role is `roles`; where an application ends (kill_app_tree) is `app_tree`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpugate.compat import StrEnum
from gpugate.config.models import GateConfig
from gpugate.core.app_tree import ProcessTree, app_tree
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import Role, stable_role
from gpugate.host.procfs import ProcessId
from gpugate.host.systemd import unit_of_cgroup


class Verdict(StrEnum):
    KILL = "kill"
    SPARE = "spare"  # left alone; it does not hold the unit's GPUs or is protected
    BLOCK = "block"  # holds the unit's GPUs but policy forbids killing it


@dataclass(frozen=True)
class Choice:
    holder: Holder
    role: Role
    verdict: Verdict
    reason: str  # in words, for the operator
    code: str = ""  # the rule that decided, short and stable: the journal's GPUGATE_REASON


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


def decide(
    discovery: Discovery,
    config: GateConfig,
    phase: str,
    tree: ProcessTree,
    earlier: Mapping[ProcessId, Role] | None = None,
) -> Decision:
    """earlier: the roles given in this run's previous decisions (see roles.stable_role)."""
    policy = config.policy(phase)
    owned = discovery.owned_indices
    decision = Decision()
    for holder in sorted(discovery.holders.values(), key=lambda h: h.pid):
        info = holder.info
        if info.pid <= 1 or info.pid in discovery.self_chain or info.kernel_thread:
            continue
        role = stable_role(holder, discovery, config, earlier or {})
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
            choice = Choice(holder, role, Verdict.SPARE, "protected by configuration", "protected")
        elif role is Role.WATCHER:
            choice = Choice(
                holder,
                role,
                Verdict.SPARE,
                "a watcher: NVML lists it on no GPU, with no memory",
                "watcher",
            )
        elif role is Role.UNIT:
            choice = Choice(
                holder, role, Verdict.KILL, f"in {discovery.unit}'s cgroup", "unit-cgroup"
            )
        elif role is Role.UNIT_CONTAINER and holder.container is not None:
            reason = f"in {holder.container.label}, one of {discovery.unit}'s (containers)"
            choice = Choice(holder, role, Verdict.KILL, reason, "unit-container")
        elif not on_owned and not holder.ports:
            why = "holds only control devices" if holder.control_devices else "holds no GPU"
            code = "control-devices-only" if holder.control_devices else "no-gpu-of-unit"
            choice = Choice(holder, role, Verdict.SPARE, f"{why} of {discovery.unit}", code)
        elif foreign:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"holds {held or 'no GPU of it'} but also GPU {', '.join(map(str, foreign))}, "
                f"which {discovery.unit} does not own",
                "foreign-gpu",
            )
        elif role is Role.OTHER_UNIT:
            other = unit_of_cgroup(info.cgroup or "/")
            container = holder.container
            if config.kill_other_units:
                who = container.label if container else other
                choice = Choice(holder, role, Verdict.KILL, f"{who} holds {held}", "other-unit")
            elif container is not None:
                why = (
                    f"{container.label} holds {held} (scope {other}; kill_other_units = "
                    f'false); if it is {discovery.unit}\'s, set containers = ["{container.handle}"]'
                    f" in its gpugate config (gpugate install {discovery.unit} --container "
                    f"{container.handle})"
                )
                choice = Choice(holder, role, Verdict.BLOCK, why, "other-unit-container")
            else:
                choice = Choice(
                    holder,
                    role,
                    Verdict.BLOCK,
                    f"active unit {other} holds {held} (kill_other_units = false)",
                    "other-unit",
                )
        elif policy.kill_orphans:
            choice = Choice(holder, role, Verdict.KILL, f"orphan holding {held}", "orphan")
        else:
            choice = Choice(
                holder,
                role,
                Verdict.BLOCK,
                f"orphan holding {held} ({phase}.kill_orphans = false)",
                "orphan-kept",
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
                    holder,
                    seed.role,
                    Verdict.KILL,
                    f"same application as PID {seed.holder.pid}",
                    "app-tree",
                )
            )


def spared_for_good(decision: Decision) -> set[int]:
    return {c.holder.pid for c in decision.spared if c.role is not Role.WATCHER}
