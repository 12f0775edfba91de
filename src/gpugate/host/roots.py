"""Where gpugate looks: the roots of /dev, /proc and the cgroup tree (tests: the hidden
`--host-roots`, never the environment, which the unit sets), and the cgroup tree systemd tracks
units in: cgroup2 at /sys/fs/cgroup (unified) or /sys/fs/cgroup/unified (hybrid); a v1-only
host (legacy) is refused before anything is killed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from gpugate.errors import ConfigError, HostUnsupported
from gpugate.untrusted import echo

SYSTEM_CGROUP_ROOT = Path("/sys/fs/cgroup")
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
        """systemd's answers (a unit's ControlGroup) name paths in the real tree only."""
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


UNIFIED = "unified"
HYBRID = "hybrid"
LEGACY = "legacy"


@dataclass(frozen=True)
class CgroupLayout:
    kind: str  # UNIFIED, HYBRID or LEGACY
    # where the tree systemd tracks units in is mounted; None on a legacy host
    unified_mount: PurePosixPath | None


def mount_table(mountinfo: str) -> dict[str, str]:
    """Mount point -> file system type of each mountinfo line (a later mount on the same point
    hides an earlier one). Points are unescaped: mountinfo writes space, tab, newline and
    backslash as octal (\\040, \\011, \\012, \\134)."""
    table: dict[str, str] = {}
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, fstype = before.split(), after.split()[:1]
        if len(fields) < 5 or not fstype:
            continue
        point = fields[4]
        for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(code, char)
        table[point] = fstype[0]
    return table


def cgroup_layout(mountinfo: str) -> CgroupLayout:
    fstype_at = mount_table(mountinfo)
    system = PurePosixPath(str(SYSTEM_CGROUP_ROOT))
    hybrid = PurePosixPath(str(HYBRID_UNIFIED_ROOT))
    if fstype_at.get(str(system)) == "cgroup2":
        return CgroupLayout(UNIFIED, system)
    if fstype_at.get(str(hybrid)) == "cgroup2":
        return CgroupLayout(HYBRID, hybrid)
    # A cgroup2 mounted anywhere else (by hand, by a container runtime) is no tree systemd
    # puts units in: its paths would name no unit.
    return CgroupLayout(LEGACY, None)


def read_cgroup_layout(proc_root: Path) -> CgroupLayout:
    try:
        text = (proc_root / "self" / "mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise HostUnsupported(
            f"cannot read {proc_root / 'self' / 'mountinfo'} ({exc.strerror}): gpugate cannot "
            "tell which cgroup tree this host tracks its units in; nothing was killed"
        ) from None
    return cgroup_layout(text)


def on_unified_hierarchy(roots: HostRoots, layout: CgroupLayout) -> HostRoots:
    """roots with the cgroup root (/sys/fs/cgroup or a test's stand-in) moved to the tree
    systemd tracks units in: on a hybrid host its `unified` folder."""
    if layout.kind == LEGACY or layout.unified_mount is None:
        raise HostUnsupported(
            f"this host's cgroups are v1 only (no cgroup2 at {SYSTEM_CGROUP_ROOT} or "
            f"{HYBRID_UNIFIED_ROOT}): gpugate finds a unit's processes in the unified hierarchy "
            "(cgroup v2), which this host lacks; nothing was killed. Boot with "
            "systemd.unified_cgroup_hierarchy=1 on the kernel command line (RHEL 8: grubby "
            '--update-kernel=ALL --args="systemd.unified_cgroup_hierarchy=1"), then reboot'
        )
    relative = layout.unified_mount.relative_to(PurePosixPath(str(SYSTEM_CGROUP_ROOT)))
    unified = roots.cgroup / relative
    if not unified.is_dir():
        raise HostUnsupported(
            f"this host's cgroup2 tree {layout.unified_mount} is not at {unified}: gpugate "
            "cannot find its units' processes; nothing was killed"
        )
    return replace(roots, cgroup=unified)


def host_cgroup_layout(roots: HostRoots) -> CgroupLayout | None:
    """This host's layout where the cgroup root is the real one; None for a stand-in tree."""
    if roots.cgroup != SYSTEM_CGROUP_ROOT:
        return None
    return read_cgroup_layout(roots.proc)


def on_units_tree(
    given: HostRoots, layout: Callable[[HostRoots], CgroupLayout | None] = host_cgroup_layout
) -> HostRoots:
    found = layout(given)
    return given if found is None else on_unified_hierarchy(given, found)
