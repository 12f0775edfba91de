"""Files and programs root uses where another account may have been first: who may change a
path (`untrusted`), bounded reads that never follow a link nor block on a FIFO, folders walked
by descriptor so no name can be swapped meanwhile, and programs run from fixed system folders
with a clean environment under a deadline (the unit's PATH or LD_PRELOAD never chooses them)."""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import stat
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import NamedTuple

from gpugate.errors import (
    LinkOnPath,
    NotRegularFile,
    ProgramUnavailable,
    Refused,
    TooLarge,
    UnsafeLink,
)

MAX_BYTES = 1 << 20  # configs, leases, records and the metrics state are a few KiB
MAX_LINK_HOPS = 40  # as the kernel's


class Exposure(Enum):
    """How a path lies open to an account root does not trust (its value: in words)."""

    OWNER = "belongs to another account"
    GROUP_WRITABLE = "is writable by group"  # its name follows
    WORLD_WRITABLE = "is writable by every account"


class Untrusted(NamedTuple):
    """Why another account may change `path` (`of`, the path asked about, or a folder above)."""

    path: str
    of: str
    problem: Exposure
    uid: int
    gid: int
    mode: int  # st_mode


# What is not a regular file: its test, its name (NotRegularFile.kind) and in words.
KINDS = (
    (stat.S_ISFIFO, "fifo", "a FIFO"),
    (stat.S_ISSOCK, "socket", "a socket"),
    (stat.S_ISCHR, "character-device", "a character device"),
    (stat.S_ISBLK, "block-device", "a block device"),
    (stat.S_ISDIR, "folder", "a folder"),
    (stat.S_ISLNK, "symlink", "a symbolic link"),
)


def kind_of(mode: int) -> str:
    return next((name for test, name, _ in KINDS if test(mode)), "regular")


def _judge(
    path: str, of: str, info: os.stat_result, below_trusted: bool, uids: Collection[int]
) -> Untrusted | None:
    """One component; below_trusted: the entry under it is trusted, which a sticky folder guards."""
    mode = info.st_mode
    sticky = stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and below_trusted
    if info.st_uid not in uids:
        problem = Exposure.OWNER
    elif stat.S_ISLNK(mode) or sticky:  # a link's own mode bits mean nothing; its folder decides
        return None
    elif mode & stat.S_IWOTH:
        problem = Exposure.WORLD_WRITABLE
    elif mode & stat.S_IWGRP:
        problem = Exposure.GROUP_WRITABLE
    else:
        return None
    return Untrusted(path, of, problem, info.st_uid, info.st_gid, mode)


def untrusted(path: Path | str, uids: Collection[int] | None = None) -> Untrusted | None:
    """The first component of path (as written, then as resolved) that an account other than
    uids (root and gpugate's own) may change; a missing one is judged by the folders above."""
    uids = frozenset({0, os.geteuid()}) if uids is None else uids
    written = os.path.abspath(path)
    for candidate in dict.fromkeys((written, os.path.realpath(written))):
        below_trusted = True  # nothing below the path itself
        for component in (candidate, *map(str, Path(candidate).parents)):
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
    """One read of at most size bytes, or (None) every byte (/proc makes maps a page at a time)."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, size) if size is not None else _read_up_to(fd, 1 << 62)
    finally:
        os.close(fd)


def _read_up_to(fd: int, most: int) -> bytes:
    chunks: list[bytes] = []
    while most > 0 and (chunk := os.read(fd, min(most, 1 << 16))):
        chunks.append(chunk)
        most -= len(chunk)
    return b"".join(chunks)


def read_capped(
    path: Path | str,
    limit: int = MAX_BYTES,
    *,
    dir_fd: int | None = None,
    follow_links: bool = False,
    check: Callable[[os.stat_result], object] | None = None,
) -> bytes:
    """The bytes of a regular file of at most limit bytes; never follows a symbolic link in
    its last component (unless follow_links: a file another program reads through its links,
    as systemd reads EnvironmentFile=), never blocks on a FIFO or device. check: called with
    the open file's status before a byte is read (it raises to refuse it)."""
    fd = open_in(dir_fd, path, os.O_RDONLY, follow_links=follow_links)
    try:
        info = os.fstat(fd)
        if check is not None:
            check(info)
        if info.st_size > limit:
            raise TooLarge(path, info.st_size, limit)
        data = _read_up_to(fd, limit + 1)
        if len(data) > limit:  # grew since fstat
            raise TooLarge(path, len(data), limit)
        return data
    finally:
        os.close(fd)


