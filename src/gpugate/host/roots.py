"""Where gpugate looks: the roots of /dev, /proc and the cgroup tree, and whether to ask systemd.

Production uses the real ones. Tests point them at stand-ins with an injected `HostRoots`, or,
for gpugate run as a command, the hidden `--host-roots dev=DIR,proc=DIR,cgroup=DIR` option,
which the unit drop-in never carries. Never from the environment: the hooks run as root with
the unit's environment, and a root chosen there would choose what root kills.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpugate.errors import ConfigError
from gpugate.untrusted import echo

SYSTEM_CGROUP_ROOT = Path("/sys/fs/cgroup")
# the unified tree of a hybrid host (host/cgroups.py), where systemd tracks units there
HYBRID_UNIFIED_ROOT = SYSTEM_CGROUP_ROOT / "unified"
OPTION = "--host-roots"
NAMES = ("dev", "proc", "cgroup")


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
    def parse(cls, text: str) -> HostRoots:
        """`dev=DIR,proc=DIR,cgroup=DIR` (any of them; the rest stay the real ones)."""
        roots: dict[str, Path] = {}
        for item in text.split(","):
            name, eq, value = item.partition("=")
            if not eq or name not in NAMES:
                raise ConfigError(OPTION, "", f"{echo(item)}: not dev=DIR, proc=DIR or cgroup=DIR")
            path = Path(value)
            if not path.is_absolute():
                raise ConfigError(OPTION, name, f"{echo(value)} is not an absolute path")
            roots[name] = path
        found = cls(**roots)
        found.check()
        return found

    def check(self) -> None:
        """A root that is not there is a configuration error, not a crash mid-run."""
        for name in NAMES:
            path: Path = getattr(self, name)
            if not path.is_dir():
                raise ConfigError(OPTION, name, f"{echo(str(path), quote=False)}: no such folder")
