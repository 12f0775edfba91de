"""The device-file scan: every process with an NVIDIA device file open or mapped, in one pass
over /proc, also reading the fds and maps of the threads of a thread group whose leader exited.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceUse:
    """Which NVIDIA device files one process has open or mapped."""

    fd_paths: frozenset[str]
    mapped_paths: frozenset[str]
    sockets: frozenset[int] = frozenset()  # inodes of the asked-for sockets it has open

    @property
    def paths(self) -> frozenset[str]:
        return self.fd_paths | self.mapped_paths


@dataclass
class DeviceScan:
    users: dict[int, DeviceUse]
    unreadable: list[int]  # PIDs whose fds we may not read (not root): holders may hide there


def scan_device_users(
    proc_root: Path, device_prefix: str, socket_inodes: Collection[int] = frozenset()
) -> DeviceScan:
    """Every process with an fd on, or a mapping of, a file whose path starts with the prefix,
    or an fd on one of the sockets named by inode (read from the same fd links: no second pass).

    psutil's open_files() skips device files, so this reads /proc/PID/fd links itself. The
    kernel's work per process is most of the cost on a host with thousands of them, so every
    name is resolved relative to a directory fd (/proc, then /proc/PID/fd), and a process with
    no address space (kernel thread, zombie) costs one read of its maps and one listing of its
    threads: a thread group whose leader exited (pthread_exit in main) shows an empty maps and
    fd table under /proc/PID while its live threads still hold files, under /proc/PID/task/TID.
    """
    scan = DeviceScan({}, [])
    prefix_bytes = device_prefix.encode()
    proc_fd = os.open(proc_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(proc_fd):
            if not name.isdigit():
                continue
            mapped = _mapped_paths(proc_fd, name, prefix_bytes)
            where = name
            if mapped is None:
                thread = _live_thread_of_dead_leader(proc_fd, name)
                if thread is None:
                    continue
                where = f"{name}/task/{thread}"
                mapped = _mapped_paths(proc_fd, where, prefix_bytes) or set()
            fds = _fd_paths(proc_fd, where, device_prefix, socket_inodes)
            if fds is None:
                scan.unreadable.append(int(name))
            elif fds[0] or fds[1] or mapped:
                scan.users[int(name)] = DeviceUse(
                    frozenset(fds[0]), frozenset(mapped), frozenset(fds[1])
                )
    finally:
        os.close(proc_fd)
    return scan


def _live_thread_of_dead_leader(proc_fd: int, pid_name: str) -> str | None:
    """A live thread of a thread group whose leader is a zombie; None for a kernel thread, a
    zombie process or a process that is gone. (Threads share one fd table and address space.)"""
    try:
        task_fd = os.open(f"{pid_name}/task", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_fd)
    except OSError:
        return None
    try:
        tids = os.listdir(task_fd)
    except OSError:
        return None
    finally:
        os.close(task_fd)
    return next((tid for tid in tids if tid != pid_name), None)


def _fd_paths(
    proc_fd: int, pid_name: str, prefix: str, socket_inodes: Collection[int]
) -> tuple[set[str], set[int]] | None:
    """The fd targets under the prefix and the asked-for sockets; None where we may not read
    them (not root)."""
    paths: set[str] = set()
    sockets: set[int] = set()
    try:
        dir_fd = os.open(f"{pid_name}/fd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_fd)
    except PermissionError:
        return None
    except OSError:
        return paths, sockets  # gone
    try:
        for fd_name in os.listdir(dir_fd):
            try:
                target = os.readlink(fd_name, dir_fd=dir_fd)
            except OSError:
                continue  # closed since the listing
            if target.startswith(prefix):
                paths.add(target)
            elif socket_inodes and target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in socket_inodes:
                    sockets.add(inode)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return paths, sockets


def _mapped_paths(proc_fd: int, pid_name: str, prefix: bytes) -> set[str] | None:
    """Mapped files under the prefix; None for a process that is gone or has no address space.

    Kernel threads and zombies have empty maps, and no open files either: a zombie closed them
    before it died, and a process between the two steps of exiting is past holding anything.
    An unreadable maps (not root) counts as no mappings: the fd check reports the process.
    """
    try:
        maps_fd = os.open(f"{pid_name}/maps", os.O_RDONLY, dir_fd=proc_fd)
    except PermissionError:
        return set()
    except OSError:
        return None
    chunks: list[bytes] = []
    try:
        # maps is made a page at a time: read until the end, not once.
        while chunk := os.read(maps_fd, 65536):
            chunks.append(chunk)
    except OSError:
        return None  # exited while we read
    finally:
        os.close(maps_fd)
    if not chunks:
        return None
    data = b"".join(chunks)
    paths: set[str] = set()
    start = data.find(prefix)
    while start >= 0:
        end = data.find(b"\n", start)
        line_end = len(data) if end < 0 else end
        # maps lines end with the path, padded after the inode: the match must start a field.
        if data[start - 1 : start] == b" ":
            paths.add(data[start:line_end].decode(errors="replace").removesuffix(" (deleted)"))
        start = data.find(prefix, line_end)
    return paths
