"""Who kept the run's GPUs at its end (RunSummary.held): the blockers it refused or spared,
and the targets that outlived SIGKILL, each with the run's GPUs it holds and its rule."""

from __future__ import annotations

from collections.abc import Iterable

from gpugate.core.decide import Choice
from gpugate.core.outcome import UNKILLABLE, Held


def held(choice: Choice, rule: str | None = None) -> Held:
    holder = choice.holder
    return Held(
        pid=holder.pid,
        user=holder.info.user if holder.info.uid is not None else None,
        gpus=tuple(sorted(choice.on_owned or holder.using)),
        rule=rule or choice.rule.value,
        foreign=tuple(sorted(choice.foreign)),
        other=choice.other_unit,
        cgroup=holder.info.cgroup,
    )


def blockers_held(choices: Iterable[Choice]) -> list[Held]:
    return [held(choice) for choice in choices]


def survivors_held(choices: Iterable[Choice]) -> list[Held]:
    return [held(choice, UNKILLABLE) for choice in choices]
