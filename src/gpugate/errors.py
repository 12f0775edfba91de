"""Exit codes and the errors that carry them.

Every failure gpugate knows about is a `GateError` with one exit code and a one-line message;
the CLI prints the message and exits with the code, never a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug: please report it
    USAGE = 2  # bad command line (argparse's own code)
    CONFIG = 3  # configuration file or field invalid, or unknown GPU in it
    NVML_UNAVAILABLE = 4  # libnvidia-ml missing, driver not loaded, GPU lost
    UNKILLABLE = 5  # holders still alive after SIGKILL at the deadline (D state)
    MEMORY_TIMEOUT = 6  # all holders gone, but NVML still reports memory used at the deadline
    HELD_BY_OTHERS = 7  # the GPUs are held by processes gpugate may not kill (another unit, ...)
    PERMISSION = 8  # not allowed to read /proc, signal a process or take a lock
    UNKNOWN_UNIT = 9  # the unit is not known to systemd, or no unit could be inferred
    LOCK_TIMEOUT = 10  # another gpugate run held the GPUs' lock past the deadline
    INSTALL = 11  # install/uninstall: the operator's edited file in the way, or reload failed
    MANUAL_RUN_REFUSED = 80  # pre/post by hand against a running unit, without --force
    GPU_UNREADABLE = 81  # status: NVML could not read at least one GPU (the rest is shown)


EXIT_MEANINGS = {
    ExitCode.OK: "ok",
    ExitCode.INTERNAL: "internal error",
    ExitCode.USAGE: "usage",
    ExitCode.CONFIG: "config",
    ExitCode.NVML_UNAVAILABLE: "NVML unavailable",
    ExitCode.UNKILLABLE: "holders survived SIGKILL",
    ExitCode.MEMORY_TIMEOUT: "memory not freed in time",
    ExitCode.HELD_BY_OTHERS: "GPUs held by processes gpugate may not kill or leased",
    ExitCode.PERMISSION: "permission",
    ExitCode.UNKNOWN_UNIT: "unknown unit",
    ExitCode.LOCK_TIMEOUT: "GPU lock timeout",
    ExitCode.INSTALL: "install/uninstall refused",
    ExitCode.MANUAL_RUN_REFUSED: "pre/post by hand on a running unit (no --force)",
    ExitCode.GPU_UNREADABLE: "status: a GPU NVML cannot read",
}


def exit_code_summary() -> str:
    """`0 ok, 1 internal error, ...`: for --help, from the codes themselves."""
    return ", ".join(
        f"{int(code)} {EXIT_MEANINGS.get(code, code.name.lower())}" for code in ExitCode
    )


class GateError(Exception):
    """A failure with a documented exit code and a one-line message for the operator."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(GateError):
    exit_code = ExitCode.CONFIG

    def __init__(self, source: str, field: str, problem: str) -> None:
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.field = field


class NvmlUnavailable(GateError):
    exit_code = ExitCode.NVML_UNAVAILABLE


class PermissionDenied(GateError):
    exit_code = ExitCode.PERMISSION


class UnknownUnit(GateError):
    exit_code = ExitCode.UNKNOWN_UNIT


class LockTimeout(GateError):
    exit_code = ExitCode.LOCK_TIMEOUT


class InstallError(GateError):
    exit_code = ExitCode.INSTALL


class ManualRunRefused(GateError):
    exit_code = ExitCode.MANUAL_RUN_REFUSED
