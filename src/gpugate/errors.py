"""Exit codes and every exception gpugate defines. Each `GateError` has one exit code and a
one-line message; the CLI prints the message and exits with the code, never a traceback. A
finished run's outcome reaches its code through the same table (`RUN_OUTCOMES`). This module
imports nothing of gpugate: every layer may raise what it defines."""

from __future__ import annotations

import errno
from collections.abc import Collection
from enum import IntEnum


class ExitCode(IntEnum):
    """A BSD sysexits code where it means the same, with systemd's name for it (`status=78/CONFIG`;
    the same on systemd 247 to 257); for gpugate's own outcomes, codes systemd has no name for
    (`status=21/n/a`), never a false LSB label such as `7/NOTRUNNING`. Each with its meaning."""

    meaning: str
    sysexits_name: str

    def __new__(cls, code: int, meaning: str, sysexits_name: str = "") -> ExitCode:
        member = int.__new__(cls, code)
        member._value_, member.meaning, member.sysexits_name = code, meaning, sysexits_name
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


# A finished run may meet several of these outcomes at once; it exits with the first found, in
# this order. First the cause the operator must remove before anything else helps: a respawner
# makes every kill futile (and its last respawn, killed at the deadline, would read as a
# survivor). Then a survivor of SIGKILL (a GPU reset or a reboot); then a holder gpugate may not
# kill; then memory no process holds; last, /dev/shm short of space for the next start.
RUN_OUTCOMES = (
    ExitCode.RESPAWNING,
    ExitCode.UNKILLABLE,
    ExitCode.HELD_BY_OTHERS,
    ExitCode.MEMORY_TIMEOUT,
    ExitCode.SHM_SPACE,
)


def outcome_code(found: Collection[ExitCode]) -> ExitCode:
    """A finished run's exit code: the first of RUN_OUTCOMES it found, else OK."""
    return next((code for code in RUN_OUTCOMES if code in found), ExitCode.OK)


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
        self.message, self.code = message, code


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
        self.source, self.field = source, field


class NvmlUnavailable(GateError):
    exit_code = ExitCode.NVML_UNAVAILABLE


class GpuError(NvmlUnavailable):
    """NVML failed on one GPU; the others may still answer."""

    def __init__(self, index: int, message: str, *, code: str = "") -> None:
        super().__init__(message, code=code)
        self.index = index


class NvmlNotAnswering(GateError):
    """An NVML call did not return in time: the driver is hung (as `nvidia-smi` hangs). Not an
    NvmlUnavailable: its time is spent, so on_nvml_error = "warn" cannot go on without it."""

    exit_code = ExitCode.NVML_NOT_ANSWERING


class Interrupted(GateError):
    """SIGTERM or SIGINT; stage: the run's stage then (core.outcome.Stage's code), "" unknown."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, message: str, signal_name: str = "SIGTERM", stage: str = "") -> None:
        super().__init__(message)
        self.signal_name, self.stage = signal_name, stage


class ProgramUnavailable(GateError):
    """systemctl (or another program gpugate asks) cannot run, or outlived its deadline. The
    code of NvmlUnavailable, but never one: on_nvml_error = "warn" goes on without NVML, never
    without systemctl."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class NriUnavailable(ProgramUnavailable):
    """`gpugate nri`: the runtime's NRI socket cannot be reached, or its connection broke (the
    runtime closed it, refused the registration, or sent what NRI never sends): the plugin
    connects again."""


class StateUnwritable(GateError):
    """gpugate's own state (what: "metrics", "GPU locks", ...) cannot be written at path."""

    exit_code = ExitCode.STATE_UNWRITABLE

    def __init__(self, path: object, what: str, message: str, *, code: str = "") -> None:
        super().__init__(message, code=code)
        self.path, self.what = path, what


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


class BadInput(GateError):
    """What the command was given cannot be used, nothing was touched: `gpugate run`'s arguments
    or account; the environment slurmd gave (not a job gpugate understands); a container's state
    or config.json (unreadable, or naming GPUs gpugate cannot resolve)."""

    exit_code = ExitCode.USAGE


class HeldByOthers(GateError):
    """`gpugate run` refused to start: the GPUs are held or leased by another workload."""

    exit_code = ExitCode.HELD_BY_OTHERS


# Not GateErrors: each is caught where it is raised, or turned into one there.


class BadRecord(InvalidValue):
    """Why a state file is not one of gpugate's records: one phrase, no path."""


class GresUnresolved(InvalidValue):
    """Why the job's GPU numbers cannot be turned into device files for certain."""


class NotRegularFile(OSError):
    def __init__(self, path: object, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", str(path))
        self.kind = kind


class TooLarge(OSError):
    def __init__(self, path: object, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"larger than {limit} bytes", str(path))
        self.size, self.limit = size, limit


class Refused(Exception):
    """Why root did not read a file, in words (after `PATH: `); missing: it is not there."""

    def __init__(self, why: str, *, missing: bool = False) -> None:
        super().__init__(why)
        self.missing = missing


class UnsafeLink(OSError):
    def __init__(self, path: str) -> None:
        super().__init__(errno.ELOOP, "a symbolic link in a folder another account may change")
        self.filename = path


class LinkOnPath(Exception):
    """safe_files: a component of a path is a symbolic link (its target, its owner's uid)."""

    def __init__(self, target: str, uid: int) -> None:
        self.target, self.uid = target, uid


class CallTimedOut(Exception):  # the call may still be running
    def __init__(self, waited_s: float) -> None:
        super().__init__(f"no answer after {waited_s:.1f} s")
        self.waited_s = waited_s
