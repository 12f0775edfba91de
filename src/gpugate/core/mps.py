"""CUDA MPS (docs/mps.md): which holders are MPS servers, and the GPUs they serve, which every
run shares on purpose (docs/what-gets-killed.md, GPUs shared on purpose, rule (c))."""

from __future__ import annotations

import os

from gpugate.config.file import Config
from gpugate.config.values import MPS_SERVER_NAME
from gpugate.core.discover import Discovery
from gpugate.host.scan import ProcInfo


def is_mps_server(info: ProcInfo, config: Config) -> bool:
    """Its executable (the kernel's /proc/PID/exe) is a protected one, named as NVIDIA names
    the server: only root's configuration makes a path protected."""
    exe = info.exe
    return (
        exe is not None
        and exe in config.protected_executables
        and os.path.basename(exe) == MPS_SERVER_NAME
    )


def mps_served(discovery: Discovery, config: Config) -> frozenset[int]:
    """The run's owned GPU keys that an MPS server holds (NVML's list where it names the
    server, else its device files: Holder.using): shared on purpose for every run, beside
    what its Surroundings share (rule (c) of docs/what-gets-killed.md)."""
    owned = discovery.owned_indices
    served: set[int] = set()
    for holder in discovery.holders.values():
        if is_mps_server(holder.info, config):
            served |= holder.using & owned
    return frozenset(served)


def config_shares(discovery: Discovery, config: Config) -> frozenset[int]:
    """What a run's config alone shares, where its surroundings are not at hand (`status`,
    `gpugate run`'s check before the start): with share_gpus every owned GPU, and the GPUs an
    MPS server holds."""
    owned = frozenset(discovery.owned_indices) if config.share_gpus else frozenset()
    return owned | mps_served(discovery, config)
