"""GPU lists as operators and schedulers write them: one parser for the config's `gpus`,
`gpugate install --gpus` and Slurm's SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES.

A GPU is an index, a GPU UUID (or a prefix of one), or a MIG slice: its UUID (`MIG-...`, or
a prefix of one) or the older `MIG-GPU-<uuid>/<gi>/<ci>` form (CUDA before 11.1, and
NVIDIA_VISIBLE_DEVICES). Which GPU or slice each names is core.discover's to find."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Union

from gpugate.errors import InvalidValue
from gpugate.untrusted import echo

# A whole UUID or a prefix of one (CUDA_VISIBLE_DEVICES accepts unique prefixes).
UUID_PATTERN = re.compile(r"GPU-[0-9a-fA-F][0-9a-fA-F-]{7,}")
MIG_PREFIX = "MIG-"
MIG_UUID_PATTERN = re.compile(r"MIG-[0-9a-fA-F][0-9a-fA-F-]{7,}")
LEGACY_MIG_PATTERN = re.compile(r"MIG-(GPU-[0-9a-fA-F][0-9a-fA-F-]{7,})/([0-9]{1,4})/([0-9]{1,4})")
MAX_GPU_INDEX = 1023

GpuRef = Union[int, str]  # an NVML index, a GPU UUID or a MIG slice's (either form)


GpuListError = InvalidValue  # what the parser raises: a code and facts; the caller names where


def gpu_ref(item: object) -> GpuRef:
    """One GPU: an index 0-1023, a GPU UUID or a MIG slice. Text of digits is an index."""
    if isinstance(item, bool):
        raise InvalidValue(f"{echo(item)} is not a GPU index or UUID")
    if isinstance(item, str) and item.isascii() and item.isdigit():
        item = int(item)
    if isinstance(item, int):
        if not 0 <= item <= MAX_GPU_INDEX:
            raise InvalidValue(f"GPU index {item} is out of range (0-{MAX_GPU_INDEX})")
        return item
    if isinstance(item, str):
        if UUID_PATTERN.fullmatch(item) or MIG_UUID_PATTERN.fullmatch(item):
            return item
        if LEGACY_MIG_PATTERN.fullmatch(item):
            return item
        if item.upper().startswith(MIG_PREFIX):
            raise InvalidValue(
                f"{echo(item)} is not a MIG device UUID (MIG-xxxxxxxx-...) or "
                "MIG-GPU-<uuid>/<gi>/<ci>"
            )
        raise InvalidValue(
            f"{echo(item)} is not a GPU index (0, 1, ...) or UUID (GPU-xxxxxxxx-...)"
        )
    raise InvalidValue(f"{echo(item)} is not a GPU index or UUID")


def gpu_refs(items: Sequence[object]) -> tuple[GpuRef, ...]:
    """A list of GPUs: at least one, none twice (a UUID is compared case-insensitively)."""
    if not items:
        raise InvalidValue("must name at least one GPU")
    refs: list[GpuRef] = []
    seen: set[GpuRef] = set()
    for item in items:
        ref = gpu_ref(item)
        key = ref.lower() if isinstance(ref, str) else ref
        if key in seen:
            raise InvalidValue(f"lists GPU {echo(ref, quote=False)} twice")
        seen.add(key)
        refs.append(ref)
    return tuple(refs)


def legacy_mig(ref: str) -> tuple[str, int, int] | None:
    """A `MIG-GPU-<uuid>/<gi>/<ci>` reference's GPU UUID (or prefix), GPU and compute
    instance; None for any other reference."""
    match = LEGACY_MIG_PATTERN.fullmatch(ref)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


def parse_gpu_text(text: str) -> tuple[GpuRef, ...]:
    """Comma-separated, as `--gpus 0,1`, SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES write them."""
    return gpu_refs([part.strip() for part in text.split(",")])
