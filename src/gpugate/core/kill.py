"""Killing: SIGCONT and SIGTERM to every target at once, SIGKILL after the grace, then wait.

Each target is pinned before the first signal: a pidfd opened and then checked against the
start time seen at discovery, so a PID recycled since then is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gpugate.errors import PermissionDenied
from gpugate.host.procfs import ProcessId, ProcFs


class Pinned(Protocol):
    ident: ProcessId

    def send(self, signum: int) -> bool: ...

    def exited(self) -> bool: ...

    def fileno(self) -> int | None: ...

    def close(self) -> None: ...


def _deliver(ident: ProcessId, send: Callable[[], None]) -> bool:
    """True if the signal was delivered, False if the process is already gone."""
    try:
        send()
    except ProcessLookupError:
        return False
    except PermissionError:
        raise PermissionDenied(
            f"not permitted to signal PID {ident.pid} (run gpugate as root)"
        ) from None
    return True


class PidfdProcess:
    """A process held by pidfd: signals reach it or nothing, never a PID's next owner."""

    def __init__(self, ident: ProcessId, fd: int) -> None:
        self.ident = ident
        self._fd = fd

    def send(self, signum: int) -> bool:
        return _deliver(self.ident, lambda: signal.pidfd_send_signal(self._fd, signum))

    def exited(self) -> bool:
        ready, _, _ = select.select([self._fd], [], [], 0)
        return bool(ready)

    def fileno(self) -> int | None:
        return self._fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class CheckedProcess:
    """Fallback without pidfd (kernel < 5.3): the start time is checked before each signal."""

    def __init__(self, ident: ProcessId, procfs: ProcFs) -> None:
        self.ident = ident
        self._procfs = procfs

    def send(self, signum: int) -> bool:
        if not self._procfs.still_same(self.ident):
            return False
        return _deliver(self.ident, lambda: os.kill(self.ident.pid, signum))

    def exited(self) -> bool:
        if not self._procfs.still_same(self.ident):
            return True
        stat = self._procfs.stat(self.ident.pid)  # fresh: outside any oneshot()
        return stat is None or stat.state in ("Z", "X")

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        pass


def pin(ident: ProcessId, procfs: ProcFs) -> Pinned | None:
    """Hold the process seen at discovery, or None if it is gone or its PID was reused."""
    try:
        fd = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        if not procfs.still_same(ident):
            return None
        return CheckedProcess(ident, procfs)
    # The pidfd now names whichever process has the PID; keep it only if that is ours.
    if not procfs.still_same(ident):
        os.close(fd)
        return None
    return PidfdProcess(ident, fd)


@dataclass
class KillResult:
    gone_before: list[ProcessId] = field(default_factory=list)  # exited or PID reused first
    terminated: list[ProcessId] = field(default_factory=list)  # ended within the grace
    killed: list[ProcessId] = field(default_factory=list)  # needed SIGKILL
    survivors: list[ProcessId] = field(default_factory=list)  # alive at the deadline


Clock = Callable[[], float]


def wait_exited(processes: Iterable[Pinned], until: float, clock: Clock = time.monotonic) -> None:
    """Block until every process has exited or `until` passes (pidfds poll, others sleep)."""
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
    clock: Clock = time.monotonic,
) -> KillResult:
    result = KillResult()
    pinned: list[Pinned] = []
    for ident in targets:
        proc = pinner(ident, procfs)
        if proc is None:
            result.gone_before.append(ident)
        else:
            pinned.append(proc)
    try:
        # A stopped process cannot act on SIGTERM: continue it first (psutil does the same).
        for proc in pinned:
            if proc.send(signal.SIGCONT) and proc.send(signal.SIGTERM):
                on_signal(proc.ident, signal.SIGTERM)
        wait_exited(pinned, min(clock() + grace_s, deadline), clock)
        remaining = [proc for proc in pinned if not proc.exited()]
        result.terminated = [proc.ident for proc in pinned if proc not in remaining]
        for proc in remaining:
            if proc.send(signal.SIGKILL):
                on_signal(proc.ident, signal.SIGKILL)
        if remaining:
            wait_exited(remaining, min(clock() + sigkill_wait_s, deadline), clock)
            stuck = [proc for proc in remaining if not proc.exited()]
            if stuck:
                on_sigkill_wait([proc.ident for proc in stuck])
                wait_exited(stuck, deadline, clock)
        result.killed = [proc.ident for proc in remaining if proc.exited()]
        result.survivors = [proc.ident for proc in remaining if not proc.exited()]
    finally:
        for proc in pinned:
            proc.close()
    return result
