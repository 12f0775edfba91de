"""/proc: one process's facts (ProcFs), pinned by (pid, start time), read by hand under any
proc root (psutil's PROCFS_PATH is process-global, and psutil has no session, process group,
cgroup, wchan or children lists); and the device-file scan, one pass over /proc for every
process with an NVIDIA device file or shm file open or mapped, and `status --watch`'s rescans."""

from __future__ import annotations

import functools
import os
import pwd
import stat
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from gpugate.host import shm
from gpugate.host.safe_files import read_at
from gpugate.host.shm import FileFacts, FreshHolders, ShmArea, ShmFile, ShmKey, Space, Unlinked
from gpugate.host.systemd import parse_cgroup

PF_KTHREAD = 0x00200000


class ProcessId(NamedTuple):
    pid: int
    start_time: int  # /proc/PID/stat's field 22: tells a recycled PID from the original


class ProcInfo(NamedTuple):
    pid: int
    start_time: int
    comm: str
    state: str  # R, S, D, Z, T, ...
    ppid: int
    pgrp: int
    session: int
    tty_nr: int
    kernel_thread: bool
    uid: int | None = None
    cgroup: str | None = None  # the cgroup v2 path, "/system.slice/vllm.service"
    cmdline: tuple[str, ...] = ()
    exe: str | None = None

    @property
    def ident(self) -> ProcessId:
        return ProcessId(self.pid, self.start_time)

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.comm}]"

    @property
    def user(self) -> str:
        return "?" if self.uid is None else user_name(self.uid)


