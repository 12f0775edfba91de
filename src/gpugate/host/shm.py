"""POSIX shared memory on the host: its areas (/dev/shm, /run/shm), the files processes hold
there, known by (device, inode), never by name alone (a container's /dev/shm shows the same
names), and removing a file only while it is still the very inode that was seen. A unit's own
/dev/shm (TemporaryFileSystem=) is read through one of its processes' /proc/PID/root."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import NamedTuple

from gpugate.host.safe_files import read_at
from gpugate.host.systemd import mount_table

DELETED_SUFFIX = " (deleted)"
RUN_SHM = "/run/shm"  # Debian 7 and older: /dev/shm was a symlink to it, or both were mounts


class FreshHolders(NamedTuple):  # who holds the shm files now, and PIDs not read
    by_key: Mapping[ShmKey, Collection[int]]
    unreadable: Collection[int] = ()


class ShmKey(NamedTuple):
    dev: int
    ino: int


class ShmArea(NamedTuple):
    """A folder where shm_open puts files: its path as the host's processes name it, its
    device, and where gpugate opens it: under /proc/1/root where gpugate runs in a mount
    namespace of its own (a hook of a unit with TemporaryFileSystem=/dev/shm)."""

    path: str
    dev: int
    at: str = ""  # where gpugate reaches the folder; empty: path

    @property
    def where(self) -> str:
        return self.at or self.path

    def shown(self, reached: str) -> str:
        """A path found under `where` as the host's processes name it."""
        return self.path.rstrip("/") + reached[len(self.where.rstrip("/")) :]


class ShmFile(NamedTuple):
    """A file in an shm area that a process holds; names: what /proc showed for it (a maps
    name both as written and with "\\012" as a newline: the inode tells which is the file).
    opened: held open for reading or writing, or mapped (False: only through O_PATH
    descriptors, which need no permission on the file)."""

    key: ShmKey
    names: tuple[str, ...]
    opened: bool = True
    holder: Credentials | None = None  # as the scan read it (None: not read)

    @property
    def path(self) -> str:
        return self.names[0].removesuffix(DELETED_SUFFIX)


def merge(files: Iterable[ShmFile]) -> dict[ShmKey, ShmFile]:
    """One ShmFile per key, with every name seen for it."""
    merged: dict[ShmKey, ShmFile] = {}
    for file in files:
        seen = merged.get(file.key, file)
        names = tuple(dict.fromkeys(seen.names + file.names))
        opened = seen.opened or file.opened
        merged[file.key] = ShmFile(file.key, names, opened, seen.holder or file.holder)
    return merged


def mount_points(proc_root: Path, pid: str = "self") -> set[str]:
    """Every mount point PROC/PID/mountinfo lists; none where it cannot be read."""
    try:
        return set(mount_table((proc_root / pid / "mountinfo").read_text(errors="replace")))
    except OSError:
        return set()


def host_root(dev_root: Path, proc_root: Path) -> str | None:
    """PROC/1/root where gpugate runs in a mount namespace other than PID 1's (systemd runs a
    unit's `+` hooks in the unit's); None where it shares it, cannot tell, or reads stand-ins."""
    if dev_root != Path("/dev"):
        return None
    try:
        ours = os.stat(proc_root / "self" / "ns" / "mnt")
        init = os.stat(proc_root / "1" / "ns" / "mnt")
    except OSError:
        return None
    return None if os.path.samestat(ours, init) else str(proc_root / "1" / "root")


