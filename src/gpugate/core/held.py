"""Who kept the run's GPUs at its end (RunSummary.held): loaded only where some process did."""

from __future__ import annotations

from gpugate.core.decide import Choice
from gpugate.core.outcome import Held


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