def open_folder(path: Path | str, *, make: bool = True) -> int:
    """path's folder as an O_DIRECTORY descriptor, made where missing (make). A symbolic link
    on the way is followed only where the folder holding it is trusted; else UnsafeLink."""
    uids = frozenset({0, os.geteuid()})
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    queue = list(Path(os.path.abspath(path)).parts[1:])
    here, fd, hops = "/", os.open("/", flags), 0
    try:
        while queue:
            name = queue.pop(0)
            try:
                next_fd = _open_component(fd, name, flags, make=make)
            except LinkOnPath as link:
                hops += 1
                why = _judge(here, here, os.fstat(fd), link.uid in uids, uids)
                if why is not None or hops > MAX_LINK_HOPS:
                    raise UnsafeLink(os.path.join(here, name)) from None
                target = os.path.normpath(os.path.join(here, link.target))
                queue = list(Path(target).parts[1:]) + queue
                next_fd, name = os.open("/", flags), "/"  # the walk starts again at /
            os.close(fd)
            fd, here = next_fd, os.path.join(here, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_component(fd: int, name: str, flags: int, *, make: bool) -> int:
    try:
        return os.open(name, flags, dir_fd=fd)
    except FileNotFoundError:
        if not make:
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
        return _open_component(fd, name, flags, make=False)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISLNK(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), name) from None
        raise LinkOnPath(os.readlink(name, dir_fd=fd), info.st_uid) from None


def open_in(
    folder_fd: int | None, name: Path | str, flags: int, *, follow_links: bool = False
) -> int:
    """name in the folder (open_folder's; None: the working one), a regular file or
    NotRegularFile: never through a symbolic link (unless follow_links), nor blocking on a FIFO."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, 0o644, dir_fd=folder_fd)
    except OSError as exc:  # refused for what is there (a link: ELOOP, a socket: ENXIO...)?
        mode = stat.S_IFREG
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP, errno.ENODEV):
            with contextlib.suppress(OSError):
                mode = os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(name, kind_of(mode)) from None
        raise
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


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    with folder(path.parent) as folder_fd:
        write_in(folder_fd, path.name, text.encode("utf-8"), mode)


def write_in(folder_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace name in the folder (open_folder's descriptor) with data: written beside it under
    a name of its own (O_EXCL|O_NOFOLLOW), flushed, fchmod'ed, renamed over it, so a reader sees
    the old file or the new one, also after a crash; a link another account planted in the
    folder is never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    # os.urandom, not secrets: that imports hashlib and hmac on every run, for the same bytes
    temporary = f".{name}.{os.urandom(6).hex()}.tmp"
    fd = os.open(temporary, flags, 0o600, dir_fd=folder_fd)
    try:
        with open(fd, "wb") as handle:  # closes fd; write() writes every byte
            handle.write(data)
            handle.flush()
            os.fsync(fd)
            os.fchmod(fd, mode)
        os.replace(temporary, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder_fd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(folder_fd)


def first_root_executable(paths: Iterable[str]) -> str | None:
    """The first of paths that is an executable regular file; as root, only one owned by root
    that no other account may rewrite."""
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            continue
        shared = info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid)
        trusted = os.geteuid() != 0 or (info.st_uid == 0 and not shared)
        if stat.S_ISREG(info.st_mode) and os.access(path, os.X_OK) and trusted:
            return path
    return None


# Root-owned folders where Debian, Ubuntu, RHEL, Slurm's and Docker's packages put their
# programs, searched in this order. Nothing a unit sets adds to them.
SYSTEM_DIRS: tuple[str, ...] = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/opt/slurm/bin",
    "/snap/bin",
)
SYSTEM_PATH = ":".join(SYSTEM_DIRS[:6])


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str

    def first_line(self) -> str:
        """What the program said first (stderr, else stdout)."""
        said = (self.stderr or self.stdout).strip().splitlines()
        return said[0] if said else ""


def find_program(name: str, dirs: Sequence[str] | None = None) -> str | None:
    return first_root_executable(os.path.join(d, name) for d in dirs or SYSTEM_DIRS)


def run_program(argv: Sequence[str], timeout_s: float) -> Result:
    """argv (argv[0] from find_program), clean environment, no stdin; ProgramUnavailable past
    timeout_s (killed) or where it cannot start; a non-zero exit: the caller's."""
    if not os.path.isabs(argv[0]):
        raise ValueError(f"{argv[0]!r}: not an absolute path (find_program)")
    import subprocess  # noqa: PLC0415 (2-3 ms a container hook that runs nothing need not pay)

    name = os.path.basename(argv[0])
    try:  # the home of gpugate's account: docker's and podman's configuration
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = "/"
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
            env={"PATH": SYSTEM_PATH, "LC_ALL": "C", "HOME": home},
        )
    except subprocess.TimeoutExpired:
        raise ProgramUnavailable(
            f"{name} {' '.join(argv[1:2])} did not answer within {timeout_s:g} s (killed)"
        ) from None
    except OSError as exc:
        raise ProgramUnavailable(f"{argv[0]}: cannot run it: {exc.strerror or str(exc)}") from None
    return Result(done.returncode, done.stdout, done.stderr)


