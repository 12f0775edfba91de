"""Which of the driver's GPUs the unit owns: its selection (indices, UUIDs, UUID prefixes)
matched against NVML's list, and an NVML fault on an owned GPU failing the run."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.config.models import GpuSelection
from gpugate.errors import ConfigError, NvmlUnavailable
from gpugate.host.nvml import Gpu, GpuFault
from gpugate.untrusted import echo


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
                listed = _index_list([gpu.index for gpu in gpus])
                raise ConfigError(
                    source, "gpus", f"GPU index {ref} does not exist; NVML lists {listed}"
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
        raise ConfigError(source, "gpus", f"no GPU has UUID {echo(ref, quote=False)}")
    if len(matches) > 1:
        raise ConfigError(
            source, "gpus", f"{echo(ref, quote=False)} is the start of more than one GPU's UUID"
        )
    return matches[0]


def fail_on_owned_faults(
    wanted: GpuSelection | None, gpus: Sequence[Gpu], faults: Sequence[GpuFault], unit: str
) -> None:
    """An NVML error on a GPU the unit owns fails the run; on any other GPU it is a warning."""
    if not faults or wanted is None:
        return
    who = unit or "this run"
    if wanted == "all":
        raise NvmlUnavailable(f"{faults[0].error} (a GPU of {who}: gpus = all)")
    uuids = {gpu.uuid.lower(): gpu.index for gpu in gpus}
    owned_indices = {uuids.get(ref.lower()) if isinstance(ref, str) else ref for ref in wanted}
    owned_uuids = {ref.lower() for ref in wanted if isinstance(ref, str)}
    for fault in faults:
        if fault.index in owned_indices or (fault.uuid or "").lower() in owned_uuids:
            raise NvmlUnavailable(f"{fault.error} (a GPU of {who})")
    unknown = [ref for ref in owned_uuids if not any(uuid.startswith(ref) for uuid in uuids)]
    nameless = [fault for fault in faults if fault.uuid is None]
    if unknown and nameless:
        raise NvmlUnavailable(
            f"{nameless[0].error}; {who}'s GPU {echo(unknown[0], quote=False)} is not among "
            "those NVML can read"
        )


def _index_list(indices: list[int]) -> str:
    if not indices:
        return "no GPUs"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"GPUs {indices[0]}-{indices[-1]}"
    return "GPUs " + ", ".join(map(str, indices))
