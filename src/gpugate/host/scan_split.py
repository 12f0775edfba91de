"""The device-file scan over worker processes: each reads its share of /proc (the PIDs equal
to its number modulo the count) with the one-pass scan, and the parent merges the shares.

The workers are forked when the `SplitScan` is entered, which must be before the parent has a
second thread or an NVML handle: a fork copies the calling thread only (a lock another thread
held stays locked in the child), and NVML maps /dev/nvidia* into the process, which would make
every worker a mapped-only holder. Entering refuses where another thread already runs. Each
scan is bounded by the run's deadline: a worker stops reading there (`scan_device_users`), and
one that has not answered a grace period later is killed and its share counted as cut short.
Leaving the block, or an exception in it (SIGTERM's Interrupted), kills and reaps them all.
The workers are the parent's own children, unreaped until then: their PIDs cannot be reused
under the signal.

A holder a worker found is pinned by its start time: the parent reads it again and drops a PID
that another process took since (the scan read one process, the table would read another).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from gpugate.host.scan import Deadline, DeviceScan, scan_device_users
from gpugate.host.shm import ShmArea

_Part = tuple[DeviceScan, dict[int, "int | None"]]  # a worker's scan, start times of its PIDs
GRACE_S = 2.0  # a worker's answer may come this long after the deadline
_LENGTH = struct.Struct("!Q")


class SplitScanError(RuntimeError):
    """The workers cannot be started safely (another thread runs) or at all."""


@dataclass
class _Worker:
    pid: int
    requests: int  # the parent's write end
    answers: int  # the parent's read end
    buffer: bytearray


@dataclass(frozen=True)
class _Request:
    proc_root: Path
    device_prefix: str | None
    socket_inodes: frozenset[int]
    shm_areas: tuple[ShmArea, ...]
    deadline_at: float | None
    index: int
    count: int


class SplitScan:
    """A `core.discover.DeviceScanner` over WORKERS processes; a context manager."""

    def __init__(self, workers: int, grace_s: float = GRACE_S) -> None:
        if workers < 2:
            raise ValueError(f"a split scan needs 2 or more workers, not {workers}")
        self.count = workers
        self.grace_s = grace_s
        self.workers: list[_Worker] = []
        self.broken = False  # a worker was killed: the rest of the run scans in one pass

    def __enter__(self) -> SplitScan:
        if threading.active_count() > 1:
            raise SplitScanError(
                f"split scan: {threading.active_count()} threads run; the workers must be "
                "forked before any thread or NVML handle exists"
            )
        try:
            for _ in range(self.count):
                self.workers.append(_fork_worker(self.workers))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill and reap every worker (each is our child, unreaped until here: its PID is still
        its own), once."""
        for worker in self.workers:
            for fd in (worker.requests, worker.answers):
                os.close(fd)
            _kill(worker.pid)
        self.workers = []

    def __call__(
        self,
        proc_root: Path,
        device_prefix: str | None,
        socket_inodes: Collection[int],
        shm_areas: Sequence[ShmArea],
        listed_by_nvml: Collection[int],
        deadline: Deadline,
    ) -> DeviceScan:
        del listed_by_nvml
        if self.broken or not self.workers:
            return scan_device_users(proc_root, device_prefix, socket_inodes, shm_areas, deadline)
        unsent: set[int] = set()
        for index, worker in enumerate(self.workers):
            request = _Request(
                proc_root,
                device_prefix,
                frozenset(socket_inodes),
                tuple(shm_areas),
                deadline.at,
                index,
                len(self.workers),
            )
            try:
                _send(worker.requests, pickle.dumps(request))
            except BrokenPipeError:  # it died: its share is cut short
                unsent.add(worker.answers)
        parts, late = self._answers(deadline, unsent)
        own = {worker.pid for worker in self.workers}
        if late:
            self.broken = True
            parts.append((_late_shares(proc_root, late, len(self.workers)), {}))
            self.close()  # killed and reaped once: never signalled again (the PID is free)
        return _pinned(proc_root, parts, own)

    def _answers(self, deadline: Deadline, unsent: set[int]) -> tuple[list[_Part], list[int]]:
        """Each worker's part; the indices of those that had not answered by the deadline and
        its grace, or died without an answer."""
        ended = set(unsent)  # answers' fds of workers that died without an answer
        waiting = {w.answers: w for w in self.workers if w.answers not in ended}
        parts: list[_Part] = []
        give_up = None if deadline.at is None else deadline.at + self.grace_s
        while waiting:
            timeout = None if give_up is None else max(0.0, give_up - time.monotonic())
            ready, _, _ = select.select(list(waiting), [], [], timeout)
            if not ready:
                break
            for fd in ready:
                try:
                    part = _receive(waiting[fd])
                except EOFError:
                    ended.add(fd)
                    part = None
                if part is not None or fd in ended:
                    del waiting[fd]
                if part is not None:
                    parts.append(part)
        silent = {*waiting, *ended}
        late = [index for index, worker in enumerate(self.workers) if worker.answers in silent]
        return parts, late


