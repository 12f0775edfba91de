"""Files root reads and writes where another account may have been first: the one place that
opens gpugate's config and state files (configs, leases, failed-start records, locks, the
metrics textfile) and judges who may change a path.

- `untrusted(path)`: the first of a path and the folders above it (to `/`) that an account
  other than root (and, not running as root, the running account) may change: its owner, or
  group or other write permission. A sticky folder writable by all (`/tmp`) counts as safe for
  an entry below it that is itself a trusted account's: the sticky bit lets no other account
  rename, remove or replace that entry. Facts only; the words are report/'s.
- `read_capped(path)`: O_NONBLOCK|O_NOFOLLOW, fstat, a regular file of at most `limit` bytes,
  else NotRegularFile or TooLarge, without reading a byte (a FIFO never blocks the hook).
- `open_folder(path)`: a folder as a descriptor, reached one component at a time (openat, no
  symbolic link followed unless the folder holding it is trusted); what is opened, made or
  renamed is opened, made or renamed relative to it, so no name can be swapped meanwhile.
- `open_in(folder_fd, name)`: a lock or state file, O_NOFOLLOW, a regular file or refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

# Configs, leases, records and the metrics state are a few KiB; a MiB is absurd for any.
MAX_BYTES = 1 << 20
MAX_LINK_HOPS = 40  # as the kernel's


class Exposure(Enum):
    """How a path lies open to an account root does not trust."""

    OWNER = "owner"  # belongs to an account that is not trusted
    GROUP_WRITABLE = "group-writable"
    WORLD_WRITABLE = "world-writable"


@dataclass(frozen=True)
class Untrusted:
    """Why another account may change `path` (the file, or the folder `path` names, above
    `of`, the path asked about)."""

    path: str
    of: str
    problem: Exposure
    uid: int
    gid: int
    mode: int  # st_mode


class NotRegularFile(OSError):
    """A FIFO, socket, device, folder or symbolic link where a file was expected."""

    def __init__(self, path: object, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", str(path))
        self.kind = kind


class TooLarge(OSError):
    def __init__(self, path: object, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"larger than {limit} bytes", str(path))
        self.size = size
        self.limit = limit


class UnsafeLink(OSError):
    """A symbolic link in a folder another account may change: never followed."""

    def __init__(self, path: str, folder: Untrusted) -> None:
        super().__init__(errno.ELOOP, "a symbolic link in a folder another account may change")
        self.filename = path
        self.folder = folder


def trusted_uids() -> frozenset[int]:
    """Root, and the account gpugate runs as (tests, `config check` by a user)."""
    return frozenset({0, os.geteuid()})


def kind_of(mode: int) -> str:
    """A file type as the facts name it: fifo, socket, character-device, ..."""
    kinds = (
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character-device"),
        (stat.S_ISBLK, "block-device"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISLNK, "symlink"),
    )
    return next((name for test, name in kinds if test(mode)), "regular")


def _judge(
    path: str, of: str, info: os.stat_result, below_trusted: bool, uids: Collection[int]
) -> Untrusted | None:
    """One component: below_trusted, the entry under this folder (if any) is a trusted
    account's, which a sticky folder protects from every other account."""

    def found(problem: Exposure) -> Untrusted:
        return Untrusted(path, of, problem, info.st_uid, info.st_gid, info.st_mode)

    mode = info.st_mode
    if info.st_uid not in uids:
        return found(Exposure.OWNER)
    if stat.S_ISLNK(mode):
        return None  # a link's own mode bits mean nothing; its folder decides who may change it
    sticky = stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and below_trusted
    if mode & stat.S_IWOTH and not sticky:
        return found(Exposure.WORLD_WRITABLE)
    if mode & stat.S_IWGRP and not sticky:
        return found(Exposure.GROUP_WRITABLE)
    return None


def _chain(path: str) -> Iterator[str]:
    current = path
    while True:
        yield current
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def untrusted(path: Path | str, uids: Collection[int] | None = None) -> Untrusted | None:
    """The first component of path (as written, then as resolved) that another account may
    change; None where only trusted accounts may. A missing path is judged by the folders
    that would hold it (whoever may write the nearest one may put it there)."""
    uids = trusted_uids() if uids is None else uids
    written = os.path.abspath(path)
    for candidate in dict.fromkeys((written, os.path.realpath(written))):
        below_trusted = True  # nothing below the path itself
        for component in _chain(candidate):
            try:
                info = os.lstat(component)
            except OSError:  # missing: whoever may write the folder above may make it
                below_trusted = False
                continue
            finding = _judge(component, written, info, below_trusted, uids)
            if finding is not None:
                return finding
            below_trusted = True
    return None


def read_at(dir_fd: int, name: str, size: int | None = None) -> bytes:
    """NAME's bytes under the folder descriptor, in one open, read and close: one read of at
    most SIZE bytes, or (None) every byte to the end: /proc makes maps a page at a time.
    OSError as os.open and os.read raise it."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if size is not None:
            return os.read(fd, size)
        chunks: list[bytes] = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_capped(
    path: Path | str,
    limit: int = MAX_BYTES,
    *,
    dir_fd: int | None = None,
    follow_links: bool = False,
) -> bytes:
    """The bytes of a regular file of at most limit bytes; never follows a symbolic link in
    its last component (unless follow_links: a file another program reads through its links,
    as systemd reads EnvironmentFile=), never blocks on a FIFO or device. OSError
    (FileNotFoundError, NotRegularFile, TooLarge, ...)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    flags |= 0 if follow_links else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise _what_is_there(path, exc, dir_fd) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path, kind_of(info.st_mode))
        if info.st_size > limit:
            raise TooLarge(path, info.st_size, limit)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew since fstat
            raise TooLarge(path, len(data), limit)
        return data
    finally:
        os.close(fd)