def find_areas(dev_root: Path, proc_root: Path, root: str | None = None) -> list[ShmArea]:
    """DEV/shm, where glibc's shm_open and sem_open put their files (a symlink: its target),
    and /run/shm where mountinfo lists a mount of its own there, each known by its device.
    Always the host's (PID 1's): in a mount namespace of gpugate's own, through PROC/1/root
    (root: that folder, where not host_root's)."""
    root = root or host_root(dev_root, proc_root)
    if root is None:
        names, mounts = [os.path.realpath(dev_root / "shm")], mount_points(proc_root)
    else:
        names, mounts = ["/dev/shm"], mount_points(proc_root, "1")
    if RUN_SHM in mounts:
        names.append(RUN_SHM if root else os.path.realpath(RUN_SHM))
    areas: dict[int, ShmArea] = {}
    for name in names:
        path, at = (name, "") if root is None else _through_root(root, name)
        try:
            info = os.lstat(at) if at else os.stat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            areas.setdefault(info.st_dev, ShmArea(path, info.st_dev, at))
    return list(areas.values())


def _through_root(root: str, named: str) -> tuple[str, str]:
    """named as the host names it, a symlink followed one step by hand (realpath would read
    the /proc/1/root link itself), and where gpugate reaches it."""
    path = named
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.lstat(root + named).st_mode):
            target = os.readlink(root + named)
            path = os.path.normpath(os.path.join(os.path.dirname(named), target))
    return path, root + path


def area_of(areas: Sequence[ShmArea], path: str) -> ShmArea | None:
    return next((area for area in areas if path.startswith(area.path.rstrip("/") + "/")), None)


def maps_names(raw: str) -> tuple[str, ...]:
    unescaped = raw.replace("\\012", "\n")
    return (raw,) if unescaped == raw else (raw, unescaped)


