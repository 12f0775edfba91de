"""A holder in words, as every journal entry about it names it, and its choice's rule in words."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpugate.core.decide import Choice, Rule, Verdict
from gpugate.host.containers import Container
from gpugate.host.safe_files import account
from gpugate.untrusted import CGROUP, COMMAND, CONTAINER, exact, shown


def gpu_list(indices: Iterable[int]) -> str:
    """GPUs by index, as every line names them: `0, 1, 3`, or `none`."""
    return ", ".join(str(index) for index in sorted(indices)) or "none"


def describe(choice: Choice) -> str:
    info = choice.holder.info
    gpus = f" GPU {gpu_list(choice.holder.gpus)}" if choice.holder.gpus else ""
    sources = ",".join(sorted(choice.holder.sources))
    command = shown(info.command, COMMAND)
    where = f", {container_text(choice.holder.container)}" if choice.holder.container else ""
    return f"PID {info.pid} ({info.user}, {choice.role}{gpus}{where}, via {sources}): {command}"


def container_text(container: Container) -> str:
    """`docker container vllm (3f2a1b0c4d5e)`: Container.label with its creator's name shown."""
    if container.name:
        name = shown(container.name, CONTAINER)
        return f"{container.runtime} container {name} ({container.short_id})"
    return container.label


def choice_fields(choice: Choice) -> dict[str, Any]:
    """GPUGATE_PID, _GPU, _ROLE, _COMMAND of every entry about a holder; in a container, also
    GPUGATE_CONTAINER (the id), _CONTAINER_RUNTIME and _CONTAINER_NAME."""
    holder, container = choice.holder, choice.holder.container
    fields: dict[str, Any] = {
        "pid": holder.pid,
        "gpus": sorted(holder.gpus),
        "role": choice.role,
        "command": exact(holder.info.command, COMMAND),
    }
    if container is not None:
        fields["container"] = exact(container.id, CONTAINER)
        fields["container_runtime"] = container.runtime
    if container is not None and container.name:
        fields["container_name"] = exact(container.name, CONTAINER)
    return fields


def held_text(choice: Choice) -> str:
    gpus = ", ".join(map(str, choice.on_owned))
    ports = ", ".join(map(str, sorted(choice.holder.ports)))
    parts = (f"GPU {gpus}" if gpus else "", f"port {ports}" if ports else "")
    return " and ".join(part for part in parts if part)


def reason_text(choice: Choice, unit: str, phase: str) -> str:
    """What the journal says after the holder; phase: named in the setting that blocked."""
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
    if rule is Rule.OTHER_ACCOUNT:
        return (
            f"{account(holder.info.uid)}'s process holds {held or 'them'}; this "
            f"`gpugate run` acts for {account(choice.for_uid)} and kills only its processes"
        )
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
    handle = shown(container.handle, CONTAINER)
    return (
        f"{container_text(container)} holds {held} (scope {other}; kill_other_units = false); "
        f'if it is {unit}\'s, set containers = ["{handle}"] in its gpugate config '
        f"(gpugate install {unit} --container {handle})"
    )
