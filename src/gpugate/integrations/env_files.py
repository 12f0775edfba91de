"""A unit's environment that steers root's hooks: gpugate's hooks (`ExecStartPre=+`,
`ExecStopPost=+`) run as root with it, and LD_PRELOAD, LD_LIBRARY_PATH or PYTHONPATH set there
run code in the root process before gpugate can look. `install` and `config check --unit`
warn, naming the EnvironmentFile= another account may change and each such variable."""

from __future__ import annotations

from collections.abc import Callable

from gpugate.errors import GateError
from gpugate.host.safe_files import untrusted, why_untrusted
from gpugate.host.systemd import (
    UnitEnvironment,
    environment_files,
    systemctl_show,
    unit_environment,
)

STEERING = frozenset({"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT"})
STEERING_PREFIXES = ("PYTHON",)
ROOT = (0,)  # systemd reads it as root, whoever runs install or config check


def environment_file_warnings(unit: str, show: Callable[[str], str | None]) -> list[str]:
    """One line for each EnvironmentFile= of the unit that another account may change."""
    return [
        f"warning: {unit}: EnvironmentFile={name} may be changed by an account other than root "
        f"({why_untrusted(found)}); gpugate's hooks run as root with its variables (LD_PRELOAD, "
        "PYTHONPATH, ...): make it and its folders root's (docs/hardening.md)"
        for name, _ in environment_files(show(unit) or "")
        if (found := untrusted(name, ROOT)) is not None
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
