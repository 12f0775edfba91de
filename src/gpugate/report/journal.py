"""journald entries, sd_notify STATUS= lines, stderr; the journal and notifier are injected."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Mapping
from enum import Enum
from typing import Protocol, TextIO, Union

from gpugate.untrusted import safe_line

FieldValue = Union[str, bytes]  # bytes: a field's exact bytes (untrusted.field_bytes), not UTF-8


class Event(Enum):
    """Each kind's MESSAGE_ID, documented in packaging/gpugate.catalog."""

    RUN_STARTED = "7d1f3a0c2b7e4c1e9a1b6f0d3e5a8c21"
    HOLDER_FOUND = "2c9a6e4b1d3f4a7e8b0c5d2e6f1a9b34"
    PROCESS_SPARED = "5e3b8a1c7d2f4e9a0b6c1d8e3f7a2b45"
    SIGNAL_SENT = "9b4c2d7e1f3a4b8c9d0e5f6a1b2c3d56"
    SURVIVOR = "3a7e9c1b5d2f4e8a9b0c6d1e7f3a5b67"
    REFUSED = "6f1d3b8e2a4c4f9b0c7d2e8f4a6b1c78"
    WAITING = "8c2e4a9d1b3f4c7e0a5b6d2f8e1a3c89"
    MEMORY_FREED = "1e5a7c3b9d2f4a6e8b0c7d3f5e9a2b90"
    TIMEOUT = "4d8b1e6a3c2f4d9a0e7b5c1f8a3e6d01"
    RUN_FINISHED = "0a6c3e8b5d1f4b2a9c7e6d0f3b8a5e12"
    ERROR = "b7d2f9a4c1e34a5b8d6c0e3f9a7b2d23"  # the run failed, or will
    WARNING = "e4a9c6b2d8f14e3a9c5b7d1f0a6e2c34"  # it goes on, seeing or doing less
    SHM_REMOVED = "3183ab9850024dacaec7f96e3bc5e3c4"
    SHM_KEPT = "a449ad3b8a1042b1a51b60fe6099543e"
    SHM_OWN = "6b0e8ba46b3f4a3cb57003a421b8ddb6"  # the unit's own /dev/shm went with it
    UNOWNED_SEEN = "67a7b86b0eb14a48afeee82507bda001"  # `gpugate sweep`: first seen unowned
    UNOWNED_GONE = "8a522dc541354b6e902fd4ee450558b0"  # `gpugate sweep`: ... and gone since


PRIORITY_ERR, PRIORITY_WARNING, PRIORITY_NOTICE, PRIORITY_INFO = 3, 4, 5, 6
KIND_PRIORITY = {  # an entry's priority where its call names none; else PRIORITY_INFO
    Event.WARNING: PRIORITY_WARNING,
    Event.ERROR: PRIORITY_ERR,
    Event.REFUSED: PRIORITY_ERR,
    Event.SURVIVOR: PRIORITY_ERR,
    Event.TIMEOUT: PRIORITY_ERR,
    Event.SIGNAL_SENT: PRIORITY_NOTICE,
    Event.SHM_REMOVED: PRIORITY_NOTICE,
}
SYSLOG_IDENTIFIER = "gpugate"  # `journalctl -t gpugate`; the stderr systemd captures has it too


class Journal(Protocol):
    def send(self, message: str, fields: dict[str, FieldValue]) -> None: ...


class Notifier(Protocol):
    def notify(self, state: str) -> None: ...


class SystemdJournal:
    """journald through python-systemd; silent where no journald listens."""

    def send(self, message: str, fields: dict[str, FieldValue]) -> None:
        if not os.path.exists("/run/systemd/journal/socket"):
            return
        from systemd import journal  # noqa: PLC0415 - C extension, loaded only where used

        with contextlib.suppress(OSError):  # journald gone (shutdown): stderr still tells
            # sendv, not send: send() adds CODE_FILE/LINE/FUNC naming this very line when the
            # fields lack them; these fields carry the real call site or leave it out.
            journal.sendv(_field("MESSAGE", message), *(_field(k, v) for k, v in fields.items()))


def as_field(value: str | bytes | int) -> FieldValue:
    """A field's value as every Journal takes it: a str that is UTF-8, else its bytes."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, bytes):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # surrogateescape where every surrogate in value stands for a byte it can give back
        escapable = all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in value)
        return value.encode("utf-8", "surrogateescape" if escapable else "replace")
    return value


def _field(name: str, value: FieldValue) -> str | bytes:
    """NAME=value for sendv: bytes where not UTF-8 (python-systemd encodes a str strictly)."""
    value = as_field(value)
    if isinstance(value, str):
        return f"{name}={value}"
    return name.encode("ascii", "replace") + b"=" + value


class SystemdNotifier:
    """sd_notify; needs NotifyAccess=exec (or all) on the unit for hook processes."""

    def notify(self, state: str) -> None:
        if not os.environ.get("NOTIFY_SOCKET"):
            return
        from systemd import daemon  # noqa: PLC0415

        daemon.notify(state)


def stderr_is_journal(stream: TextIO) -> bool:
    """systemd sets JOURNAL_STREAM=dev:inode when stderr already goes to journald."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{info.st_dev}:{info.st_ino}"


