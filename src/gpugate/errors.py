"""Exit codes and the errors that carry them.

Every failure gpugate knows about is a `GateError` with one exit code and a one-line message;
the CLI prints the message and exits with the code, never a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Where a BSD sysexits code means the same, gpugate uses it (systemd's journal line, also
    in `systemctl status`, names it: `status=78/CONFIG`); its own outcomes use codes systemd has
    no name for (20 and up: `status=21/n/a`), never a false LSB label such as `7/NOTRUNNING`."""

    OK = 0
    USAGE = 64  # EX_USAGE: bad command line, or a Slurm job environment it cannot read
    NVML_UNAVAILABLE = 69  # EX_UNAVAILABLE: NVML unusable, or systemctl & co. missing or silent
    INTERNAL = 70  # EX_SOFTWARE: a bug, please report it
    STATE_UNWRITABLE = 73  # EX_CANTCREAT: lock_dir, leases, failed-start records, metrics
    LOCK_TIMEOUT = 75  # EX_TEMPFAIL: another gpugate run held the GPUs' lock past the deadline
    PERMISSION = 77  # EX_NOPERM: not allowed to read /proc, signal a process or take a lock
    CONFIG = 78  # EX_CONFIG: configuration file or field invalid, or unknown GPU in it
    UNKILLABLE = 20  # holders still alive after SIGKILL at the deadline (D state)
    MEMORY_TIMEOUT = 21  # all holders gone, but NVML still reports memory used at the deadline
    HELD_BY_OTHERS = 22  # the GPUs are held by processes gpugate may not kill (another unit, ...)
    UNKNOWN_UNIT = 23  # not a valid unit name, unknown to systemd, or none could be inferred
    INSTALL = 24  # install/uninstall: the operator's edited file in the way, or reload failed
    RESPAWNING = 25  # a process gpugate may not take kept respawning the holders to the deadline
    NVML_NOT_ANSWERING = 26  # an NVML call did not return by the deadline (a hung driver)
    INTERRUPTED = 27  # the hook was stopped by SIGTERM or SIGINT (systemctl stop, Ctrl-C)
    HOST_UNSUPPORTED = 28  # the host lacks what gpugate needs: cgroup v2 (a v1-only host)
    SHM_SPACE = 29  # /dev/shm has less free space than the next start needs (shm_min_free_mib)
    MANUAL_RUN_REFUSED = 80  # pre/post by hand against a running unit, without --force
    GPU_UNREADABLE = 81  # status: NVML could not read at least one GPU (the rest is shown)

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
    return ", ".join(
        f"{int(code)} {EXIT_MEANINGS.get(code, code.name.lower())}" for code in sorted(ExitCode)
    )


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
        """stage: the run's stage when it was stopped (core.stage.Stage's code), "" unknown."""
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
