"""A unit's own /dev/shm (TemporaryFileSystem=/dev/shm): the tmpfs its processes see there, read
through one of them (`/proc/PID/root/dev/shm`), its size and use.

systemd gives every process it starts for the unit (the main one, and each hook, `+` ones
included) a mount namespace of its own with a fresh tmpfs on /dev/shm: a hook never sees the
unit's files at its own /dev/shm, only through a process of the unit. The walk from that
process's root does not follow symlinks (the process may have made its /dev/shm one).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

MAX_ENTRIES = 10_000  # files counted at most (the sizes come from statvfs whatever the count)


@dataclass(frozen=True)
class OwnShm:
    pid: int  # the process it was read through
    dev: int
    total_bytes: int
    used_bytes: int  # what the tmpfs holds now (statvfs: blocks less free blocks)
    files: int  # regular files at its top level (MAX_ENTRIES at most)


def own_shm(proc_root: Path, pid: int, host_devs: Collection[int]) -> OwnShm | None:
    """PID's /dev/shm where it is a tmpfs of its own (a mount: another device than its /dev,
    and none of the host's shm areas); None where it shares the host's, or cannot be read."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    fds: list[int] = []
    try:
        fds.append(os.open(proc_root / str(pid) / "root", flags))
        fds.append(os.open("dev", flags | os.O_NOFOLLOW, dir_fd=fds[-1]))
        dev_info = os.fstat(fds[-1])
        fds.append(os.open("shm", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
        info = os.fstat(fds[-1])
        if info.st_dev in host_devs or info.st_dev == dev_info.st_dev:
            return None
        vfs = os.fstatvfs(fds[-1])
        files = _count_files(fds[-1])
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    return OwnShm(pid, info.st_dev, vfs.f_blocks * vfs.f_frsize, used, files)


def _count_files(fd: int) -> int:
    count = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                count += 1
                if count >= MAX_ENTRIES:
                    break
    return count


def own_shm_of_any(
    proc_root: Path, pids: Collection[int], host_devs: Collection[int]
) -> OwnShm | None:
    """The own /dev/shm of the first of PIDS that has one (a unit's processes)."""
    for pid in sorted(pids):
        found = own_shm(proc_root, pid, host_devs)
        if found is not None:
            return found
    return None


def is_own_tmpfs(path: str, host_devs: Collection[int]) -> bool:
    """Whether PATH (gpugate's own /dev/shm) is a tmpfs other than the host's areas."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_dev not in host_devs
