"""A unit's environment that steers root's hooks: gpugate's hooks (`ExecStartPre=+`,
`ExecStopPost=+`) run as root with it, and LD_PRELOAD, LD_LIBRARY_PATH or PYTHONPATH set there
run code in the root process before gpugate can look. `install` and `config check --unit`
warn, naming the EnvironmentFile= another account may change and each such variable."""

from __future__ import annotations

import pwd
import stat
from collections.abc import Callable
from pathlib import Path

from gpugate.errors import GateError
from gpugate.host.safe_files import group
from gpugate.host.systemd import (
    UnitEnvironment,
    environment_files,
    systemctl_show,
    unit_environment,
)

STEERING = frozenset({"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT"})
STEERING_PREFIXES = ("PYTHON",)


def who_else_may_write(path: Path) -> str | None:
    """Why an account other than root may change path (or put one there): the file or a
    folder above it is another account's, or a non-root group or everyone may write it."""
    for current in (path, *path.parents):
        try:
            info = current.lstat()
        except FileNotFoundError:
            continue
        except OSError:
            return None  # cannot tell; systemd reads it as root all the same
        mode = info.st_mode
        sticky_folder = stat.S_ISDIR(mode) and mode & stat.S_ISVTX
        if info.st_uid != 0:
            try:
                owner = pwd.getpwuid(info.st_uid).pw_name
            except KeyError:
                owner = f"UID {info.st_uid}"
            return f"{current} belongs to {owner}"
        if mode & stat.S_IWOTH and not sticky_folder:
            return f"{current} is writable by every account"
        if mode & stat.S_IWGRP and info.st_gid != 0 and not sticky_folder:
            return f"{current} is writable by group {group(info.st_gid)}"
    return None


def environment_file_warnings(
    unit: str, show: Callable[[str], str | None] | None = None
) -> list[str]:
    """One line for each EnvironmentFile= of the unit that another account may change."""
    shown = (show or (lambda name: systemctl_show(name, "EnvironmentFiles")))(unit)
    return [
        f"warning: {unit}: EnvironmentFile={name} may be changed by an account other than root "
        f"({why}); gpugate's hooks run as root with its variables (LD_PRELOAD, PYTHONPATH, ...): "
        "make it and its folders root's (docs/hardening.md)"
        for name, _ in environment_files(shown or "")
        if (why := who_else_may_write(Path(name))) is not None
    ]


def unit_environment_warnings(
    unit: str, show: Callable[[str], str | None] | None = None
) -> list[str]:
    """install's and `config check --unit`'s warnings. The hooks' Python is isolated (-I) and
    NVML is loaded by its path, but the dynamic loader reads LD_* before gpugate's first line:
    only the operator can drop them."""
    if show is None:
        shown = systemctl_show(unit, "Environment,EnvironmentFiles")  # one call for both
        show = lambda _unit: shown  # noqa: E731
    try:
        environment = unit_environment(unit, show) or UnitEnvironment({})
    except GateError:  # an unreadable EnvironmentFile=: systemd will not start the unit either
        environment = UnitEnvironment({})
    return environment_file_warnings(unit, show) + [
        f"warning: {unit}: {environment.origin(name)} sets {name}: gpugate's hooks run as root "
        f"with the unit's environment, and {name} chooses code they load (docs/hardening.md, "
        "rule 6); set it in the server's own ExecStart= (env NAME=... COMMAND) instead"
        for name in sorted(environment.variables)
        if name in STEERING or name.startswith(STEERING_PREFIXES)
    ]
