"""gpugate's own state folders (locks, leases, failed-start records), checked before a run kills
anything: a folder that cannot be made, is not a folder, is read-only or full is
StateUnwritable (exit 73) naming the folder and the cause, not a kill followed by a crash;
for a phase after a stop (its traits' state_required false), a warning, and the run goes on."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

from gpugate.errors import GateError, PermissionDenied, StateUnwritable
from gpugate.host.safe_files import open_folder

# What a probe writes: a page, more than any lease, record or lock gpugate writes needs.
PROBE_BYTES = 4096


def check_writable(folder: Path, what: str) -> None:
    """Make folder where missing, then write and remove a probe file of PROBE_BYTES in it,
    through the folder's descriptor (safe_files: no link another account planted is followed).
    what: the state that goes there, for the message ("GPU leases")."""
    try:
        folder_fd = open_folder(folder)
    except (FileExistsError, NotADirectoryError):
        raise StateUnwritable(
            folder,
            what,
            f"{folder}: cannot write {what} there: a file is in the way (not a folder)",
            code="state-file-in-the-way",
        ) from None
    except PermissionError:
        raise PermissionDenied(
            f"{folder}: permission denied creating it (for {what})", code="no-permission-creating"
        ) from None
    except OSError as exc:
        raise _unwritable(folder, what, exc) from None
    try:
        _probe(folder_fd, folder, what)
    finally:
        os.close(folder_fd)


def _probe(folder_fd: int, folder: Path, what: str) -> None:
    name = f".gpugate-probe.{secrets.token_hex(6)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=folder_fd)
    except PermissionError:
        raise PermissionDenied(
            f"{folder}: permission denied writing {what} there", code="no-permission-writing"
        ) from None
    except OSError as exc:
        raise _unwritable(folder, what, exc) from None
    try:
        written = os.write(fd, bytes(PROBE_BYTES))
        if written < PROBE_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        raise _unwritable(folder, what, exc) from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder_fd)


def check_file_slot(path: Path, what: str) -> None:
    """A file gpugate replaces whole (rename over it): anything but a file there is in the way."""
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise StateUnwritable(
            path,
            what,
            f"{path}: cannot write {what} there: a folder is in the way (not a file)",
            code="state-folder-in-the-way",
        )


def check_all(
    folders: Iterable[tuple[Path, str]],
    files: Iterable[tuple[Path, str]] = (),
    on_unwritable: Callable[[GateError], None] | None = None,
) -> None:
    """Each folder and file slot checked; a problem raised (StateUnwritable, PermissionDenied),
    or, given on_unwritable, passed to it and the rest checked too (a run that goes on)."""
    checks = [(check_writable, folders), (check_file_slot, files)]
    for check, items in checks:
        for path, what in items:
            try:
                check(path, what)
            except (StateUnwritable, PermissionDenied) as exc:
                if on_unwritable is None:
                    raise
                on_unwritable(exc)


def _unwritable(folder: Path, what: str, exc: OSError) -> StateUnwritable:
    if exc.errno == errno.ENOTDIR:
        return StateUnwritable(
            folder,
            what,
            f"{folder}: cannot write {what} there: a file is in the way (not a folder)",
            code="state-file-in-the-way",
        )
    return StateUnwritable(
        folder,
        what,
        f"{folder}: cannot write {what} there: {exc.strerror or str(exc)}",
        code="state-os-error",
    )
