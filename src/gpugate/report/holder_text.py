"""A holder in words, as every journal entry about it says it: PID, user, role, GPUs,
container, how it was found, and its command line (shown: escaped and cut, untrusted.py)."""

from __future__ import annotations

from typing import Any

from gpugate.core.decide import Choice
from gpugate.host.containers import Container
from gpugate.report.lines import gpu_list
from gpugate.untrusted import COMMAND, CONTAINER, exact, shown


def describe(choice: Choice) -> str:
    info = choice.holder.info
    gpus = f" GPU {gpu_list(choice.holder.gpus)}" if choice.holder.gpus else ""
    sources = ",".join(sorted(choice.holder.sources))
    command = shown(info.command, COMMAND)
    where = f", {container_text(choice.holder.container)}" if choice.holder.container else ""
    return f"PID {info.pid} ({info.user}, {choice.role}{gpus}{where}, via {sources}): {command}"


def container_text(container: Container) -> str:
    """`docker container vllm (3f2a1b0c4d5e)`, or without a name `docker container 3f2a…`:
    Container.label with the name shown (a container's name is its creator's text)."""
    if container.name:
        name = shown(container.name, CONTAINER)
        return f"{container.runtime} container {name} ({container.short_id})"
    return container.label


def container_handle(container: Container) -> str:
    """What to write in `containers = [...]` (Container.handle), shown."""
    return shown(container.handle, CONTAINER)


def container_fields(choice: Choice) -> dict[str, Any]:
    """GPUGATE_CONTAINER (the id), _RUNTIME and _NAME for a holder in a container."""
    container = choice.holder.container
    if container is None:
        return {}
    fields: dict[str, Any] = {
        "container": exact(container.id, CONTAINER),
        "container_runtime": container.runtime,
    }
    if container.name:
        fields["container_name"] = exact(container.name, CONTAINER)
    return fields
