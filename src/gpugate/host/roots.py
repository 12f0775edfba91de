"""Where gpugate looks: the roots of /dev, /proc and the cgroup tree, and whether to ask systemd.

Production uses the real ones. Tests point them at stand-ins through the environment
(`GPUGATE_DEV_ROOT`, `GPUGATE_PROC_ROOT`, `GPUGATE_CGROUP_ROOT`) or an injected `HostRoots`,
as pipx does for its paths; they are not part of the operator's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpugate.errors import ConfigError

SYSTEM_CGROUP_ROOT = Path("/sys/fs/cgroup")
# the unified tree of a hybrid host (host/cgroups.py), where systemd tracks units there
HYBRID_UNIFIED_ROOT = SYSTEM_CGROUP_ROOT / "unified"
ENVIRONMENT = {
    "dev": "GPUGATE_DEV_ROOT",
    "proc": "GPUGATE_PROC_ROOT",
    "cgroup": "GPUGATE_CGROUP_ROOT",
}


@dataclass(frozen=True)
class HostRoots:
    dev: Path = Path("/dev")
    proc: Path = Path("/proc")
    cgroup: Path = SYSTEM_CGROUP_ROOT

    @property
    def ask_systemd(self) -> bool:
        """systemd's answers (a unit's ControlGroup) name paths in the real cgroup tree only."""
        return self.cgroup in (SYSTEM_CGROUP_ROOT, HYBRID_UNIFIED_ROOT)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HostRoots:
        roots: dict[str, Path] = {}
        for name, variable in ENVIRONMENT.items():
            value = environ.get(variable)
            if not value:
                continue
            path = Path(value)
            if not path.is_absolute():
                raise ConfigError(variable, "", f"{value[:80]!r} is not an absolute path")
            if not path.is_dir():
                raise ConfigError(variable, "", f"{value[:80]}: no such folder")
            roots[name] = path
        return cls(**roots)

    def check(self) -> None:
        """A root that is not there is a configuration error, not a crash mid-run."""
        for name, variable in ENVIRONMENT.items():
            path: Path = getattr(self, name)
            if not path.is_dir():
                raise ConfigError(variable, "", f"{path}: no such folder")
