"""A choice's rule in words: what the journal's holder entries say after the holder."""

from __future__ import annotations

from gpugate.core.decide import Choice, Rule, Verdict
from gpugate.report.holder_text import container_handle, container_text
from gpugate.report.untrusted import CGROUP, shown


def held_text(choice: Choice) -> str:
    gpus = ", ".join(map(str, choice.on_owned))
    ports = ", ".join(map(str, sorted(choice.holder.ports)))
    parts = (f"GPU {gpus}" if gpus else "", f"port {ports}" if ports else "")
    return " and ".join(part for part in parts if part)


def reason_text(choice: Choice, unit: str, phase: str) -> str:
    """unit: the run's unit; phase: its phase (named in the setting that blocked)."""
    held = held_text(choice)
    holder = choice.holder
    rule = choice.rule
    if rule is Rule.PROTECTED:
        return "protected by configuration"
    if rule is Rule.WATCHER:
        return "a watcher: NVML lists it on no GPU, with no memory"
    if rule is Rule.CGROUP:
        return f"in {unit}'s cgroup"
    if rule is Rule.UNIT_CONTAINER and holder.container is not None:
        return f"in {container_text(holder.container)}, one of {unit}'s (containers)"
    if rule is Rule.NOT_OWNED:
        why = "holds only control devices" if holder.control_devices else "holds no GPU"
        return f"{why} of {unit}"
    if rule is Rule.STRADDLES:
        foreign = ", ".join(map(str, choice.foreign))
        return f"holds {held or 'no GPU of it'} but also GPU {foreign}, which {unit} does not own"
    if rule is Rule.APP_TREE:
        return f"same application as PID {choice.seed_pid}"
    if rule is Rule.ORPHAN:
        kept = choice.verdict is Verdict.BLOCK
        return f"orphan holding {held}" + (f" ({phase}.kill_orphans = false)" if kept else "")
    return other_unit_text(choice, unit, held)


def other_unit_text(choice: Choice, unit: str, held: str) -> str:
    container, other = choice.holder.container, shown(choice.other_unit, CGROUP)
    if choice.verdict is Verdict.KILL:
        return f"{container_text(container) if container else other} holds {held}"
    if container is None:
        return f"active unit {other} holds {held} (kill_other_units = false)"
    handle = container_handle(container)
    return (
        f"{container_text(container)} holds {held} (scope {other}; kill_other_units = false); "
        f'if it is {unit}\'s, set containers = ["{handle}"] in its gpugate config '
        f"(gpugate install {unit} --container {handle})"
    )
