"""The commands, one module each (pipx's layout): a typed function per command, called by
`cli` with the parsed command line's values; each returns the exit code."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from gpugate.host.logind import SESSIONS_DIR
from gpugate.host.nvml import GpuDriver, NvmlDriver
from gpugate.host.systemd import (
    CgroupLayout,
    HostRoots,
    active_state,
    host_cgroup_layout,
    on_units_tree,
)
from gpugate.report.journal import Reporter, ReporterFactory


class Front:
    """What a command may touch, injected by tests; production's real defaults."""

    def __init__(
        self,
        *,
        driver_factory: Callable[[], GpuDriver] | None = None,
        reporter_factory: ReporterFactory | None = None,
        roots: HostRoots | None = None,
        unit_state: Callable[[str], str | None] | None = None,
        cgroup_layout: Callable[[HostRoots], CgroupLayout | None] | None = None,
    ) -> None:
        self.driver_factory: Callable[[], GpuDriver] = driver_factory or NvmlDriver
        self.reporter_factory: ReporterFactory = reporter_factory or Reporter
        self.environ: Mapping[str, str] = os.environ
        self.device_stat: Callable[[str], os.stat_result] = os.stat  # gres.conf's File= (slurm)
        self.given_roots = roots or HostRoots()
        self.unit_state = unit_state or active_state
        self.cgroup_layout = cgroup_layout or host_cgroup_layout
        self.sessions_dir: Path = SESSIONS_DIR  # logind's state files (the sweep's owners)

    def host_roots(self) -> HostRoots:
        """The roots on the cgroup tree systemd tracks units in; HostUnsupported on v1 only."""
        return on_units_tree(self.given_roots, self.cgroup_layout)
