"""gpugate's state folders and per-GPU locks: folders probed writable before a run kills
anything (StateUnwritable, exit 73), and flock(2) locks per GPU, taken in UUID order so two
runs never wait on each other in a cycle; a flock dies with its holder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from gpugate.errors import GateError, LockTimeout, PermissionDenied, StateUnwritable
from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import open_folder, open_in


def flock_by(
    fd: int,
    deadline: float,
    on_wait: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """An exclusive flock on fd, polled until the deadline; False if it never came. on_wait
    runs the first time the lock is found taken."""
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if clock() >= deadline:
                return False
            if not waited:
                on_wait()
                waited = True
            time.sleep(0.02)


@contextlib.contextmanager
def gpu_locks(
    lock_dir: Path,
    gpus: Sequence[Gpu],
    deadline: float,
    on_wait: Callable[[Gpu], None] = lambda gpu: None,
    clock: Callable[[], float] = time.monotonic,
    on_unlocked: Callable[[Path, str], None] | None = None,
) -> Iterator[None]:
    """The GPUs' locks, in UUID order. on_unlocked given (a phase after a stop): a lock_dir or
    lock file that cannot be made is told to it (the path, and why) and the run goes on; an
    existing lock file on a read-only file system is still taken (flock needs no write)."""
    try:
        folder_fd = open_folder(lock_dir)
    except OSError as exc:  # a file in the way, a read-only file system, no space, ...
        if on_unlocked is None and isinstance(exc, PermissionError):
            why = f"{lock_dir}: permission denied creating it (for GPU locks)"
            raise PermissionDenied(why, code="no-permission-creating") from None
        if on_unlocked is None:
            raise _os_error(lock_dir, "gpu-locks", "GPU locks", exc) from None
        on_unlocked(lock_dir, exc.strerror or str(exc))
        yield
        return
    held = [folder_fd]
    try:
        for gpu in sorted(gpus, key=lambda g: g.uuid):
            path = lock_dir / f"{gpu.uuid}.lock"
            fd = _lock_file(folder_fd, path, on_unlocked)
            if fd is None:
                continue
            held.append(fd)
            if not flock_by(fd, deadline, functools.partial(on_wait, gpu), clock):
                raise LockTimeout(f"{path}: another gpugate run held {gpu.label} past the deadline")
        yield
    finally:
        for fd in held:
            os.close(fd)


def _lock_file(
    folder_fd: int, path: Path, on_unlocked: Callable[[Path, str], None] | None
) -> int | None:
    try:
        return open_in(folder_fd, path.name, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        if on_unlocked is None and isinstance(exc, PermissionError):
            raise PermissionDenied(f"{path}: permission denied") from None
        if on_unlocked is None:
            raise _os_error(path, "gpu-lock", "a GPU lock", exc) from None
        cause = exc.strerror or str(exc)
    try:  # it may exist: a lock taken through a read-only descriptor is still one
        return open_in(folder_fd, path.name, os.O_RDONLY)
    except OSError:
        on_unlocked(path, cause)
        return None


PROBE_BYTES = 4096  # a page: more than any lease, record or lock gpugate writes needs


def check_writable(folder: Path, what: str) -> None:
    """Make folder where missing, then write and remove a probe file of PROBE_BYTES in it,
    through the folder's descriptor. what: the state that goes there ("GPU leases")."""
    try:
        folder_fd = open_folder(folder)
    except PermissionError:
        why = f"{folder}: permission denied creating it (for {what})"
        raise PermissionDenied(why, code="no-permission-creating") from None
    except OSError as exc:
        raise _unwritable(folder, what, exc, opening=True) from None
    name = f".gpugate-probe.{os.urandom(6).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(name, flags, 0o600, dir_fd=folder_fd)
        except PermissionError:
            why = f"{folder}: permission denied writing {what} there"
            raise PermissionDenied(why, code="no-permission-writing") from None
        except OSError as exc:
            raise _unwritable(folder, what, exc) from None
        try:
            if os.write(fd, bytes(PROBE_BYTES)) < PROBE_BYTES:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            raise _unwritable(folder, what, exc) from None
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder_fd)
    finally:
        os.close(folder_fd)


def check_file_slot(path: Path, what: str) -> None:
    """A file gpugate replaces whole (rename over it): anything but a file there is in the way."""
    if path.is_dir() or (path.exists() and not path.is_file()):
        why = f"{path}: cannot write {what} there: a folder is in the way (not a file)"
        raise StateUnwritable(path, what, why, code="state-folder-in-the-way")


def check_all(
    folders: Iterable[tuple[Path, str]],
    files: Iterable[tuple[Path, str]] = (),
    on_unwritable: Callable[[GateError], None] | None = None,
) -> None:
    """Each folder and file slot checked; a problem raised, or passed to on_unwritable."""
    for check, items in ((check_writable, folders), (check_file_slot, files)):
        for path, what in items:
            try:
                check(path, what)
            except (StateUnwritable, PermissionDenied) as exc:
                if on_unwritable is None:
                    raise
                on_unwritable(exc)


def _unwritable(folder: Path, what: str, exc: OSError, *, opening: bool = False) -> StateUnwritable:
    if exc.errno == errno.ENOTDIR or (opening and exc.errno == errno.EEXIST):
        why = f"{folder}: cannot write {what} there: a file is in the way (not a folder)"
        return StateUnwritable(folder, what, why, code="state-file-in-the-way")
    return _os_error(folder, what, what, exc)


def _os_error(path: Path, what: str, words: str, exc: OSError) -> StateUnwritable:
    why = f"{path}: cannot write {words} there: {exc.strerror or str(exc)}"
    return StateUnwritable(path, what, why, code="state-os-error")
