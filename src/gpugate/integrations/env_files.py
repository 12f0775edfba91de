"""A unit's environment that steers root's hooks: gpugate's hooks (`ExecStartPre=+`,
`ExecStopPost=+`) run as root with it, and LD_PRELOAD, LD_LIBRARY_PATH or PYTHONPATH set there
run code in the root process before gpugate can look. `install` and `config check --unit`
warn, naming the EnvironmentFile= another account may change and each such variable."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

from gpugate.errors import GateError
from gpugate.host.safe_files import group
from gpugate.host.systemd import systemctl_show, unit_environment

STEERING = frozenset({"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT"})
STEERING_PREFIXES = ("PYTHON",)


def environment_files(unit: str, show: Callable[[str], str | None] | None = None) -> list[str]:
    """The unit's EnvironmentFile= paths as systemd has them loaded."""
    text = (show or (lambda name: systemctl_show(name, "EnvironmentFiles")))(unit)
    files: list[str] = []
    for line in (text or "").splitlines():
        key, _, value = line.partition("=")
        if key == "EnvironmentFiles" and value:
            path, _, _ = value.rpartition(" (ignore_errors=")
            files.append(path or value)
    return files


def who_else_may_write(path: Path) -> str | None:
    """Why an account other than root may change path (or put one there): the file or a
    folder above it is another account's, or a non-root group or everyone may write it."""
    current = path
    while True:
        try:
            info = current.lstat()
        except FileNotFoundError:
            current = current.parent
            continue
        except OSError:
            return None  # cannot tell; systemd reads it as root all the same
        why = _others_may_change(current, info)
        if why is not None:
            return why
        if current == current.parent:
            return None
        current = current.parent


def _others_may_change(path: Path, info: os.stat_result) -> str | None:
    mode, uid, gid = info.st_mode, info.st_uid, info.st_gid
    if uid != 0:
        return f"{path} belongs to {_user(uid)}"
    sticky_folder = stat.S_ISDIR(mode) and mode & stat.S_ISVTX
    if mode & stat.S_IWOTH and not sticky_folder:
        return f"{path} is writable by every account"
    if mode & stat.S_IWGRP and gid != 0 and not sticky_folder:
        return f"{path} is writable by group {group(gid)}"
    return None


def environment_file_warnings(
    unit: str, show: Callable[[str], str | None] | None = None
) -> list[str]:
    """One line for each EnvironmentFile= of the unit that another account may change."""
    lines = []
    for name in environment_files(unit, show):
        why = who_else_may_write(Path(name))
        if why is not None:
            lines.append(
                f"warning: {unit}: EnvironmentFile={name} may be changed by an account other "
                f"than root ({why}); gpugate's hooks run as root with its variables "
                "(LD_PRELOAD, PYTHONPATH, ...): make it and its folders root's (docs/hardening.md)"
            )
    return lines


def steering_variables(
    unit: str, show: Callable[[str], str | None] | None = None
) -> list[tuple[str, str]]:
    """(variable, where it is set) for each setting that chooses the code root's hooks load.
    The hooks' Python is isolated (-I) and NVML is loaded by its path, but the dynamic loader
    reads LD_* before gpugate's first line: only the operator can drop them."""
    try:
        environment = unit_environment(unit, show)
    except GateError:
        return []  # an unreadable EnvironmentFile=: systemd will not start the unit either
    if environment is None:
        return []
    return [
        (name, environment.origin(name))
        for name in sorted(environment.variables)
        if name in STEERING or name.startswith(STEERING_PREFIXES)
    ]


def unit_environment_warnings(
    unit: str, show: Callable[[str], str | None] | None = None
) -> list[str]:
    """install's and `config check --unit`'s warnings about the unit's environment."""
    if show is None:
        shown = systemctl_show(unit, "Environment,EnvironmentFiles")  # one call for both
        show = lambda _unit: shown  # noqa: E731
    return environment_file_warnings(unit, show) + [
        f"warning: {unit}: {where} sets {name}: gpugate's hooks run as root with the unit's "
        f"environment, and {name} chooses code they load (docs/hardening.md, rule 6); set it "
        "in the server's own ExecStart= (env NAME=... COMMAND) instead"
        for name, where in steering_variables(unit, show)
    ]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"UID {uid}"