# What root will not read or follow, in words (docs/hardening.md, rules 2 and 6).
RULE = "docs/hardening.md, rule 2"


def account(uid: int | None) -> str:
    """`alice (uid 1000)`."""
    if uid is None:
        return "an account gpugate could not read"
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def why_untrusted(found: Untrusted) -> str:
    """`its folder /srv belongs to another account (owner alice (uid 1000), mode 0755)`."""
    what = "folder " if stat.S_ISDIR(found.mode) else ""
    where = "it" if found.path == found.of else f"its {what}{found.path}"
    named = f" {group(found.gid)}" if found.problem is Exposure.GROUP_WRITABLE else ""
    said = f"{where} {found.problem.value}{named}"
    return f"{said} (owner {account(found.uid)}, mode {stat.S_IMODE(found.mode):04o})"


def untrusted_text(found: Untrusted, *, state: bool = False) -> str:
    """A file root reads (after `PATH: `) or (state) the lock_dir others may change, refused."""
    euid = os.geteuid()
    accounts = "root" if euid == 0 else f"root or {account(euid)}"
    why = f"refused: {why_untrusted(found)}"
    if state:
        return (
            f"{found.of}: {why}; gpugate's state folder and the folders above it must belong to "
            f"{accounts} and be writable by no group or other account ({RULE}); nothing was done"
        )
    return (
        f"{why}; gpugate reads only a config file that it and every folder above it belong to "
        f"{accounts} and no group or other account may write ({RULE})"
    )


def read_trusted(path: Path | str, limit: int = MAX_BYTES, *, follow_links: bool = True) -> str:
    """path's UTF-8 text (through its links, each judged, unless not follow_links), once it and
    its folders are found only trusted accounts' to change (`untrusted`); else Refused."""
    found = untrusted(path)
    if found is not None:
        raise Refused(untrusted_text(found))
    try:
        return read_capped(path, limit, follow_links=follow_links).decode("utf-8")
    except FileNotFoundError:
        raise Refused("no such file", missing=True) from None
    except PermissionError:
        raise Refused("permission denied reading it") from None
    except NotRegularFile as exc:
        words = next((words for _, name, words in KINDS if name == exc.kind), exc.kind)
        raise Refused(f"refused: {words}, not a regular file; not read") from None
    except TooLarge as exc:
        raise Refused(
            f"refused: {exc.size} bytes, more than a config file ({exc.limit}); not read"
        ) from None
    except OSError as exc:
        raise Refused(exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise Refused("is not UTF-8 text") from None
