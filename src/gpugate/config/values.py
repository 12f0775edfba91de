"""The forms of the config's values (config.schema declares the fields) and the GPU-list parser of
`gpus`, `--gpus`, Slurm."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Union

from gpugate.errors import InvalidValue
from gpugate.untrusted import for_error

# A whole GPU or MIG UUID, or a prefix of one (CUDA_VISIBLE_DEVICES accepts unique prefixes).
UUID_PATTERN = re.compile(r"(?:GPU|MIG)-[0-9a-fA-F][0-9a-fA-F-]{7,}")
MIG_PREFIX = "MIG-"
LEGACY_MIG_PATTERN = re.compile(r"MIG-(GPU-[0-9a-fA-F][0-9a-fA-F-]{7,})/([0-9]{1,4})/([0-9]{1,4})")
MAX_GPU_INDEX = 1023

GpuRef = Union[int, str]  # an NVML index, a GPU UUID or a MIG slice's (either form)


def gpu_ref(item: object) -> GpuRef:
    """One GPU: an index 0-1023, a GPU UUID or a MIG slice. Text of digits is an index."""
    if isinstance(item, str) and item.isascii() and item.isdigit():
        item = int(item)
    if isinstance(item, int) and not isinstance(item, bool):
        if not 0 <= item <= MAX_GPU_INDEX:
            raise InvalidValue(f"GPU index {item} is out of range (0-{MAX_GPU_INDEX})")
        return item
    if not isinstance(item, str):
        raise InvalidValue(f"{for_error(item)} is not a GPU index or UUID")
    if UUID_PATTERN.fullmatch(item) or LEGACY_MIG_PATTERN.fullmatch(item):
        return item
    if item.upper().startswith(MIG_PREFIX):
        raise InvalidValue(
            f"{for_error(item)} is not a MIG device UUID (MIG-xxxxxxxx-...) or "
            "MIG-GPU-<uuid>/<gi>/<ci>"
        )
    raise InvalidValue(
        f"{for_error(item)} is not a GPU index (0, 1, ...) or UUID (GPU-xxxxxxxx-...)"
    )


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
            raise InvalidValue(f"lists GPU {for_error(ref, quote=False)} twice")
        seen.add(key)
        refs.append(ref)
    return tuple(refs)


def legacy_mig(ref: str) -> tuple[str, int, int] | None:
    """A `MIG-GPU-<uuid>/<gi>/<ci>` reference's GPU UUID (or prefix), GPU and compute instance."""
    match = LEGACY_MIG_PATTERN.fullmatch(ref)
    return None if match is None else (match[1], int(match[2]), int(match[3]))


def parse_gpu_text(text: str) -> tuple[GpuRef, ...]:
    """Comma-separated, as `--gpus 0,1`, SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES write them."""
    return gpu_refs([part.strip() for part in text.split(",")])


DEFAULT_LOCK_DIR = Path("/run/gpugate")
BUILTIN_SOURCE = "built-in defaults"
CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")  # docker's and podman's rule

# private_shm: tmpfs's size= (a percentage of RAM, or k/m/g), or "off".
DEFAULT_PRIVATE_SHM = "50%"
PRIVATE_SHM_OFF = "off"
PRIVATE_SHM_SIZE = re.compile(r"(?:[1-9][0-9]?%|100%|[1-9][0-9]{0,8}[kmg])")

GpuSelection = Union[Literal["all"], tuple[GpuRef, ...]]  # resolved: what a run owns
GpusSetting = Union[Literal["auto"], GpuSelection]  # as written; integrations.unit resolves "auto"

SWEEP_INTERVAL_S = 60  # gpugate-sweep.timer's OnUnitActiveSec=
MAX_SWEEP_AGE_S = 30 * 86400

# Where NVIDIA's driver packages (Debian's and Ubuntu's nvidia-compute-utils, RHEL's
# nvidia-driver-cuda, the .run installer) put MPS: root's /usr/bin, never a user's folder.
MPS_CONTROL = "/usr/bin/nvidia-cuda-mps-control"
MPS_SERVER = "/usr/bin/nvidia-cuda-mps-server"
MPS_EXECUTABLES = (MPS_CONTROL, MPS_SERVER)
MPS_SERVER_NAME = "nvidia-cuda-mps-server"  # a protected executable of this name serves MPS