def _fork_worker(earlier: Sequence[_Worker]) -> _Worker:
    requests_read, requests_write = os.pipe()
    answers_read, answers_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never returns
        try:
            os.close(requests_write)
            os.close(answers_read)
            for worker in earlier:
                os.close(worker.requests)
                os.close(worker.answers)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills us
            _serve(requests_read, answers_write)
        finally:
            os._exit(0)
    os.close(requests_read)
    os.close(answers_write)
    return _Worker(pid, requests_write, answers_read, bytearray())


def _serve(requests: int, answers: int) -> None:
    """The worker's loop: one scan per request, until the parent closes its end."""
    buffer = bytearray()
    while True:
        data = _read_message(requests, buffer)
        if data is None:
            return
        request: _Request = pickle.loads(data)  # noqa: S301 - from our own parent, by pipe
        names = [
            name
            for name in os.listdir(request.proc_root)
            if name.isdigit() and int(name) % request.count == request.index
        ]
        part = scan_device_users(
            request.proc_root,
            request.device_prefix,
            request.socket_inodes,
            request.shm_areas,
            Deadline(request.deadline_at),
            pids=[int(name) for name in names],
        )
        started = {pid: _start_time(request.proc_root, pid) for pid in {*part.users, *part.shm}}
        _send(answers, pickle.dumps((part, started)))


def _read_message(fd: int, buffer: bytearray) -> bytes | None:
    while True:
        if len(buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer)
            if len(buffer) >= _LENGTH.size + length:
                data = bytes(buffer[_LENGTH.size : _LENGTH.size + length])
                del buffer[: _LENGTH.size + length]
                return data
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buffer += chunk


def _receive(worker: _Worker) -> _Part | None:
    """Reads what is there; the part once it is whole (None: not yet)."""
    chunk = os.read(worker.answers, 1 << 20)
    if not chunk:
        raise EOFError(worker.pid)  # it died: its share is cut short
    worker.buffer += chunk
    if len(worker.buffer) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(worker.buffer)
    if len(worker.buffer) < _LENGTH.size + length:
        return None
    data = bytes(worker.buffer[_LENGTH.size : _LENGTH.size + length])
    worker.buffer.clear()
    part: _Part = pickle.loads(data)  # noqa: S301 - from our own child, by pipe
    return part


def _send(fd: int, data: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _late_shares(proc_root: Path, late: Sequence[int], count: int) -> DeviceScan:
    """The shares of workers that did not answer: every PID in them is cut short."""
    pids = sorted(
        int(name) for name in os.listdir(proc_root) if name.isdigit() and int(name) % count in late
    )
    return DeviceScan({}, [], cut_short=pids)


def _start_time(proc_root: Path, pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (None: gone)."""
    try:
        text = (proc_root / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else None


def _pinned(proc_root: Path, parts: Sequence[_Part], own: Collection[int]) -> DeviceScan:
    """The parts merged, without the workers themselves, and without a process whose PID
    another took after its worker read it (its start time now differs from the one then)."""
    scan = DeviceScan({}, [])
    for part, started in parts:
        scan.users.update(part.users)
        scan.unreadable.extend(part.unreadable)
        scan.shm.update(part.shm)
        scan.cut_short.extend(part.cut_short)
        for pid in started:
            if pid in own or started[pid] != _start_time(proc_root, pid):
                scan.users.pop(pid, None)
                scan.shm.pop(pid, None)
    scan.unreadable.sort()
    scan.cut_short.sort()
    return scan