def _what_is_there(path: Path | str, exc: OSError, dir_fd: int | None) -> OSError:
    """An open that failed because of what is there (a link: ELOOP; a socket: ENXIO; ...)
    as NotRegularFile; any other cause as it was."""
    if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP, errno.ENODEV):
        return exc
    try:
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return exc
    return exc if stat.S_ISREG(info.st_mode) else NotRegularFile(path, kind_of(info.st_mode))


def _folder_trusted(fd: int, link_uid: int, uids: Collection[int]) -> Untrusted | None:
    info = os.fstat(fd)
    return _judge(f"/proc/self/fd/{fd}", "", info, link_uid in uids, uids)


def open_folder(path: Path | str, *, make: bool = True, mode: int = 0o755) -> int:
    """path's folder as an O_DIRECTORY descriptor (the caller closes it), made where missing
    (make). A symbolic link on the way is followed only where the folder holding it is
    trusted (untrusted() of it is None); else UnsafeLink. NotADirectoryError where a file is
    in the way."""
    uids = trusted_uids()
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    queue = list(Path(os.path.abspath(path)).parts[1:])
    here, fd, hops = "/", os.open("/", flags), 0
    try:
        while queue:
            name = queue.pop(0)
            try:
                next_fd = _open_component(fd, name, flags, make=make, mode=mode)
            except _Link as link:
                hops += 1
                why = _folder_trusted(fd, link.uid, uids)
                if why is not None or hops > MAX_LINK_HOPS:
                    folder = why or Untrusted(here, here, Exposure.OWNER, -1, -1, 0)
                    raise UnsafeLink(os.path.join(here, name), _named(folder, here)) from None
                target = os.path.normpath(os.path.join(here, link.target))
                queue = list(Path(target).parts[1:]) + queue
                os.close(fd)
                here, fd = "/", os.open("/", flags)
                continue
            os.close(fd)
            fd, here = next_fd, os.path.join(here, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _named(found: Untrusted, path: str) -> Untrusted:
    return Untrusted(path, path, found.problem, found.uid, found.gid, found.mode)


class _Link(Exception):
    def __init__(self, target: str, uid: int) -> None:
        self.target = target
        self.uid = uid


def _open_component(fd: int, name: str, flags: int, *, make: bool, mode: int) -> int:
    for _ in range(2):
        try:
            return os.open(name, flags, dir_fd=fd)
        except FileNotFoundError:
            if not make:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISLNK(info.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), name) from None
            raise _Link(os.readlink(name, dir_fd=fd), info.st_uid) from None
    return os.open(name, flags, dir_fd=fd)


def open_in(folder_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    """name in the folder (open_folder's), never through a symbolic link, a regular file or
    NotRegularFile (never blocking on a FIFO on the way). flags: O_RDWR | O_CREAT, ..."""
    all_flags = flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(name, all_flags, mode, dir_fd=folder_fd)
    except OSError as exc:
        raise _what_is_there(name, exc, folder_fd) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFile(name, kind_of(info.st_mode))
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def folder(path: Path | str, *, make: bool = True) -> Iterator[int]:
    fd = open_folder(path, make=make)
    try:
        yield fd
    finally:
        os.close(fd)


# Files replaced whole (write_atomically): written beside the target,
# flushed to disk, then renamed over it, so a reader (systemd, node_exporter, the next gpugate
# run) sees the old file or the new one, never half of one, also after a crash or a power cut.
# Everything is done relative to the folder's descriptor (folder(), above): the temporary is
# made with O_EXCL|O_NOFOLLOW under a name of its own, its mode set with fchmod on the descriptor,
# and it is renamed into place; a symbolic link another account planted in the folder is never
# followed, so root never creates, writes or chmods the link's target.


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    with folder(path.parent) as folder_fd:
        write_in(folder_fd, path.name, text.encode("utf-8"), mode)


def write_in(folder_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace name in the folder (a descriptor from safe_files.open_folder) with data."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    temporary = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temporary, flags, 0o600, dir_fd=folder_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(temporary, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder_fd)
        raise
    # The rename itself is on disk only once the folder is.
    with contextlib.suppress(OSError):
        os.fsync(folder_fd)


def first_root_executable(paths: Iterable[str]) -> str | None:
    """The first of paths that is an executable regular file; as root, only one owned by root
    that no other account may rewrite. None if none is."""
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or not os.access(path, os.X_OK):
            continue
        if os.geteuid() == 0 and not _only_root_may_change(info):
            continue
        return path
    return None


def _only_root_may_change(info: os.stat_result) -> bool:
    if info.st_uid != 0 or info.st_mode & stat.S_IWOTH:
        return False
    return not (info.st_mode & stat.S_IWGRP and info.st_gid != 0)
