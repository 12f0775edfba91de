"""The scan's fast paths against the full scan, on random process tables (tests.fakes'
stand-in /proc): spread over threads, restricted to some PIDs, and `status --watch`'s rescans
(new PIDs, known holders, NVML's PIDs; a full scan now and then). Each must find exactly what
the full scan of the same table finds, mapped-only holders, leaderless thread groups and
watchers (an fd, no NVML listing) included. The real-process cases are tests/core/test_scan.py.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpugate.host import scan
from gpugate.host.scan import DeviceScan, scan_device_users
from gpugate.host.scan_watch import WatchScan
from gpugate.host.shm import ShmArea
from tests.fakes import FakeProcess, fake_proc

SOCKETS = frozenset({1001, 1002})


class Host:
    """A stand-in /dev (device files), an shm folder with real files, and a /proc to fill."""

    def __init__(self, top: Path) -> None:
        self.dev = top / "dev"
        self.dev.mkdir()
        for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
            (self.dev / name).write_bytes(b"")
        shm = top / "shm"
        shm.mkdir()
        for name in ("psm_a", "sem.mp-b"):
            (shm / name).write_bytes(b"\0" * 64)
        self.area = ShmArea(str(shm), shm.stat().st_dev)
        self.shm_files = [shm / "psm_a", shm / "sem.mp-b"]
        self.proc = top / "proc"
        self.prefix = str(self.dev / "nvidia")

    def fd_targets(self) -> list[str]:
        devices = [str(self.dev / name) for name in ("nvidia0", "nvidia2", "nvidiactl")]
        others = ["/usr/lib/x.so", "socket:[1001]", "socket:[77]", "pipe:[9]", "/dev/null"]
        return devices + others + [str(path) for path in self.shm_files]

    def map_entries(self) -> list[tuple[str, int, int]]:
        entries = []
        for path in [self.dev / "nvidia1", self.dev / "nvidia-uvm", *self.shm_files]:
            info = path.stat()
            entries.append((str(path), info.st_dev, info.st_ino))
        entries.append(("/usr/lib/libc.so.6", 0x801, 4242))
        return entries

    def scan(self, **kwargs: object) -> DeviceScan:
        return scan_device_users(self.proc, self.prefix, SOCKETS, [self.area], **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    with tempfile.TemporaryDirectory() as top:
        yield Host(Path(top))


def processes(host: Host, pids: st.SearchStrategy[int]) -> st.SearchStrategy[FakeProcess]:
    return st.builds(
        FakeProcess,
        pid=pids,
        fds=st.lists(st.sampled_from(host.fd_targets()), max_size=4).map(tuple),
        maps=st.lists(st.sampled_from(host.map_entries()), max_size=3).map(tuple),
        shape=st.sampled_from(["process", "process", "process", "kernel", "leaderless"]),
    )


def tables(host: Host, low: int = 100, high: int = 400) -> st.SearchStrategy[list[FakeProcess]]:
    # Even PIDs: a leaderless group's live thread is PID + 1.
    pids = st.integers(low // 2, high // 2).map(lambda n: n * 2)
    return st.lists(processes(host, pids), max_size=25, unique_by=lambda p: p.pid)


_TOP = tempfile.mkdtemp(prefix="gpugate-scan-fast-")
atexit.register(shutil.rmtree, _TOP, ignore_errors=True)
HOST_FOR_STRATEGIES = Host(Path(_TOP))  # hypothesis's examples share one (the fixture can't)
FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FAST
@given(table=tables(HOST_FOR_STRATEGIES), threads=st.integers(2, 5))
def test_threads_find_what_one_thread_finds(table: list[FakeProcess], threads: int) -> None:
    host = HOST_FOR_STRATEGIES
    fake_proc(host.proc, table)
    assert host.scan(threads=threads) == host.scan(threads=1)


@FAST
@given(table=tables(HOST_FOR_STRATEGIES), data=st.data())
def test_a_scan_of_some_pids_is_the_full_scan_of_those(
    table: list[FakeProcess], data: st.DataObject
) -> None:
    host = HOST_FOR_STRATEGIES
    fake_proc(host.proc, table)
    some = data.draw(st.sets(st.sampled_from([p.pid for p in table] + [999_999])))
    full = host.scan(threads=1)
    part = host.scan(pids=sorted(some))
    assert part.users == {pid: use for pid, use in full.users.items() if pid in some}
    assert part.shm == {pid: files for pid, files in full.shm.items() if pid in some}


@FAST
@given(before=tables(HOST_FOR_STRATEGIES), data=st.data())
def test_the_watch_rescan_finds_what_a_full_scan_finds(
    before: list[FakeProcess], data: st.DataObject
) -> None:
    """Between two looks: processes exit, new ones start (new PIDs), the known holders change
    in any way, NVML lists any PIDs (which may have changed in any way too); the rest stays."""
    host = HOST_FOR_STRATEGIES
    fake_proc(host.proc, before)
    watch = WatchScan(clock=lambda: 0.0)
    first = watch(host.proc, host.prefix, SOCKETS, [host.area])
    assert first == host.scan(threads=1)
    known = set(first.users) | set(first.shm)
    gone = data.draw(st.sets(st.sampled_from([p.pid for p in before] or [0])))
    nvml = data.draw(st.sets(st.integers(50, 250).map(lambda n: n * 2)))
    after = {p.pid: p for p in before if p.pid not in gone}
    for pid in list(after):
        if pid in known or pid in nvml:
            after[pid] = data.draw(processes(host, st.just(pid)))
    taken = set(after) | {p.pid for p in before}
    for new in data.draw(tables(host, 500, 800)):
        if new.pid not in taken:
            after[new.pid] = new
    fake_proc(host.proc, list(after.values()))
    again = watch(host.proc, host.prefix, SOCKETS, [host.area], sorted(nvml))
    assert watch.rescans == 1
    assert again == host.scan(threads=1)


def test_a_holder_the_rescans_trust_away_is_found_by_the_next_full_scan(host: Host) -> None:
    """A process that held nothing and starts holding a device without NVML listing it (a
    watcher starting to poll) is found by the full scan every FULL_SCAN_EVERY_S."""
    now = [0.0]
    watch = WatchScan(full_every_s=15, clock=lambda: now[0])
    fake_proc(host.proc, [FakeProcess(200), FakeProcess(202, fds=(str(host.dev / "nvidia0"),))])
    assert set(watch(host.proc, host.prefix).users) == {202}
    fake_proc(
        host.proc,
        [
            FakeProcess(200, fds=(str(host.dev / "nvidia2"),)),  # the trusted one now holds
            FakeProcess(202, fds=(str(host.dev / "nvidia0"),)),
        ],
    )
    now[0] = 5.0
    assert set(watch(host.proc, host.prefix).users) == {202}
    now[0] = 15.0
    assert set(watch(host.proc, host.prefix).users) == {200, 202}
    assert watch.full_scans == 2


def test_a_new_socket_asked_for_makes_a_full_look(host: Host) -> None:
    watch = WatchScan(clock=lambda: 0.0)
    fake_proc(host.proc, [FakeProcess(300, fds=("socket:[1002]",))])
    assert not watch(host.proc, host.prefix, {1001}).users
    assert set(watch(host.proc, host.prefix, {1001, 1002}).users) == {300}
    assert watch.full_scans == 2


def test_the_scan_runs_on_one_thread_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads measured slower on idle cores (docs/benchmarks.md): however many processes and
    cores, gpugate's own scans start none; bench/scan_threads.py asks for them."""
    called: list[int] = []
    monkeypatch.setattr(scan, "_on_threads", lambda root, parts, wanted: called.append(len(parts)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(256)))
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()] * 50
    scan_device_users(Path("/proc"), "/dev/nvidia", pids=pids)
    assert called == []
    scan_device_users(Path("/proc"), "/dev/nvidia", pids=pids, threads=3)
    assert called == [3]


