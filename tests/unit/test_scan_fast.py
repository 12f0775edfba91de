"""The scan's fast paths against the full scan, on random process tables (tests.fakes'
stand-in /proc): restricted to some PIDs, and `status --watch`'s rescans
(new PIDs, known holders, NVML's PIDs; a full scan now and then). Each must find exactly what
the full scan of the same table finds, mapped-only holders, leaderless thread groups and
watchers (an fd, no NVML listing) included. The real-process cases are tests/unit/test_scan.py.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpugate.host.scan import DeviceScan, WatchScan, scan_device_users
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
@given(table=tables(HOST_FOR_STRATEGIES), data=st.data())
def test_a_scan_of_some_pids_is_the_full_scan_of_those(
    table: list[FakeProcess], data: st.DataObject
) -> None:
    host = HOST_FOR_STRATEGIES
    fake_proc(host.proc, table)
    some = data.draw(st.sets(st.sampled_from([p.pid for p in table] + [999_999])))
    full = host.scan()
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
    watch = WatchScan()
    watch.clock = lambda: 0.0
    first = watch(host.proc, host.prefix, SOCKETS, [host.area])
    assert first == host.scan()
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
    assert again == host.scan()


def test_a_holder_the_rescans_trust_away_is_found_by_the_next_full_scan(host: Host) -> None:
    """A process that held nothing and starts holding a device without NVML listing it (a
    watcher starting to poll) is found by the full scan every FULL_SCAN_EVERY_S."""
    now = [0.0]
    watch = WatchScan()
    watch.full_every_s, watch.clock = 15, lambda: now[0]
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
    watch = WatchScan()
    watch.clock = lambda: 0.0
    fake_proc(host.proc, [FakeProcess(300, fds=("socket:[1002]",))])
    assert not watch(host.proc, host.prefix, {1001}).users
    assert set(watch(host.proc, host.prefix, {1001, 1002}).users) == {300}
    assert watch.full_scans == 2
