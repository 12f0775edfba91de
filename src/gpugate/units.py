"""systemd units: names, the cgroup each one owns, and which unit a cgroup belongs to."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpugate.errors import UnknownUnit

UNIT_SUFFIXES = (".service", ".scope")
# systemd's allowed unit name characters; anything else arrives \xNN-escaped.
# \Z, not $: $ also matches before a final newline, and "vllm.service\n" is no unit name.
UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]+\.(service|scope)\Z")
USER_SLICE = "/user.slice"


# Every unit type systemd knows: a name ending in none of them is a service to systemctl.
UNIT_TYPE_SUFFIXES = (
    ".service",
    ".socket",
    ".target",
    ".device",
    ".mount",
    ".automount",
    ".swap",
    ".timer",
    ".path",
    ".slice",
    ".scope",
)


def unit_argument(name: str) -> str:
    """A unit named on the command line, read as systemctl reads it: `vllm` is
    `vllm.service`, `vllm@a` is `vllm@a.service`; a name with a unit type suffix stays."""
    if name and not name.endswith(UNIT_TYPE_SUFFIXES):
        return name + ".service"
    return name


def validate_unit_name(name: str) -> str:
    if len(name) > 255 or not UNIT_NAME.match(name):
        raise UnknownUnit(
            f"unit {name!r}: not a valid service or scope unit name (pass %n from the unit file)"
        )
    if name.startswith("@") or name.count("@") > 1:
        raise UnknownUnit(f"unit {name!r}: not a valid unit name")
    prefix, at, instance = name.rpartition(".")[0].partition("@")
    if at and not instance:
        raise UnknownUnit(f"unit {name!r}: a template; name an instance, e.g. {prefix}@0.service")
    return name


def unit_of_cgroup(cgroup: str) -> str | None:
    """The innermost service or scope whose cgroup holds this one, if any."""
    for part in reversed(cgroup.strip("/").split("/")):
        if part.endswith(UNIT_SUFFIXES):
            return part
    return None


def is_user_cgroup(cgroup: str) -> bool:
    """Login sessions and user managers: where a hand-started server lives."""
    return cgroup == USER_SLICE or cgroup.startswith(USER_SLICE + "/")


def own_unit(proc_root: Path = Path("/proc")) -> str | None:
    """The unit whose cgroup this process runs in: systemd runs ExecStartPre= there."""
    try:
        text = (proc_root / "self" / "cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            unit = unit_of_cgroup(line[3:])
            if unit and unit.endswith(".service"):
                return unit
    return None


def systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


@dataclass(frozen=True)
class UnitState:
    name: str
    load_state: str  # loaded, not-found, masked, ...
    active_state: str
    control_group: str | None


def query_unit(name: str) -> UnitState | None:
    """Ask systemd about a unit; None where no systemd runs or systemctl is missing."""
    systemctl = shutil.which("systemctl")
    if not systemd_running() or systemctl is None:
        return None
    result = subprocess.run(
        [systemctl, "show", "--property=LoadState,ActiveState,ControlGroup", "--", name],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if result.returncode != 0:
        return None
    props = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return UnitState(
        name=name,
        load_state=props.get("LoadState", ""),
        active_state=props.get("ActiveState", ""),
        control_group=props.get("ControlGroup") or None,
    )


def find_unit_cgroup(name: str, cgroup_root: Path) -> str | None:
    """Search the cgroup tree for the unit's cgroup (where systemd is not there to ask)."""
    best: str | None = None
    for directory, subdirs, _ in os.walk(cgroup_root):
        if os.path.basename(directory) == name:
            relative = "/" + os.path.relpath(directory, cgroup_root)
            if best is None or (is_user_cgroup(best) and not is_user_cgroup(relative)):
                best = relative
            subdirs.clear()
    return best


def resolve_unit_cgroup(name: str, cgroup_root: Path, *, ask_systemd: bool = True) -> str:
    """The unit's cgroup path (it may not exist while the unit is inactive)."""
    state = query_unit(name) if ask_systemd else None
    if state is not None:
        if state.load_state == "not-found":
            raise UnknownUnit(f"unit {name}: systemd knows no such unit")
        if state.control_group:
            return state.control_group
    found = find_unit_cgroup(name, cgroup_root)
    if found:
        return found
    if name.endswith(".service") and "@" in name:
        template = name.split("@", 1)[0]
        return f"/system.slice/system-{template}.slice/{name}"
    return f"/system.slice/{name}"
