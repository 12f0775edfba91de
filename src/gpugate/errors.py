"""Exit codes and the errors that carry them: each a `GateError` with one exit code and a
one-line message; the CLI prints the message and exits with the code, never a traceback."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """A BSD sysexits code where it means the same, with systemd's name for it (`status=78/CONFIG`;
    the same on systemd 247 to 257); for gpugate's own outcomes, codes systemd has no name for
    (`status=21/n/a`), never a false LSB label such as `7/NOTRUNNING`. Each with its meaning."""

    meaning: str
    sysexits_name: str

    def __new__(cls, code: int, meaning: str, sysexits_name: str = "") -> ExitCode:
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        member.sysexits_name = sysexits_name
        return member

    OK = 0, "ok", "SUCCESS"
    USAGE = 64, "usage", "USAGE"
    NVML_UNAVAILABLE = 69, "NVML (or systemctl) unavailable", "UNAVAILABLE"
    INTERNAL = 70, "internal error", "SOFTWARE"
    STATE_UNWRITABLE = 73, "gpugate's state cannot be written", "CANTCREAT"
    LOCK_TIMEOUT = 75, "GPU lock timeout", "TEMPFAIL"
    PERMISSION = 77, "permission", "NOPERM"
    CONFIG = 78, "config", "CONFIG"
    UNKILLABLE = 20, "holders survived SIGKILL"
    MEMORY_TIMEOUT = 21, "memory not freed in time"
    HELD_BY_OTHERS = 22, "GPUs held by processes gpugate may not kill or leased"
    UNKNOWN_UNIT = 23, "unknown unit"
    INSTALL = 24, "install/uninstall refused"
    RESPAWNING = 25, "holders respawned until the deadline"
    NVML_NOT_ANSWERING = 26, "NVML did not answer (hung driver)"
    INTERRUPTED = 27, "stopped by SIGTERM/SIGINT"
    HOST_UNSUPPORTED = 28, "host unsupported (no cgroup v2 tree)"
    SHM_SPACE = 29, "/dev/shm short of free space"
    MANUAL_RUN_REFUSED = 80, "pre/post by hand on a running unit (no --force)"
    GPU_UNREADABLE = 81, "status: a GPU NVML cannot read"

    @property
    def systemd_label(self) -> str:
        """How systemd logs this code (`status=78/CONFIG`, `status=21/n/a`)."""
        return f"{int(self)}/{self.sysexits_name or 'n/a'}"


SYSEXITS_NAMES = {int(code): code.sysexits_name for code in ExitCode if code.sysexits_name}


def exit_code_summary() -> str:
    """`0 ok, 20 holders survived SIGKILL, ...`: for --help, from the codes themselves."""
    return ", ".join(f"{int(code)} {code.meaning}" for code in sorted(ExitCode))


class GateError(Exception):
    """A failure with its exit code and its one line, formed where it is raised (what another
    account could have written goes through `gpugate.untrusted`). code: the journal's
    GPUGATE_PROBLEM where docs/journal.md names one."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidValue(ValueError):
    """A value a validator refuses, in words; the caller says where in a ConfigError."""


class ConfigError(GateError):
    """`SOURCE: FIELD: problem (and N more)`: more, the other fields refused besides."""

    exit_code = ExitCode.CONFIG

    def __init__(
        self, source: str, field: str, problem: str, *, more: int = 0, code: str = ""
    ) -> None:
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
    """SIGTERM or SIGINT; stage: the run's stage then (core.outcome.Stage's code), "" unknown."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, message: str, signal_name: str = "SIGTERM", stage: str = "") -> None:
        super().__init__(message)
        self.signal_name = signal_name
        self.stage = stage


class ProgramNotAnswering(GateError):
    """systemctl (or another program gpugate asks) outlived its deadline."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class ProgramNotFound(GateError):
    """A program gpugate asks is not in the system folders, or cannot run."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class StateUnwritable(GateError):
    """gpugate's own state (what: "metrics", "GPU locks", ...) cannot be written at path."""

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
