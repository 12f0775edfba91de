"""Exit codes and the errors that carry them.

Every failure gpugate knows about is a `GateError` with one exit code and a one-line message;
the CLI prints the message and exits with the code, never a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Where a BSD sysexits code means the same, gpugate uses it (systemd's journal line, also
    in `systemctl status`, names it: `status=78/CONFIG`); its own outcomes use codes systemd has
    no name for (20 and up: `status=21/n/a`), never a false LSB label such as `7/NOTRUNNING`.
    What each means: EXIT_MEANINGS (--help's epilog), and README's table in full (its code,
    name and systemd label checked against these by tests/test_docs.py)."""

    OK = 0
    USAGE = 64
    NVML_UNAVAILABLE = 69
    INTERNAL = 70
    STATE_UNWRITABLE = 73
    LOCK_TIMEOUT = 75
    PERMISSION = 77
    CONFIG = 78
    UNKILLABLE = 20
    MEMORY_TIMEOUT = 21
    HELD_BY_OTHERS = 22
    UNKNOWN_UNIT = 23
    INSTALL = 24
    RESPAWNING = 25
    NVML_NOT_ANSWERING = 26
    INTERRUPTED = 27
    HOST_UNSUPPORTED = 28
    SHM_SPACE = 29
    MANUAL_RUN_REFUSED = 80
    GPU_UNREADABLE = 81

    @property
    def systemd_label(self) -> str:
        """How systemd logs this code ("Control process exited, code=exited, status=78/CONFIG",
        also shown by `systemctl status`): `78/CONFIG`, `21/n/a`."""
        return f"{int(self)}/{SYSEXITS_NAMES.get(int(self), 'n/a')}"


# systemd's names for the codes gpugate shares with it (`systemd-analyze exit-status`). The
# same on systemd 247 to 257: what changed between them is systemd's own range (200 and up,
# grown to 245/KSM by 254), which gpugate never uses.
SYSEXITS_NAMES = {
    0: "SUCCESS",
    64: "USAGE",
    69: "UNAVAILABLE",
    70: "SOFTWARE",
    73: "CANTCREAT",
    75: "TEMPFAIL",
    77: "NOPERM",
    78: "CONFIG",
}

EXIT_MEANINGS = {
    ExitCode.OK: "ok",
    ExitCode.INTERNAL: "internal error",
    ExitCode.USAGE: "usage",
    ExitCode.CONFIG: "config",
    ExitCode.NVML_UNAVAILABLE: "NVML (or systemctl) unavailable",
    ExitCode.STATE_UNWRITABLE: "gpugate's state cannot be written",
    ExitCode.UNKILLABLE: "holders survived SIGKILL",
    ExitCode.MEMORY_TIMEOUT: "memory not freed in time",
    ExitCode.HELD_BY_OTHERS: "GPUs held by processes gpugate may not kill or leased",
    ExitCode.PERMISSION: "permission",
    ExitCode.UNKNOWN_UNIT: "unknown unit",
    ExitCode.LOCK_TIMEOUT: "GPU lock timeout",
    ExitCode.INSTALL: "install/uninstall refused",
    ExitCode.RESPAWNING: "holders respawned until the deadline",
    ExitCode.NVML_NOT_ANSWERING: "NVML did not answer (hung driver)",
    ExitCode.INTERRUPTED: "stopped by SIGTERM/SIGINT",
    ExitCode.HOST_UNSUPPORTED: "host unsupported (no cgroup v2 tree)",
    ExitCode.SHM_SPACE: "/dev/shm short of free space",
    ExitCode.MANUAL_RUN_REFUSED: "pre/post by hand on a running unit (no --force)",
    ExitCode.GPU_UNREADABLE: "status: a GPU NVML cannot read",
}


def exit_code_summary() -> str:
    """`0 ok, 20 holders survived SIGKILL, ...`: for --help, from the codes themselves."""
    return ", ".join(f"{int(code)} {EXIT_MEANINGS[code]}" for code in sorted(ExitCode))


class GateError(Exception):
    """A failure with a documented exit code and its one line, formed where it is raised:
    whatever another account could have written (a unit name, a path, a value) goes into it
    through `gpugate.untrusted`. code: the journal's GPUGATE_PROBLEM where docs/journal.md
    names one ("" for none)."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidValue(ValueError):
    """A value a pydantic validator (or a GPU list's parser) refuses, in words; the caller
    names where it was (file and field, or variable) in a ConfigError."""


class ConfigError(GateError):
    exit_code = ExitCode.CONFIG

    def __init__(
        self, source: str, field: str, problem: str, *, more: int = 0, code: str = ""
    ) -> None:
        """`SOURCE: FIELD: problem (and N more)`: more, the other fields refused besides."""
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {problem}" + (f" (and {more} more)" if more else ""), code=code)
        self.source = source
        self.field = field


class NvmlUnavailable(GateError):
    exit_code = ExitCode.NVML_UNAVAILABLE


class NvmlNotAnswering(GateError):
    """An NVML call did not return in time: the driver is hung (as `nvidia-smi` hangs). Not an
    NvmlUnavailable: its time is spent, so on_nvml_error = "warn" cannot go on without it."""

    exit_code = ExitCode.NVML_NOT_ANSWERING


class Interrupted(GateError):
    """The hook was sent SIGTERM (systemctl stop, a stop job's timeout) or SIGINT (Ctrl-C)."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(
        self,
        message: str,
        signal_name: str = "SIGTERM",
        stage: str = "",
    ) -> None:
        """stage: the run's stage when it was stopped (core.outcome.Stage's code), "" unknown."""
        super().__init__(message)
        self.signal_name = signal_name
        self.stage = stage


class ProgramNotAnswering(GateError):
    """systemctl (or another program gpugate needs an answer from) outlived its deadline."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class ProgramNotFound(GateError):
    """A program gpugate needs an answer from is not in the system folders, or cannot run."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class StateUnwritable(GateError):
    """gpugate's own state (locks, leases, failed-start records, metrics) cannot be written:
    no space, a read-only file system, a file where a folder should be. what: the state that
    goes there, in words ("metrics", "GPU locks")."""

    exit_code = ExitCode.STATE_UNWRITABLE

    def __init__(self, path: object, what: str, message: str, *, code: str = "") -> None:
        super().__init__(message, code=code)
        self.path = path
        self.what = what


class PermissionDenied(GateError):
    exit_code = ExitCode.PERMISSION


class UnknownUnit(GateError):
    exit_code = ExitCode.UNKNOWN_UNIT


class LockTimeout(GateError):
    exit_code = ExitCode.LOCK_TIMEOUT


class InstallError(GateError):
    exit_code = ExitCode.INSTALL


class HostUnsupported(GateError):
    exit_code = ExitCode.HOST_UNSUPPORTED


class ManualRunRefused(GateError):
    exit_code = ExitCode.MANUAL_RUN_REFUSED
