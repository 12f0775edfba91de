"""Per-GPU locks under /run/gpugate: two runs on overlapping GPUs take turns.

flock(2) locks die with their holder, so a crashed gpugate never blocks the next one.
Locks are taken in UUID order, so two runs can never wait on each other in a cycle.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gpugate.errors import LockTimeout, PermissionDenied, StateUnwritable
from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import open_folder, open_in


def flock_by(
    fd: int,
    deadline: float,
    on_wait: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Take an exclusive flock on fd, polling until the deadline; False if it never came.
    on_wait runs once, the first time the lock is found taken."""
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


def open_lock(folder_fd: int, path: Path) -> int:
    """path's lock file in its folder's descriptor: made where missing, never through a
    symbolic link, a regular file or StateUnwritable."""
    try:
        return open_in(folder_fd, path.name, os.O_RDWR | os.O_CREAT)
    except PermissionError:
        raise PermissionDenied(f"{path}: permission denied") from None
    except OSError as exc:
        raise StateUnwritable(
            path,
            "gpu-lock",
            f"{path}: cannot write a GPU lock there: {exc.strerror or str(exc)}",
            code="state-os-error",
        ) from None


# Told where a phase that goes on without its state (its traits' state_required false)
# could not take a lock: the path, and why.
Unlocked = Callable[[Path, str], None]


@contextlib.contextmanager
def gpu_locks(
    lock_dir: Path,
    gpus: Sequence[Gpu],
    deadline: float,
    on_wait: Callable[[Gpu], None] = lambda gpu: None,
    clock: Callable[[], float] = time.monotonic,
    on_unlocked: Unlocked | None = None,
) -> Iterator[None]:
    """The GPUs' locks, in UUID order. on_unlocked given (a phase after a stop): a lock_dir or
    lock file that cannot be made (full, read-only) is told to it and the run goes on; an
    existing lock file on a read-only file system is still taken (flock needs no write)."""
    held: list[int] = []
    try:
        folder_fd = _lock_folder(lock_dir, on_unlocked)
        if folder_fd is None:
            yield
            return
        held.append(folder_fd)
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


def _lock_folder(lock_dir: Path, on_unlocked: Unlocked | None) -> int | None:
    try:
        return open_folder(lock_dir)
    except OSError as exc:  # a file in the way, a read-only file system, no space, ...
        if on_unlocked is not None:
            on_unlocked(lock_dir, exc.strerror or str(exc))
            return None
        if isinstance(exc, PermissionError):
            raise PermissionDenied(
                f"{lock_dir}: permission denied creating it (for GPU locks)",
                code="no-permission-creating",
            ) from None
        raise StateUnwritable(
            lock_dir,
            "gpu-locks",
            f"{lock_dir}: cannot write GPU locks there: {exc.strerror or str(exc)}",
            code="state-os-error",
        ) from None


def _lock_file(folder_fd: int, path: Path, on_unlocked: Unlocked | None) -> int | None:
    if on_unlocked is None:
        return open_lock(folder_fd, path)
    causes = []
    # It may exist: a lock taken through a read-only descriptor is still one.
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return open_in(folder_fd, path.name, flags)
        except OSError as exc:
            causes.append(exc.strerror or str(exc))
    on_unlocked(path, causes[0])
    return None
