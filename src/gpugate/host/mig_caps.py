"""MIG capability devices: which /dev/nvidia-caps/nvidia-capK opens which MIG slice.

The driver grants access to a GPU instance and to a compute instance by capability device
files; /proc/driver/nvidia/capabilities/gpuN/mig/giG/access (N: the GPU's minor) and .../giG/
ciC/access say, as "DeviceFileMinor: K", which /dev/nvidia-caps/nvidia-capK stands for it. A
process on a slice holds them open from its start to its exit, also while NVML does not list it
(mid-start, mid-exit). The compute instance's names one slice; the GPU instance's names one
where its GPU instance holds that slice alone. Hosts that grant MIG access through the /proc
files alone (nv_cap_enable_devfs=0) have none; the driver lets a process with CAP_SYS_ADMIN
use every capability, so such a process need hold none.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import read_capped

CAPABILITIES = Path("driver/nvidia/capabilities")  # under the proc root
CAP_DEVICE = re.compile(r"nvidia-caps/nvidia-cap([0-9]+)$")  # the end of a held device's path
MINOR_LINE = re.compile(rb"^DeviceFileMinor:\s*([0-9]+)\s*$", re.MULTILINE)
MAX_ACCESS_BYTES = 4096


def slice_of_cap_minor(proc_root: Path, gpus: Sequence[Gpu]) -> dict[int, int]:
    """The minor K of each capability device that ties a process to one slice: K -> the
    slice's key. Empty where the host has none (or no slice)."""
    slices = [(gpu, gpu.mig) for gpu in gpus if gpu.mig is not None]
    per_instance = Counter((mig.parent, mig.gpu_instance) for _, mig in slices)
    found: dict[int, int] = {}
    for gpu, mig in slices:
        folder = proc_root / CAPABILITIES / f"gpu{gpu.minor}" / "mig" / f"gi{mig.gpu_instance}"
        ci_minor = _device_minor(folder / f"ci{mig.compute_instance}" / "access")
        if ci_minor is not None:
            found[ci_minor] = gpu.index
        gi_minor = _device_minor(folder / "access")
        if gi_minor is not None and per_instance[(mig.parent, mig.gpu_instance)] == 1:
            found[gi_minor] = gpu.index
    return found


def cap_minor(path: str) -> int | None:
    """K of a held /dev/nvidia-caps/nvidia-capK, else None."""
    match = CAP_DEVICE.search(path)
    return int(match.group(1)) if match else None


def _device_minor(access: Path) -> int | None:
    try:
        text = read_capped(access, MAX_ACCESS_BYTES)
    except OSError:
        return None  # no such instance's file, or no capability files on this host
    match = MINOR_LINE.search(text)
    return int(match.group(1)) if match else None
