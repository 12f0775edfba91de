"""SIGCONT and SIGTERM to every target at once, SIGKILL after the grace, each pinned first (a
pidfd checked against the start time seen at discovery: a recycled PID is never signalled); and
respawners, parents not taken themselves whose killed children come back (a `while true` loop)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Collection, Iterable
from typing import NamedTuple, Protocol

from gpugate.core.decide import Choice
from gpugate.core.roles import ProcessTree
from gpugate.errors import PermissionDenied
from gpugate.host.scan import ProcessId, ProcFs, ProcInfo


class Pinned(Protocol):
    ident: ProcessId

    def send(self, signum: int) -> bool: ...

    def exited(self) -> bool: ...

    def fileno(self) -> int | None: ...

    def close(self) -> None: ...


class PinnedProcess:
    """A process held by pidfd: signals reach it or nothing, never a PID's next owner. Without
    pidfd (kernel < 5.3, fd None) its start time is checked before each signal instead."""

    def __init__(self, ident: ProcessId, procfs: ProcFs, fd: int | None) -> None:
        self.ident, self._procfs, self._fd = ident, procfs, fd

    def send(self, signum: int) -> bool:
        """True if the signal was delivered, False if the process is already gone."""
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, signum)
            elif self._procfs.still_same(self.ident):
                os.kill(self.ident.pid, signum)
            else:
                return False
        except ProcessLookupError:
            return False
        except PermissionError:
            raise PermissionDenied(
                f"not permitted to signal PID {self.ident.pid} (run gpugate as root)"
            ) from None
        return True

    def exited(self) -> bool:
        if self._fd is not None:
            return bool(select.select([self._fd], [], [], 0)[0])
        if not self._procfs.still_same(self.ident):
            return True
        stat = self._procfs.stat(self.ident.pid)  # fresh: outside any oneshot()
        return stat is None or stat.state in ("Z", "X")

    def fileno(self) -> int | None:
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)


def pin(ident: ProcessId, procfs: ProcFs) -> Pinned | None:
    """Hold the process seen at discovery, or None if it is gone or its PID was reused."""
    try:
        fd: int | None = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        fd = None  # no pidfd: PinnedProcess checks the start time before each signal
    # A pidfd names whichever process has the PID now; keep it only if that is ours.
    if not procfs.still_same(ident):
        if fd is not None:
            os.close(fd)
        return None
    return PinnedProcess(ident, procfs, fd)


class KillResult(NamedTuple):
    """How the pinned targets ended (one gone or its PID reused before pinning is in none)."""

    terminated: list[ProcessId]  # ended within the grace
    killed: list[ProcessId]  # needed SIGKILL
    survivors: list[ProcessId]  # alive at the deadline


def wait_exited(
    processes: Iterable[Pinned], until: float, clock: Callable[[], float] = time.monotonic
) -> None:
    """Until every process has exited or `until` passes (pidfds poll, others sleep)."""
    pending = [proc for proc in processes if not proc.exited()]
    delay = 0.005
    while pending:
        remaining = until - clock()
        if remaining <= 0:
            return
        fds = [fd for proc in pending if (fd := proc.fileno()) is not None]
        if len(fds) == len(pending):
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            poller.poll(max(1, int(remaining * 1000)))
        else:
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.1)
        pending = [proc for proc in pending if not proc.exited()]


def terminate(
    targets: Iterable[ProcessId],
    *,
    grace_s: float,
    deadline: float,
    procfs: ProcFs,
    on_signal: Callable[[ProcessId, int], None] = lambda ident, signum: None,
    on_sigkill_wait: Callable[[list[ProcessId]], None] = lambda idents: None,
    sigkill_wait_s: float = 5.0,
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin,
    clock: Callable[[], float] = time.monotonic,
) -> KillResult:
    pinned = [proc for ident in targets if (proc := pinner(ident, procfs)) is not None]
    try:
        # A stopped process cannot act on SIGTERM: continue it first (psutil does the same).
        for proc in pinned:
            if proc.send(signal.SIGCONT) and proc.send(signal.SIGTERM):
                on_signal(proc.ident, signal.SIGTERM)
        wait_exited(pinned, min(clock() + grace_s, deadline), clock)
        remaining = [proc for proc in pinned if not proc.exited()]
        for proc in remaining:
            if proc.send(signal.SIGKILL):
                on_signal(proc.ident, signal.SIGKILL)
        wait_exited(remaining, min(clock() + sigkill_wait_s, deadline), clock)
        stuck = [proc for proc in remaining if not proc.exited()]
        if stuck:
            on_sigkill_wait([proc.ident for proc in stuck])
            wait_exited(stuck, deadline, clock)
        gone = [proc for proc in remaining if proc.exited()]
        return KillResult(
            [proc.ident for proc in pinned if proc not in remaining],
            [proc.ident for proc in gone],
            [proc.ident for proc in remaining if proc not in gone],
        )
    finally:
        for proc in pinned:
            proc.close()


MAX_ANCESTRY = 16


class Respawner:
    """A parent of a killed target, left alive and watched: a respawner once respawns > 0."""

    __slots__ = ("executables", "info", "newest_killed_start", "respawns")

    def __init__(self, info: ProcInfo, respawns: int = 0) -> None:
        self.info, self.respawns = info, respawns
        self.executables: set[str] = set()  # of its killed children
        self.newest_killed_start = 0  # start time of its newest killed child


class RespawnWatch:
    """Parents of the run's targets, not targets themselves; a new target below one respawns."""

    def __init__(self) -> None:
        self.watched: dict[ProcessId, Respawner] = {}

    def killed(
        self,
        choices: list[Choice],
        taken: Collection[ProcessId],
        tree: ProcessTree,
        *,
        self_chain: Collection[int],
    ) -> None:
        """After a kill round: count respawns, then watch the parents (never self_chain)."""
        parents = (self._watched_ancestor(c.holder.info, tree) for c in choices)
        for respawner in {p.info.ident: p for p in parents if p is not None}.values():
            respawner.respawns += 1
        for choice in choices:
            info = choice.holder.info
            parent = tree.info(info.ppid)
            if parent is None or parent.pid <= 1 or parent.pid in self_chain:
                continue
            if parent.ident in taken:
                continue
            watched = self.watched.setdefault(parent.ident, Respawner(parent))
            if info.exe:
                watched.executables.add(info.exe)
            watched.newest_killed_start = max(watched.newest_killed_start, info.start_time)

    def _watched_ancestor(self, info: ProcInfo, tree: ProcessTree) -> Respawner | None:
        current = info
        for _ in range(MAX_ANCESTRY):
            parent = tree.info(current.ppid) if current.pid > 1 else None
            if parent is None:
                return None
            watched = self.watched.get(parent.ident)
            if watched is not None and info.start_time > watched.newest_killed_start:
                return watched
            current = parent
        return None

    def pending(self, tree: ProcessTree) -> list[int]:
        """Respawns under way that hold nothing yet: new children of watched parents running
        a killed child's executable."""
        return [
            child.pid
            for watched in self.watched.values()
            for child in map(tree.info, tree.children(watched.info.pid))
            if child is not None
            and child.state not in ("Z", "X")
            and child.start_time > watched.newest_killed_start
            # the killed child's program again, or a fork not yet exec'd
            and (child.exe in watched.executables or child.exe == watched.info.exe)
        ]

    def respawners(self, alive: Callable[[ProcessId], bool]) -> list[Respawner]:
        return [w for w in self.watched.values() if w.respawns and alive(w.info.ident)]
