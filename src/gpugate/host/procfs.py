"""One process's facts from /proc, pinned by (pid, start time), None for a process that
vanished mid-read. Read by hand under any proc root: psutil's PROCFS_PATH is process-global,
and psutil has no session, process group, cgroup, wchan or children lists."""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

PF_KTHREAD = 0x00200000
DEFAULT_PROC = Path("/proc")


@dataclass(frozen=True, order=True)
class ProcessId:
    """A process, not a PID: the start time tells a recycled PID from the original."""

    pid: int
    start_time: int  # clock ticks after boot, field 22 of /proc/PID/stat


@dataclass(frozen=True)
class ProcInfo:
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
        if self.uid is None:
            return "?"
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)


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


def parse_cgroup(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].removesuffix(" (deleted)")
    return None


class ProcFs:
    """Reads /proc under `root`. Inside `oneshot()` (psutil's is the model) a process's facts
    are read once and kept until the block ends: one per discovery round, so a round sees one
    consistent table and the next round, or the kill, sees the processes as they are now."""

    def __init__(self, root: Path = DEFAULT_PROC) -> None:
        self.root = Path(root)
        self._cache: dict[int, ProcInfo | None] | None = None  # set inside oneshot() only

    @contextmanager
    def oneshot(self) -> Iterator[None]:
        """Cache facts for the block (nested blocks share the outermost one's cache)."""
        if self._cache is not None:
            yield
            return
        self._cache = {}
        try:
            yield
        finally:
            self._cache = None

    def pids(self) -> Iterator[int]:
        for name in os.listdir(self.root):
            if name.isdigit():
                yield int(name)

    def _read(self, pid: int, name: str) -> str | None:
        try:
            # surrogateescape: a comm or cgroup that is not UTF-8 keeps its bytes (untrusted.py)
            with open(
                f"{self.root}/{pid}/{name}", encoding="utf-8", errors="surrogateescape"
            ) as handle:
                return handle.read()
        except (FileNotFoundError, ProcessLookupError):
            return None

    def _remember(self, pid: int, info: ProcInfo | None) -> ProcInfo | None:
        if self._cache is not None:
            self._cache[pid] = info
        return info

    def stat(self, pid: int) -> ProcInfo | None:
        """The cheap facts (one read): enough to walk the tree."""
        if self._cache is not None and pid in self._cache:
            return self._cache[pid]
        text = self._read(pid, "stat")
        return self._remember(pid, parse_stat(text) if text else None)

    def info(self, pid: int) -> ProcInfo | None:
        """All facts gpugate shows and decides on, read once: identity, uid, command line,
        executable and cgroup."""
        base = self.stat(pid)
        if base is None or base.cgroup is not None or base.kernel_thread:
            return base
        return self._remember(pid, self._facts(base))

    def _facts(self, base: ProcInfo) -> ProcInfo | None:
        """None where the process is gone, or its PID reused since stat was read."""
        pid = base.pid
        cgroup_text = self._read(pid, "cgroup")
        cmdline = (self._read(pid, "cmdline") or "").split("\0")
        try:
            exe: str | None = os.readlink(f"{self.root}/{pid}/exe")
        except OSError:  # another user's (not root), a zombie's, a kernel thread's
            exe = None
        status = self._read(pid, "status") or ""
        uids = [line.split()[1] for line in status.splitlines() if line.startswith("Uid:")]
        gone = self._start_time(pid) != base.start_time and base.state != "Z"
        if gone or cgroup_text is None:
            return None
        return replace(
            base,
            uid=int(uids[0]) if uids else None,
            cgroup=parse_cgroup(cgroup_text) or "/",
            cmdline=tuple(arg for arg in cmdline if arg),
            exe=exe or None,
        )

    def _start_time(self, pid: int) -> int | None:
        text = self._read(pid, "stat")
        info = parse_stat(text) if text else None
        return info.start_time if info else None

    def wchan(self, pid: int) -> str:  # by hand: psutil has no wchan
        return (self._read(pid, "wchan") or "?").strip() or "?"

    def children(self, pid: int) -> list[int]:
        """Children of every thread of pid (CONFIG_PROC_CHILDREN). By hand: psutil's children()
        reads the parent of every process on the host."""
        result: list[int] = []
        try:
            tasks = os.listdir(f"{self.root}/{pid}/task")
        except OSError:
            return result
        for tid in tasks:
            text = self._read(pid, f"task/{tid}/children")
            if text:
                result.extend(int(child) for child in text.split())
        return result

    def still_same(self, ident: ProcessId) -> bool:
        return self._start_time(ident.pid) == ident.start_time