def user_name(uid: int) -> str:
    """The account's name, or its number where the passwd database has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def parse_stat(text: str) -> ProcInfo | None:
    # comm may hold spaces and parentheses: it ends at the last ')'.
    open_paren, close_paren = text.find("("), text.rfind(")")
    if open_paren < 0 or close_paren < 0:
        return None
    fields = text[close_paren + 2 :].split()
    if len(fields) < 20:
        return None
    return ProcInfo(
        pid=int(text[:open_paren]),
        comm=text[open_paren + 1 : close_paren],
        state=fields[0],
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        session=int(fields[3]),
        tty_nr=int(fields[4]),
        kernel_thread=bool(int(fields[6]) & PF_KTHREAD),
        start_time=int(fields[19]),
    )


class ProcFs:
    """Reads /proc under `root`. Inside `oneshot()` (psutil's model: one per discovery round)
    a process's facts are read once, so a round sees one consistent table; outside, afresh."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = Path(root)
        self._cache: dict[int, ProcInfo | None] | None = None  # set inside oneshot() only

    @contextmanager
    def oneshot(self) -> Iterator[None]:
        if self._cache is not None:  # a nested block shares the outermost one's cache
            yield
            return
        self._cache = {}
        try:
            yield
        finally:
            self._cache = None

    def _read(self, pid: int, name: str) -> str | None:
        path = f"{self.root}/{pid}/{name}"
        try:  # surrogateescape: a comm or cgroup that is not UTF-8 keeps its bytes (untrusted.py)
            with open(path, encoding="utf-8", errors="surrogateescape") as handle:
                return handle.read()
        except (FileNotFoundError, ProcessLookupError):
            return None

    def stat(self, pid: int) -> ProcInfo | None:
        """The cheap facts (one read): enough to walk the tree."""
        if self._cache is not None and pid in self._cache:
            return self._cache[pid]
        return self._remember(pid, parse_stat(self._read(pid, "stat") or ""))

    def _remember(self, pid: int, info: ProcInfo | None) -> ProcInfo | None:
        if self._cache is not None:
            self._cache[pid] = info
        return info

    def info(self, pid: int) -> ProcInfo | None:
        """All facts gpugate decides on, read once; None where gone, or its PID reused since."""
        base = self.stat(pid)
        if base is None or base.cgroup is not None or base.kernel_thread:
            return base
        cgroup_text = self._read(pid, "cgroup")
        cmdline = (self._read(pid, "cmdline") or "").split("\0")
        try:
            exe: str | None = os.readlink(f"{self.root}/{pid}/exe") or None
        except OSError:  # another user's (not root), a zombie's, a kernel thread's
            exe = None
        owner = shm.parse_status(self._read(pid, "status") or "")
        if cgroup_text is None or (base.state != "Z" and not self.still_same(base.ident)):
            return self._remember(pid, None)
        cgroup = parse_cgroup(cgroup_text) or "/"
        uid = owner.uid if owner else None
        args = tuple(arg for arg in cmdline if arg)
        return self._remember(pid, base._replace(uid=uid, cgroup=cgroup, cmdline=args, exe=exe))

    def wchan(self, pid: int) -> str:  # by hand: psutil has no wchan
        return (self._read(pid, "wchan") or "?").strip() or "?"

    def children(self, pid: int) -> list[int]:
        """Children of every thread of pid (CONFIG_PROC_CHILDREN). By hand: psutil's children()
        reads the parent of every process on the host."""
        try:
            tasks = os.listdir(f"{self.root}/{pid}/task")
        except OSError:
            return []
        texts = (self._read(pid, f"task/{tid}/children") or "" for tid in tasks)
        return [int(child) for text in texts for child in text.split()]

    def still_same(self, ident: ProcessId) -> bool:
        info = parse_stat(self._read(ident.pid, "stat") or "")
        return info is not None and info.start_time == ident.start_time


class DeviceUse(NamedTuple):
    fd_paths: frozenset[str]
    mapped_paths: frozenset[str]
    sockets: frozenset[int] = frozenset()  # inodes of the asked-for sockets it has open

    @property
    def paths(self) -> frozenset[str]:
        return self.fd_paths | self.mapped_paths


class DeviceScan(NamedTuple):
    users: dict[int, DeviceUse]
    unreadable: list[int]  # PIDs whose fds we may not read (not root): holders may hide
    # Every process's files in the shm areas asked for, open or mapped, holder or not.
    shm: dict[int, frozenset[ShmFile]]
    cut_short: list[int]  # PIDs whose fds were not all read by the deadline: holders may hide


CHECK_EVERY = 1024  # fds, or processes, between two looks at the clock


class Deadline(NamedTuple):
    at: float | None = None
    clock: Callable[[], float] = time.monotonic

    def passed(self) -> bool:
        return self.at is not None and self.clock() >= self.at


NO_DEADLINE = Deadline()


def scan_device_users(
    proc_root: Path,
    device_prefix: str | None,
    socket_inodes: Collection[int] = frozenset(),
    shm_areas: Sequence[ShmArea] = (),
    deadline: Deadline = NO_DEADLINE,
    *,
    pids: Collection[int] | None = None,
) -> DeviceScan:
    """Every process with an fd on, or a mapping of, a file whose path starts with the prefix
    (None: the shm files alone), or an fd on one of the sockets named by inode, and every
    process's files in the shm areas, from the same fd links and maps. pids: only these
    processes (`WatchScan`'s rescans). Nothing is read past the deadline: what is left is in
    `cut_short`. psutil's open_files() skips device files: this reads /proc/PID/fd itself."""
    proc_fd = os.open(proc_root, os.O_RDONLY | os.O_DIRECTORY)
    scan = DeviceScan({}, [], {}, [])
    try:
        if pids is None:
            names = [name for name in os.listdir(proc_fd) if name.isdigit()]
        else:
            names = [str(pid) for pid in pids]
        for count, name in enumerate(names):
            if deadline.passed():
                scan.cut_short.extend(int(left) for left in names[count:])
                break
            maps = _read_maps(proc_fd, name)
            where = name
            # A thread group whose leader exited (pthread_exit in main) shows an empty maps and
            # fd table under /proc/PID while its live threads still hold files (PID/task/TID).
            if maps is None:
                try:
                    tids = os.listdir(proc_root / name / "task")
                except OSError:
                    continue
                thread = next((tid for tid in tids if tid != name), None)
                if thread is None:  # a kernel thread or a zombie
                    continue
                where = f"{name}/task/{thread}"
                maps = _read_maps(proc_fd, where) or b""
            fds = _fd_paths(proc_fd, where, device_prefix, socket_inodes, shm_areas, deadline)
            if fds is None:
                scan.unreadable.append(int(name))
                continue
            scan.cut_short.extend([int(name)] if fds.cut_short else [])
            mapped = _mapped_paths(maps, device_prefix)
            if fds.paths or fds.sockets or mapped:
                use = DeviceUse(frozenset(fds.paths), frozenset(mapped), frozenset(fds.sockets))
                scan.users[int(name)] = use
            held = fds.shm + _mapped_shm(maps, shm_areas) if shm_areas else fds.shm
            if held:
                holder = shm.read_credentials(proc_fd, name)
                files = shm.merge(held).values()
                scan.shm[int(name)] = frozenset(f._replace(holder=holder) for f in files)
    finally:
        os.close(proc_fd)
    return scan


class _Fds(NamedTuple):
    paths: set[str]  # under the device prefix
    sockets: set[int]  # asked-for socket inodes
    shm: list[ShmFile]
    cut_short: bool = False  # the deadline came before the last fd


def _fd_paths(
    proc_fd: int,
    pid_name: str,
    prefix: str | None,
    socket_inodes: Collection[int],
    areas: Sequence[ShmArea],
    deadline: Deadline,
) -> _Fds | None:
    """The fd targets wanted; None where we may not read them (not root)."""
    found = _Fds(set(), set(), [])
    shm_prefixes = tuple(area.path.rstrip("/") + "/" for area in areas)
    try:
        dir_fd = os.open(f"{pid_name}/fd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_fd)
    except OSError as exc:  # not ours to read (not root), or gone
        return None if isinstance(exc, PermissionError) else found
    # The names read as they come (a million fds are not one list), until the deadline.
    try:
        with os.scandir(dir_fd) as entries:
            for count, entry in enumerate(entries, 1):
                if count % CHECK_EVERY == 0 and deadline.passed():
                    found = found._replace(cut_short=True)
                    break
                try:
                    target = os.readlink(entry.name, dir_fd=dir_fd)
                except OSError:
                    continue  # closed since the listing
                if prefix and target.startswith(prefix):
                    found.paths.add(target)
                elif socket_inodes and target.startswith("socket:["):
                    inode = int(target[8:-1])
                    if inode in socket_inodes:
                        found.sockets.add(inode)
                elif shm_prefixes and target.startswith(shm_prefixes):
                    found.shm.extend(
                        _fd_shm_file(proc_fd, pid_name, dir_fd, entry.name, target, areas)
                    )
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    return found


def _fd_shm_file(
    proc_fd: int, pid_name: str, dir_fd: int, fd_name: str, target: str, areas: Sequence[ShmArea]
) -> list[ShmFile]:
    """The file behind the fd link (stat follows it, also once unlinked); none on another
    device: another mount namespace's /dev/shm (a container's) shows the same names."""
    area = shm.area_of(areas, target)
    try:
        info = os.stat(fd_name, dir_fd=dir_fd)
    except OSError:
        return []  # closed since the readlink
    if area is None or info.st_dev != area.dev or not stat.S_ISREG(info.st_mode):
        return []  # (a folder or FIFO open there is no segment)
    try:
        fdinfo = read_at(proc_fd, f"{pid_name}/fdinfo/{fd_name}", 4096)
        opened = shm.fd_opens_file(fdinfo.decode("ascii", "replace"))
    except OSError:
        opened = False  # closed since: no evidence
    return [ShmFile(ShmKey(info.st_dev, info.st_ino), (target,), opened)]


def _read_maps(proc_fd: int, pid_name: str) -> bytes | None:
    """None for a process that is gone or has no address space (a kernel thread, a zombie: no
    open files either); unreadable (not root): none, and the fd check reports the process."""
    try:
        return read_at(proc_fd, f"{pid_name}/maps") or None
    except PermissionError:  # (at the open: the kernel checks access there)
        return b""
    except OSError:
        return None  # gone, or exited while we read


def _names_under(data: bytes, prefix: bytes) -> Iterator[tuple[int, int, int]]:
    """(line start, name start, line end) of each maps line whose path starts with prefix."""
    start = data.find(prefix)
    while start >= 0:
        end = data.find(b"\n", start)
        line_end = len(data) if end < 0 else end
        # maps lines end with the path, padded after the inode: the match must start a field.
        if data[start - 1 : start] == b" ":
            yield data.rfind(b"\n", 0, start) + 1, start, line_end
        start = data.find(prefix, line_end)


def _mapped_paths(data: bytes, prefix: str | None) -> set[str]:
    if not prefix:
        return set()
    return {
        data[start:end].decode(errors="replace").removesuffix(" (deleted)")
        for _, start, end in _names_under(data, prefix.encode())
    }


def _mapped_shm(data: bytes, areas: Sequence[ShmArea]) -> list[ShmFile]:
    """Mapped files in the shm areas, by the device and inode of their maps line (a sem_open
    semaphore, or a segment whose fd was closed after mmap, is only there)."""
    files: list[ShmFile] = []
    for area in areas:
        prefix = (area.path.rstrip("/") + "/").encode()
        for line_start, start, end in _names_under(data, prefix):
            key = shm.maps_key(data[line_start:start])
            if key is not None and key.dev == area.dev:
                names = shm.maps_names(data[start:end].decode(errors="surrogateescape"))
                files.append(ShmFile(key, names))
    return files


TCP_LISTEN = "0A"


def listening_sockets(proc_root: Path, ports: Collection[int]) -> dict[int, int]:
    """Inode -> port of each LISTEN socket on the ports (this network namespace's tcp, tcp6)."""
    found: dict[int, int] = {}
    for name in ("tcp", "tcp6") if ports else ():
        try:
            text = (proc_root / "net" / name).read_text()
        except FileNotFoundError:
            continue  # no IPv6 on this kernel
        for fields in (line.split() for line in text.splitlines()[1:]):
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            port, inode = int(fields[1].rsplit(":", 1)[1], 16), int(fields[9])
            if port in ports and inode:
                found[inode] = port
    return found


class HostShm:
    """`core.shm_cleanup.ShmHost`: the shm files' holders (a /proc pass), facts and unlinks."""

    def __init__(self, areas: Sequence[ShmArea], proc_root: Path) -> None:
        self.areas, self.proc_root = areas, proc_root

    @functools.cached_property
    def index(self) -> dict[ShmKey, list[str]]:
        return shm.inode_index(self.areas)

    def holders(self) -> FreshHolders:
        scan = scan_device_users(self.proc_root, None, shm_areas=self.areas)
        by_key: dict[ShmKey, set[int]] = {}
        for pid, files in scan.shm.items():
            for file in files:
                by_key.setdefault(file.key, set()).add(pid)
        return FreshHolders(by_key, scan.unreadable)

    def facts(self, file: ShmFile) -> FileFacts | None:
        return shm.facts(self.areas, file) or shm.facts(self.areas, file, self.index)

    def unlink(self, file: ShmFile, allowed: Callable[[FileFacts], bool]) -> Unlinked:
        done = shm.unlink_if_same(self.areas, file, allowed=allowed)
        return done if done.facts else shm.unlink_if_same(self.areas, file, self.index, allowed)

    def spaces(self) -> list[Space]:
        return [found for area in self.areas if (found := shm.space(area)) is not None]

    def largest(self, count: int) -> list[tuple[ShmKey, FileFacts]]:
        return shm.largest_files(self.areas, count)


FULL_SCAN_EVERY_S = 30.0


class WatchScan:
    """`status --watch`'s scan: each look rescans the processes new since the last, the
    holders it knows and the PIDs NVML lists now; a full scan every FULL_SCAN_EVERY_S (or when
    what is asked changes) finds a process that opened a device file without a CUDA context."""

    full_every_s = FULL_SCAN_EVERY_S
    clock = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self.full_scans = self.rescans = 0
        self._last: DeviceScan | None = None
        self._asked: tuple[object, ...] = ()
        self._listed: set[int] = set()
        self._full_at = 0.0

    def __call__(
        self,
        proc_root: Path,
        device_prefix: str | None,
        socket_inodes: Collection[int] = frozenset(),
        shm_areas: Sequence[ShmArea] = (),
        listed_by_nvml: Collection[int] = (),
        deadline: Deadline = NO_DEADLINE,
    ) -> DeviceScan:
        asked = (proc_root, device_prefix, frozenset(socket_inodes), tuple(shm_areas))
        listed = {int(name) for name in os.listdir(proc_root) if name.isdigit()}
        now = self.clock()
        last = self._last
        if last is None or asked != self._asked or now - self._full_at >= self.full_every_s:
            last, pids, new = None, None, set()
            self._full_at = now
            self.full_scans += 1
        else:
            known = set(last.users) | set(last.shm) | set(last.cut_short)  # (not all read)
            new = listed - self._listed
            pids = sorted(((known | set(listed_by_nvml)) & listed) | new)
            self.rescans += 1
        scan = scan_device_users(
            proc_root, device_prefix, socket_inodes, shm_areas, deadline, pids=pids
        )
        if last is not None:
            # Still there and not readable then: not readable now (no second try per look).
            kept = [pid for pid in last.unreadable if pid in listed and pid not in new]
            scan = scan._replace(unreadable=sorted({*scan.unreadable, *kept}))
        self._last, self._asked, self._listed = scan, asked, listed
        return scan
