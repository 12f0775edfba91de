"""`gpugate slurm check`: whether this node's Slurm gives each job a private /dev/shm, and
whether gres.conf resolves every GPU slurmd numbers to an NVML GPU (exit 0 where it does,
78 where it does not: the hooks would clean such a job's cgroup only)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from gpugate.errors import ExitCode, GateError
from gpugate.host.nvml import Gpu, GpuDriver
from gpugate.integrations.gres_conf import (
    DEFAULT_SLURM_CONF,
    DeviceNodes,
    GpuLayout,
    GresUnresolved,
    gpu_order,
    gres_conf_path,
    parse_gres_conf,
    read_gres_conf,
    shm_privacy,
)
from gpugate.report import lines


def slurm_check(
    environ: Mapping[str, str],
    node: str | None,
    driver_factory: Callable[[], GpuDriver],
    nodes: DeviceNodes,
    stream: TextIO | None = None,
) -> int:
    out = stream or sys.stdout
    node = node or environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_conf = environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF
    try:
        gres_conf_path(slurm_conf)  # SLURM_CONF an absolute path, or GresUnresolved
        privacy = shm_privacy(Path(slurm_conf))
        print(lines.slurm_shm(privacy.private, privacy.plugin, privacy.dirs), file=out)
    except GresUnresolved as exc:
        print(lines.slurm_shm_unknown(str(exc)), file=out)
    try:
        path = gres_conf_path(slurm_conf)
        layout = parse_gres_conf(read_gres_conf(path), str(path), node)
    except GresUnresolved as exc:
        print(lines.slurm_gres_unresolved(node, str(exc)), file=out)
        return int(ExitCode.CONFIG)
    return check_gpus(layout, node, driver_factory, nodes, out)


def check_gpus(
    layout: GpuLayout,
    node: str,
    driver_factory: Callable[[], GpuDriver],
    nodes: DeviceNodes,
    out: TextIO,
) -> int:
    driver: GpuDriver | None = None
    try:
        driver = driver_factory()
        gpus = list(driver.gpus())
        faults = list(driver.faults())
    except GateError as exc:
        print(lines.error(exc.message), file=sys.stderr)
        return int(exc.exit_code)
    finally:
        if driver is not None:
            driver.close()
    try:
        ordered: list[Gpu] = gpu_order(layout, gpus, nodes, len(layout.files), len(faults))
    except GresUnresolved as exc:
        print(lines.slurm_gres_unresolved(node, str(exc)), file=out)
        return int(ExitCode.CONFIG)
    files = list(layout.files) if not layout.nvml_order else []
    print(lines.slurm_gres_resolved(node, layout.path, layout.nvml_order), file=out)
    for number, gpu in enumerate(ordered):
        print(lines.slurm_gpu_number(number, files[number] if files else None, gpu.label), file=out)
    return int(ExitCode.OK)
