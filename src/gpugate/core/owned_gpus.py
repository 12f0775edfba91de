"""Which of the driver's GPUs the unit owns: its selection (indices, UUIDs, UUID prefixes,
MIG slices) matched against NVML's list, and an NVML fault on an owned GPU failing the run.

An index and a GPU UUID name a whole GPU; a MIG UUID (or prefix), or the older
`MIG-GPU-<uuid>/<gi>/<ci>`, names one slice of a GPU in MIG mode. "all" is every whole GPU.
Owning a whole GPU owns each of its slices too: they are among the owned, so that its run
takes their holders, their locks and their leases (a unit on a slice of it is refused, and
the reverse), and waits on them."""

from __future__ import annotations

from collections.abc import Sequence

from gpugate.config.values import MIG_PREFIX, GpuRef, GpuSelection, legacy_mig
from gpugate.errors import ConfigError, NvmlUnavailable
from gpugate.host.nvml import Gpu, GpuFault
from gpugate.untrusted import echo


def owned_gpus(wanted: GpuSelection | None, gpus: Sequence[Gpu], source: str) -> list[Gpu]:
    """The GPUs a selection names, and the slices of each whole GPU among them; None names
    none (NVML failed, the cgroup alone is cleaned)."""
    if wanted is None:
        return []
    whole = [gpu for gpu in gpus if gpu.mig is None]
    if wanted == "all":
        return covered(whole, gpus)
    by_index = {gpu.index: gpu for gpu in whole}  # a GPU NVML cannot read is not among them
    owned: list[Gpu] = []
    for ref in wanted:
        if isinstance(ref, int):
            if ref not in by_index:
                listed = _index_list([gpu.index for gpu in whole])
                raise ConfigError(
                    source, "gpus", f"GPU index {ref} does not exist; NVML lists {listed}"
                )
            gpu = by_index[ref]
        else:
            gpu = _by_uuid(ref, gpus, source)
        if gpu not in owned:
            owned.append(gpu)
    return covered(owned, gpus)


def covered(owned: Sequence[Gpu], gpus: Sequence[Gpu]) -> list[Gpu]:
    """What owning these takes, in the order named: each, then its slices (a whole GPU)."""
    taken: list[Gpu] = []
    for mine in owned:
        for gpu in [mine, *(gpu for gpu in gpus if gpu != mine and mine.covers(gpu))]:
            if gpu not in taken:
                taken.append(gpu)
    return taken


def as_refs(gpus: Sequence[Gpu]) -> tuple[GpuRef, ...]:
    """The GPUs as a config or CUDA_VISIBLE_DEVICES names them: a whole GPU by its index, a
    slice by its UUID, a slice of a whole GPU among them not at all (the GPU names it)."""
    whole = {gpu.index for gpu in gpus if gpu.mig is None}
    return tuple(
        gpu.index if gpu.mig is None else gpu.uuid
        for gpu in gpus
        if gpu.mig is None or gpu.mig.parent not in whole
    )


def _by_uuid(ref: str, gpus: Sequence[Gpu], source: str) -> Gpu:
    """A GPU UUID names a whole GPU, a MIG UUID a slice; either as a prefix too."""
    legacy = legacy_mig(ref)
    if legacy is not None:
        return _by_legacy_mig(ref, legacy, gpus, source)
    is_mig = ref.upper().startswith(MIG_PREFIX)
    among = [gpu for gpu in gpus if (gpu.mig is not None) == is_mig]
    exact = [gpu for gpu in among if gpu.uuid.lower() == ref.lower()]
    if exact:
        return exact[0]
    if is_mig and not any(gpu.uuid.lower().startswith(ref.lower()) for gpu in among):
        mig_gpus = [gpu.index for gpu in gpus if gpu.mig_mode]
        raise ConfigError(
            source,
            "gpus",
            (f"no MIG device has UUID {echo(ref, quote=False)}")
            + ("" if mig_gpus else " (no GPU is in MIG mode)"),
        )
    return _by_prefix(ref, among, source)


def _by_legacy_mig(ref: str, legacy: tuple[str, int, int], gpus: Sequence[Gpu], source: str) -> Gpu:
    """MIG-GPU-<uuid>/<gi>/<ci>: the slice of that GPU with those instance ids."""
    parent_uuid, gi, ci = legacy
    parent = _by_prefix(parent_uuid, [gpu for gpu in gpus if gpu.mig is None], source)
    if not parent.mig_mode:
        raise ConfigError(
            source, "gpus", (f"{echo(ref, quote=False)}: GPU {parent.index} is not in MIG mode")
        )
    slices = [gpu for gpu in gpus if gpu.mig is not None and gpu.mig.parent == parent.index]
    for gpu in slices:
        if gpu.shown == f"{parent.index}/{gi}/{ci}":
            return gpu
    raise ConfigError(
        source,
        "gpus",
        f"{echo(ref, quote=False)}: GPU {parent.index} has no MIG device with GPU instance "
        f"{gi} and compute instance {ci} (it has {', '.join(g.shown for g in slices) or 'none'})",
    )


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