class Reporter:
    def __init__(
        self,
        unit: str,
        phase: str,
        *,
        journal: Journal | None = None,
        notifier: Notifier | None = None,
        stream: TextIO | None = None,
        echo: bool | None = None,
        fields: Mapping[str, FieldValue] | None = None,
    ) -> None:
        """fields: added to every entry, over the defaults (a Slurm job's, say)."""
        self.unit, self.phase = unit, phase
        self.shown = unit  # what its stderr lines name: a container's label, where one runs
        self.journal = journal if journal is not None else SystemdJournal()
        self.notifier = notifier if notifier is not None else SystemdNotifier()
        self.stream = stream if stream is not None else sys.stderr
        self.echo = (not stderr_is_journal(self.stream)) if echo is None else echo
        self.fields = dict(fields or {})
        self.dry_run = False

    def as_dry_run(self) -> Reporter:
        """Every entry says GPUGATE_DRY_RUN=1 and goes to stdout (`gpugate pre --dry-run UNIT |
        less`); the same journal and notifier."""
        twin = copy.copy(self)
        twin.dry_run, twin.stream, twin.echo = True, sys.stdout, not stderr_is_journal(sys.stdout)
        return twin

    def event(
        self,
        kind: Event,
        message: str,
        *,
        priority: int | None = None,
        gpus: list[int] | None = None,
        echo: bool = True,
        **extra: str | bytes | int | None,
    ) -> None:
        """message: gpugate's sentence (process text in it through untrusted.printable), escaped
        once more (untrusted.safe_line); extra: GPUGATE_* fields (pid=, used_mib=...; None: none),
        untrusted.field_bytes's as they are."""
        priority = KIND_PRIORITY.get(kind, PRIORITY_INFO) if priority is None else priority
        caller = sys._getframe(1)  # CODE_*: the first caller outside this module
        while caller.f_code.co_filename == __file__ and caller.f_back is not None:
            caller = caller.f_back
        fields: dict[str, FieldValue] = {
            "MESSAGE_ID": kind.value,
            "PRIORITY": str(priority),
            "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
            "CODE_FILE": caller.f_code.co_filename,
            "CODE_LINE": str(caller.f_lineno),
            "CODE_FUNC": caller.f_code.co_name,
            "GPUGATE_EVENT": kind.name.lower(),
            "GPUGATE_UNIT": self.unit,
            "GPUGATE_PHASE": self.phase,
            # Lets `journalctl -u UNIT` find entries also when gpugate ran from a shell.
            "OBJECT_SYSTEMD_UNIT": self.unit,
        }
        if self.dry_run:
            fields["GPUGATE_DRY_RUN"] = "1"
        if gpus:
            fields["GPUGATE_GPU"] = ",".join(str(index) for index in sorted(gpus))
        for key, value in extra.items():
            if value is not None:
                fields[f"GPUGATE_{key.upper()}"] = as_field(value)
        fields.update(self.fields)
        message = safe_line(message)
        self.journal.send(message, fields)
        if echo and self.echo:
            try:
                print(f"gpugate {self.phase} {self.shown}: {message}", file=self.stream, flush=True)
            except OSError:
                # `gpugate pre --dry-run UNIT | head` (EPIPE), or a `gpugate run` unit's
                # terminal that was closed (EIO): the journal has it, the run goes on.
                self.echo = False

    def warn(
        self, reason: str, message: str, *, gpus: list[int] | None = None, **extra: str | None
    ) -> None:
        """A WARNING entry (it goes on, seeing or doing less); reason: its GPUGATE_REASON."""
        self.event(
            Event.WARNING, message, priority=None, gpus=gpus, echo=True, reason=reason, **extra
        )

    def status(self, text: str) -> None:
        self.notifier.notify(f"STATUS=gpugate {self.phase}: {safe_line(text)}")

    def clear_status(self) -> None:
        """An empty STATUS=: a service that runs on shows none of gpugate's words."""
        self.notifier.notify("STATUS=")

    def extend_timeout(self, seconds: float) -> None:
        self.notifier.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


class ReporterFactory(Protocol):
    def __call__(
        self, unit: str, phase: str, *, fields: Mapping[str, FieldValue] | None = None
    ) -> Reporter: ...
