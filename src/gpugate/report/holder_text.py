"""A holder in words, as every journal entry about it says it: PID, user, role, GPUs,
container, how it was found, and its command line (cut short)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpugate.core.decide import Choice

MAX_COMMAND = 200


def gpu_list(indices: Iterable[int]) -> str:
    return ", ".join(str(index) for index in sorted(indices)) or "none"


def describe(choice: Choice) -> str:
    info = choice.holder.info
    gpus = f" GPU {gpu_list(choice.holder.gpus)}" if choice.holder.gpus else ""
    sources = ",".join(sorted(choice.holder.sources))
    command = info.command[:MAX_COMMAND]
    where = f", {choice.holder.container.label}" if choice.holder.container else ""
    return f"PID {info.pid} ({info.user}, {choice.role}{gpus}{where}, via {sources}): {command}"


def container_fields(choice: Choice) -> dict[str, Any]:
    """GPUGATE_CONTAINER (the id), _RUNTIME and _NAME for a holder in a container."""
    container = choice.holder.container
    if container is None:
        return {}
    fields: dict[str, Any] = {"container": container.id, "container_runtime": container.runtime}
    if container.name:
        fields["container_name"] = container.name
    return fields