def test_the_real_proc_gives_the_same_answer_on_threads() -> None:
    """On this host's own /proc (processes come and go meanwhile: the PIDs both saw)."""
    pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    one = scan_device_users(Path("/proc"), "/dev/nvidia", pids=pids, threads=1)
    four = scan_device_users(Path("/proc"), "/dev/nvidia", pids=pids, threads=4)
    both = set(one.users) & set(four.users)
    assert {pid: one.users[pid] for pid in both} == {pid: four.users[pid] for pid in both}


def test_an_exception_in_the_caller_does_not_wait_for_the_threads(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's Interrupted (here a part that fails) ends the threaded scan at once: the other
    threads are told to stop, not waited for (a hook that is sent SIGTERM ends at once)."""
    import threading

    from gpugate.host import scan as scan_module

    release, started, finished = threading.Event(), threading.Event(), threading.Event()
    told_to_stop: list[bool] = []

    def part(proc_fd: int, names: list[str], wanted: object, stop: list[bool]) -> DeviceScan:
        if names and names[0] == "100":
            raise RuntimeError("interrupted")
        started.set()
        release.wait(30)  # bounded: a caller that waited would see it finished
        told_to_stop.append(bool(stop))
        finished.set()
        return DeviceScan({}, [])

    monkeypatch.setattr(scan_module, "_scan_part", part)
    fake_proc(host.proc, [FakeProcess(100), FakeProcess(101)])
    with pytest.raises(RuntimeError, match="interrupted"):
        scan_device_users(host.proc, host.prefix, pids=[100, 101], threads=2)
    assert not finished.is_set()
    release.set()
    # The other part either never started (cancelled with the pool) or was told to stop.
    if started.is_set():
        assert finished.wait(30)
        assert told_to_stop == [True]
