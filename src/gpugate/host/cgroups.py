"""Which cgroup tree this host tracks units in: gpugate reads the unified hierarchy (cgroup v2).

systemd mounts one of three layouts (systemd.unified_cgroup_hierarchy=, the distro's default):
- unified: cgroup2 at /sys/fs/cgroup (Debian 11+, Ubuntu 21.10+, RHEL 9, systemd 247-257's
  default);
- hybrid: v1 controllers under a tmpfs at /sys/fs/cgroup, and cgroup2 at /sys/fs/cgroup/unified,
  the tree systemd tracks every unit's processes in (Ubuntu 20.04, Debian 10): the same unit
  paths, `0::` lines of /proc/PID/cgroup name them;
- legacy: v1 only (RHEL 8, or systemd.legacy_systemd_cgroup_controller=1): no tree where a
  process's `0::` line says which unit it is in (the kernel shows `0::/` for every process).
gpugate works from the unified tree of the first two and refuses the third before it kills.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from gpugate.errors import HostUnsupported
from gpugate.host.roots import HYBRID_UNIFIED_ROOT, SYSTEM_CGROUP_ROOT, HostRoots

UNIFIED = "unified"
HYBRID = "hybrid"
LEGACY = "legacy"


@dataclass(frozen=True)
class CgroupLayout:
    kind: str  # UNIFIED, HYBRID or LEGACY
    # where the tree systemd tracks units in is mounted; None on a legacy host
    unified_mount: PurePosixPath | None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040)
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, plain)
    return field


def cgroup_layout(mountinfo: str) -> CgroupLayout:
    """The layout /proc/self/mountinfo shows: a later mount on the same point hides an
    earlier one, as the kernel lists them in mount order."""
    fstype_at: dict[PurePosixPath, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        fstype_at[PurePosixPath(_unescape(fields[4]))] = after[0]
    system = PurePosixPath(str(SYSTEM_CGROUP_ROOT))
    hybrid = PurePosixPath(str(HYBRID_UNIFIED_ROOT))
    if fstype_at.get(system) == "cgroup2":
        return CgroupLayout(UNIFIED, system)
    if fstype_at.get(hybrid) == "cgroup2":
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
    """roots with the cgroup root moved to the tree systemd tracks units in. roots.cgroup
    stands for /sys/fs/cgroup (a test's stand-in folder, or the real one): on a hybrid host
    the tree is its `unified` folder. A legacy host: HostUnsupported, before anything runs."""
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
    """This host's layout where the cgroup root is the real one; None for a stand-in tree
    (tests, a root that is not this host's), used as it is."""
    if roots.cgroup != SYSTEM_CGROUP_ROOT:
        return None
    return read_cgroup_layout(roots.proc)


def on_units_tree(
    given: HostRoots, layout: Callable[[HostRoots], CgroupLayout | None] = host_cgroup_layout
) -> HostRoots:
    """The roots with the cgroup root on the tree systemd tracks units in (a hybrid host's
    /sys/fs/cgroup/unified); HostUnsupported on a v1-only host."""
    found = layout(given)
    return given if found is None else on_unified_hierarchy(given, found)