def maps_key(line_head: bytes) -> ShmKey | None:
    """The device and inode of a maps line: `START-END PERMS OFFSET MAJ:MIN INODE`."""
    fields = line_head.split()
    if len(fields) < 5:
        return None
    major, _, minor = fields[3].partition(b":")
    try:
        return ShmKey(os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
    except ValueError:
        return None


class Space(NamedTuple):
    area: ShmArea
    total_bytes: int
    free_bytes: int  # what an unprivileged process may still allocate (f_bavail)


def space(area: ShmArea) -> Space | None:
    try:
        vfs = os.statvfs(area.where)
    except OSError:
        return None
    return Space(area, vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize)


class FileFacts(NamedTuple):
    path: str  # the name that is this file now
    bytes: int  # allocated: what removing it gives back to the tmpfs
    size: int  # apparent (st_size)
    uid: int
    gid: int = 0
    mode: int = 0  # st_mode's permission bits
    folder_uid: int = 0  # the folder holding the name: who may unlink it
    folder_gid: int = 0
    folder_mode: int = 0o1777


def _parent_fd(area: ShmArea, path: str) -> tuple[int, str] | None:
    """An fd of the folder holding path in the area, walked one component at a time following
    no symlink (the area is world-writable: a folder swapped for a symlink between a check and
    an unlink must not lead outside it), and the last component; None where that fails."""
    relative = path[len(area.path.rstrip("/")) + 1 :]
    parts = relative.split("/")
    if not relative or any(part in ("", ".", "..") for part in parts):
        return None
    try:
        fd = os.open(area.where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except OSError:
        os.close(fd)
        return None
    return fd, parts[-1]


InodeIndex = Mapping[ShmKey, Sequence[str]]


MAX_WALK_DEPTH = 8  # folders below an area's top that a walk enters (POSIX names are flat)
MAX_WALK_ENTRIES = 200_000  # names a walk looks at, in all, per area


def regular_files(area: ShmArea) -> Iterator[tuple[str, os.stat_result]]:
    """Each regular file of the area's own device in it, with its lstat: at most
    MAX_WALK_DEPTH folders deep and MAX_WALK_ENTRIES names, so that no account can make the
    walk endless (the area is world-writable)."""
    folders = [(area.where, 0)]
    seen = 0
    while folders:
        folder, depth = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_WALK_ENTRIES:
                        return
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    own = info.st_dev == area.dev
                    if own and stat.S_ISREG(info.st_mode):
                        yield area.shown(entry.path), info
                    elif own and stat.S_ISDIR(info.st_mode) and depth < MAX_WALK_DEPTH:
                        folders.append((entry.path, depth + 1))
        except OSError:
            continue


def inode_index(areas: Sequence[ShmArea]) -> dict[ShmKey, list[str]]:
    index: dict[ShmKey, list[str]] = {}
    for area in areas:
        for path, info in regular_files(area):
            index.setdefault(ShmKey(info.st_dev, info.st_ino), []).append(path)
    return index


def facts(
    areas: Sequence[ShmArea], file: ShmFile, index: InodeIndex | None = None
) -> FileFacts | None:
    """The file's size and owner, by whichever of its names is this very inode now; None where
    none is (deleted, replaced, or outside every area)."""
    with contextlib.closing(_own_names(areas, file, index)) as names:
        return next((found for _, _, found in names), None)


def _own_names(
    areas: Sequence[ShmArea], file: ShmFile, index: InodeIndex | None
) -> Generator[tuple[int, str, FileFacts], None, None]:
    """Each name that is this very file now (its device and inode, checked through the
    folder's fd), with that fd, open while the caller acts on the name, the name's last part,
    and the file's facts. Tried: the names /proc showed, then the file's names by inode. A
    name may not be the file's: glibc's sem_open creates a temporary file, maps it, links it
    to sem.NAME and unlinks the temporary name, so maps shows "/dev/shm/sem.XXXXXX (deleted)"
    for a semaphore that is very much there; a name may also have been renamed since."""
    # " (deleted)" is the kernel's, or part of a real name: both are tried.
    shown = [tried for name in file.names for tried in (name, name.removesuffix(DELETED_SUFFIX))]
    for name in dict.fromkeys([*shown, *(index or {}).get(file.key, ())]):
        area = area_of(areas, name)
        if area is None or area.dev != file.key.dev:
            continue
        found = _parent_fd(area, name)
        if found is None:
            continue
        fd, last = found
        try:
            info = os.stat(last, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and ShmKey(info.st_dev, info.st_ino) == file.key:
                yield fd, last, _facts(name, info, os.fstat(fd))
        except OSError:
            continue
        finally:
            os.close(fd)


def _facts(name: str, info: os.stat_result, folder: os.stat_result) -> FileFacts:
    return FileFacts(
        name,
        info.st_blocks * 512,
        info.st_size,
        info.st_uid,
        info.st_gid,
        stat.S_IMODE(info.st_mode),
        folder.st_uid,
        folder.st_gid,
        stat.S_IMODE(folder.st_mode),
    )


class Unlinked(NamedTuple):
    facts: FileFacts | None  # None: no name is this file any more
    error: str | None = None  # the unlink failed (the file is still there)
    refused: bool = False  # `allowed` said no to the facts read right before: left alone


def unlink_if_same(
    areas: Sequence[ShmArea],
    file: ShmFile,
    index: InodeIndex | None = None,
    allowed: Callable[[FileFacts], bool] = lambda facts: True,
) -> Unlinked:
    """Remove the name that is this very file (device and inode checked right before, through
    the folder's fd); a name that now holds another file is left alone, and so is one whose
    facts `allowed` refuses, read in the same look. (Of hard links, the first found goes.)"""
    with contextlib.closing(_own_names(areas, file, index)) as names:
        for fd, last, found in names:
            if not allowed(found):
                return Unlinked(found, refused=True)
            try:
                os.unlink(last, dir_fd=fd)
            except FileNotFoundError:
                return Unlinked(None)  # removed by someone else meanwhile
            except OSError as exc:
                return Unlinked(found, errno.errorcode.get(exc.errno or 0, str(exc)))
            return Unlinked(found)
    return Unlinked(None)


def largest_files(areas: Sequence[ShmArea], count: int) -> list[tuple[ShmKey, FileFacts]]:
    """The COUNT largest regular files in the areas, by allocated bytes."""
    found: list[tuple[ShmKey, FileFacts]] = []
    for area in areas:
        for path, info in regular_files(area):
            seen = FileFacts(path, info.st_blocks * 512, info.st_size, info.st_uid)
            found.append((ShmKey(info.st_dev, info.st_ino), seen))
    found.sort(key=lambda item: (-item[1].bytes, item[1].path))
    return found[:count]


# Who may remove a file: gpugate removes a killed process's file only where that process's
# account could have done so itself (core.shm_cleanup), judged on its /proc/PID/status.
CAP_DAC_OVERRIDE = 1
CAP_FOWNER = 3
O_PATH = 0o10000000  # fdinfo's `flags:` are octal; an O_PATH fd needs no permission on the file
FLAGS_LINE = re.compile(r"^flags:[ \t]*([0-7]+)[ \t]*$", re.MULTILINE)


class Credentials(NamedTuple):
    uid: int  # real
    gid: int  # real
    groups: frozenset[int]
    # real uid 0 with CAP_DAC_OVERRIDE and CAP_FOWNER in effect: the kernel lets it write and
    # unlink any file; root whose capabilities were dropped is judged by the modes like others
    privileged: bool = False


def parse_status(text: str) -> Credentials | None:
    """Uid, Gid, Groups and CapEff of /proc/PID/status; None where one is missing or malformed."""
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("Uid", "Gid", "Groups", "CapEff"):
            fields[key] = value.split()
    try:
        uid, gid = int(fields["Uid"][0]), int(fields["Gid"][0])
        groups = frozenset(int(group) for group in fields.get("Groups", []))
        caps = int(fields["CapEff"][0], 16) if fields.get("CapEff") else 0
    except (KeyError, IndexError, ValueError):
        return None
    needed = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_FOWNER)
    return Credentials(uid, gid, groups, privileged=uid == 0 and caps & needed == needed)


def read_credentials(proc_fd: int, pid_name: str) -> Credentials | None:
    try:
        text = read_at(proc_fd, f"{pid_name}/status", 16384)
    except OSError:
        return None
    return parse_status(text.decode("ascii", "replace"))


def fd_opens_file(fdinfo: str) -> bool:
    """An fd that opened the file for reading or writing: not O_PATH (which any account may
    take on any file it can name). False where the flags cannot be read."""
    match = FLAGS_LINE.search(fdinfo)
    return match is not None and not int(match.group(1), 8) & O_PATH


MAX_ENTRIES = 10_000  # files counted at most (the sizes come from statvfs whatever the count)


class OwnShm(NamedTuple):
    pid: int  # the process it was read through
    dev: int
    total_bytes: int
    used_bytes: int  # what the tmpfs holds now (statvfs: blocks less free blocks)
    files: int  # regular files at its top level (MAX_ENTRIES at most)


def own_shm_of_any(
    proc_root: Path, pids: Collection[int], host_devs: Collection[int]
) -> OwnShm | None:
    """The /dev/shm of the first of PIDS where it is a tmpfs of its own (another device than
    its /dev and the host's shm areas); None where it is none's, or cannot be read."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    for pid in sorted(pids):
        fds: list[int] = []
        try:
            fds.append(os.open(proc_root / str(pid) / "root", flags))
            fds.append(os.open("dev", flags | os.O_NOFOLLOW, dir_fd=fds[-1]))
            dev_info = os.fstat(fds[-1])
            fds.append(os.open("shm", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
            info = os.fstat(fds[-1])
            if info.st_dev in host_devs or info.st_dev == dev_info.st_dev:
                continue
            vfs = os.fstatvfs(fds[-1])
            with os.scandir(fds[-1]) as entries:
                found = (entry for entry in entries if entry.is_file(follow_symlinks=False))
                files = len(list(islice(found, MAX_ENTRIES)))
        except OSError:
            continue
        finally:
            for fd in fds:
                os.close(fd)
        used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        return OwnShm(pid, info.st_dev, vfs.f_blocks * vfs.f_frsize, used, files)
    return None


def is_own_tmpfs(path: str, host_devs: Collection[int]) -> bool:
    """PATH (gpugate's own /dev/shm) is a folder on a device other than the host's areas."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_dev not in host_devs
