"""A Slurm job's GPU numbers (slurmd's, from gres.conf) as NVML's GPUs.

slurmd's number N is the N-th device file of the node's gres/gpu (integrations.gres_conf).
A device file is a GPU where it is the device node /dev/nvidiaM itself: the same device
number (on a real host character 195:M, M being NVML's minor number); its name says nothing.
With AutoDetect=nvml, N is the N-th GPU in NVML's enumeration (of those gres.conf lists).
Anything short of that is a GresUnresolved, and the hook treats the job's GPUs as unknown.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import kind_of
from gpugate.integrations.gres_conf import GpuLayout, GresUnresolved
from gpugate.untrusted import echo

NVIDIA_MAJOR = 195  # the driver's character devices /dev/nvidia0..N (nvidiactl is 195:255)
GPU_NODE = re.compile(r"nvidia([0-9]{1,4})")

StatFn = Callable[[str], os.stat_result]


@dataclass(frozen=True)
class DeviceNodes:
    """The /dev/nvidiaM nodes of this host (dev: the device root; stat: os.stat by default,
    a test's stand-in otherwise)."""

    dev: Path = Path("/dev")
    stat: StatFn = os.stat

    def by_number(self) -> dict[tuple[bool, int], int]:
        """(is a character device, st_rdev) -> M, for each /dev/nvidiaM that is a node."""
        found: dict[tuple[bool, int], int] = {}
        try:
            names = os.listdir(self.dev)
        except OSError:
            return found
        for name in names:
            match = GPU_NODE.fullmatch(name)
            if match is None:
                continue
            try:
                info = self.stat(str(self.dev / name))
            except OSError:
                continue
            minor, is_char = int(match.group(1)), stat.S_ISCHR(info.st_mode)
            if is_char and os.major(info.st_rdev) == NVIDIA_MAJOR:
                if os.minor(info.st_rdev) == minor:  # else not the node the driver made
                    found[(True, info.st_rdev)] = minor
            elif is_char or stat.S_ISBLK(info.st_mode):  # a stand-in of another number
                found[(is_char, info.st_rdev)] = minor
        return found

    def file_path(self, file: str) -> str:
        """A gres.conf File under this device root (the real /dev: as written)."""
        if self.dev == Path("/dev") or not file.startswith("/dev/"):
            return file
        return str(self.dev / file[len("/dev/") :])


def minor_of(file: str, nodes: DeviceNodes, known: dict[tuple[bool, int], int], path: str) -> int:
    """M of the /dev/nvidiaM that File is (followed as slurmd's stat follows it)."""
    try:
        info = nodes.stat(nodes.file_path(file))
    except OSError as exc:
        raise GresUnresolved(_not_gpu(path, file, f"({exc.strerror or exc})")) from None
    is_char = stat.S_ISCHR(info.st_mode)
    if not (is_char or stat.S_ISBLK(info.st_mode)):
        raise GresUnresolved(_not_gpu(path, file, f"(a {kind_of(info.st_mode)} file)"))
    minor = known.get((is_char, info.st_rdev))
    if minor is None:
        why = f"(device {os.major(info.st_rdev)}:{os.minor(info.st_rdev)} is no /dev/nvidiaN)"
        raise GresUnresolved(_not_gpu(path, file, why))
    return minor


def _not_gpu(path: str, file: str, why: str) -> str:
    return f"{path}: File {echo(file)} is no GPU device node {why}"


def gpu_order(
    layout: GpuLayout, gpus: Sequence[Gpu], nodes: DeviceNodes, count: int, unreadable: int = 0
) -> list[Gpu]:
    """The node's GPUs in slurmd's order, the first `count` of them at least (each device
    file before them must be a GPU: slurmd skips one it cannot stat, and numbers the rest
    one lower). unreadable: GPUs NVML counts but cannot read (NVML's order has gaps)."""
    known = nodes.by_number()
    by_minor = {gpu.minor: gpu for gpu in gpus}
    if layout.nvml_order:
        if unreadable:
            raise GresUnresolved(
                f"{layout.path}: AutoDetect=nvml, and NVML cannot read {unreadable} GPU(s): "
                "slurmd's order has gaps gpugate cannot place"
            )
        ordered = sorted(gpus, key=lambda gpu: gpu.index)
        if layout.files:
            minors = {minor_of(file, nodes, known, layout.path) for file in layout.files}
            ordered = [gpu for gpu in ordered if gpu.minor in minors]
        return ordered
    found: list[Gpu] = []
    for file in layout.files[:count]:
        minor = minor_of(file, nodes, known, layout.path)
        gpu = by_minor.get(minor)
        if gpu is None:
            raise GresUnresolved(
                f"{layout.path}: File {echo(file)} is /dev/nvidia{minor}, and NVML lists no "
                f"GPU with minor number {minor}"
            )
        found.append(gpu)
    return found


def job_gpus(
    numbers: Sequence[int],
    layout: GpuLayout,
    gpus: Sequence[Gpu],
    nodes: DeviceNodes,
    unreadable: int = 0,
) -> tuple[Gpu, ...]:
    """The GPUs slurmd's numbers name (numbers: SLURM_JOB_GPUS's)."""
    if not numbers:
        return ()
    ordered = gpu_order(layout, gpus, nodes, max(numbers) + 1, unreadable)
    past = [n for n in numbers if n >= len(ordered)]
    if past:
        raise GresUnresolved(
            f"{layout.path}: GPU number {past[0]} past the {len(ordered)} GPU(s) it lists "
            "for this node"
        )
    return tuple(ordered[n] for n in numbers)
