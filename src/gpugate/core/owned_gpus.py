"""Which of the driver's GPUs the unit owns: its selection (indices, UUIDs, UUID prefixes)
matched against NVML's list, and an NVML fault on an owned GPU failing the run."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.config.values import GpuSelection
from gpugate.errors import ConfigError, NvmlUnavailable, Problem
from gpugate.host.nvml import Gpu, GpuFault


def owned_gpus(wanted: GpuSelection | None, gpus: Sequence[Gpu], source: str) -> list[Gpu]:
    """The GPUs a selection names; None names none (NVML failed, the cgroup alone is cleaned)."""
    if wanted is None:
        return []
    if wanted == "all":
        return list(gpus)
    by_uuid = {gpu.uuid.lower(): gpu for gpu in gpus}
    by_index = {gpu.index: gpu for gpu in gpus}  # a GPU NVML cannot read is not among them
    owned: list[Gpu] = []
    for ref in wanted:
        if isinstance(ref, int):
            if ref not in by_index:
                raise ConfigError(
                    source,
                    "gpus",
                    Problem.GPU_NO_SUCH_INDEX,
                    value=ref,
                    listed=[gpu.index for gpu in gpus],
                )
            gpu = by_index[ref]
        else:
            found = by_uuid.get(ref.lower()) or _by_prefix(ref, gpus, source)
            gpu = found
        if gpu not in owned:
            owned.append(gpu)
    return owned


def _by_prefix(ref: str, gpus: Sequence[Gpu], source: str) -> Gpu:
    """A UUID prefix names the one GPU whose UUID starts with it (CUDA_VISIBLE_DEVICES)."""
    matches = [gpu for gpu in gpus if gpu.uuid.lower().startswith(ref.lower())]
    if not matches:
        raise ConfigError(source, "gpus", Problem.GPU_NO_SUCH_UUID, value=ref)
    if len(matches) > 1:
        raise ConfigError(source, "gpus", Problem.GPU_UUID_AMBIGUOUS, value=ref)
    return matches[0]


def fail_on_owned_faults(
    wanted: GpuSelection | None, gpus: Sequence[Gpu], faults: Sequence[GpuFault], unit: str
) -> None:
    """An NVML error on a GPU the unit owns fails the run; on any other GPU it is a warning."""
    if not faults or wanted is None:
        return
    who = unit or "this run"
    if wanted == "all":
        raise NvmlUnavailable(
            Problem.NVML_OWN_GPU_FAULT, fault=faults[0].error, who=who, all_gpus=True
        )
    uuids = {gpu.uuid.lower(): gpu.index for gpu in gpus}
    owned_indices = {uuids.get(ref.lower()) if isinstance(ref, str) else ref for ref in wanted}
    owned_uuids = {ref.lower() for ref in wanted if isinstance(ref, str)}
    for fault in faults:
        if fault.index in owned_indices or (fault.uuid or "").lower() in owned_uuids:
            raise NvmlUnavailable(Problem.NVML_OWN_GPU_FAULT, fault=fault.error, who=who)
    unknown = [ref for ref in owned_uuids if not any(uuid.startswith(ref) for uuid in uuids)]
    nameless = [fault for fault in faults if fault.uuid is None]
    if unknown and nameless:
        raise NvmlUnavailable(
            Problem.NVML_OWN_GPU_UNREAD, fault=nameless[0].error, who=who, value=unknown[0]
        )
