"""Reading /proc: one process's facts, pinned by (pid, start time).

(The device-file scan is in `gpugate.scan`.)

Everything here reads under a configurable proc root and returns None for a process that
vanished mid-read; nothing here decides or signals.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PF_KTHREAD = 0x00200000


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


@dataclass
class ProcFs:
    """Reads /proc lazily and caches what it read for the life of one discovery round."""

    root: Path = Path("/proc")
    _info: dict[int, ProcInfo | None] = field(default_factory=dict)

    def pids(self) -> Iterator[int]:
        for name in os.listdir(self.root):
            if name.isdigit():
                yield int(name)

    def _read(self, pid: int, name: str) -> str | None:
        try:
            with open(f"{self.root}/{pid}/{name}", encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except (FileNotFoundError, ProcessLookupError):
            return None

    def stat(self, pid: int) -> ProcInfo | None:
        """The cheap facts (one read): enough to walk the tree."""
        if pid in self._info:
            return self._info[pid]
        text = self._read(pid, "stat")
        info = parse_stat(text) if text else None
        self._info[pid] = info
        return info

    def info(self, pid: int) -> ProcInfo | None:
        """All facts gpugate shows and decides on, read once."""
        base = self.stat(pid)
        if base is None or base.cgroup is not None or base.kernel_thread:
            return base
        cgroup_text = self._read(pid, "cgroup")
        status = self._read(pid, "status")
        cmdline = self._read(pid, "cmdline")
        if cgroup_text is None or status is None or cmdline is None:
            self._info[pid] = None
            return None
        uid = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")),
            None,
        )
        info = ProcInfo(
            **{
                **base.__dict__,
                "uid": uid,
                "cgroup": parse_cgroup(cgroup_text) or "/",
                "cmdline": tuple(arg for arg in cmdline.split("\0") if arg),
                "exe": self._exe(pid),
            }
        )
        # The process may have died and its PID been reused while we read.
        if self._start_time(pid) != base.start_time:
            self._info[pid] = None
            return None
        self._info[pid] = info
        return info

    def _start_time(self, pid: int) -> int | None:
        text = self._read(pid, "stat")
        info = parse_stat(text) if text else None
        return info.start_time if info else None

    def _exe(self, pid: int) -> str | None:
        try:
            return os.readlink(f"{self.root}/{pid}/exe").removesuffix(" (deleted)")
        except OSError:
            return None

    def wchan(self, pid: int) -> str:
        return (self._read(pid, "wchan") or "?").strip() or "?"

    def children(self, pid: int) -> list[int]:
        """Children of every thread of pid (needs CONFIG_PROC_CHILDREN, as Debian kernels have)."""
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
