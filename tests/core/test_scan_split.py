"""The scan over worker processes against the one pass, on random process tables (the stand-in
/proc of tests.fakes: mapped-only holders, leaderless thread groups, kernel threads, watchers),
and the workers' lives: forked before any other thread, bounded by the deadline, killed with
the block. Real processes: tests/core/test_scan.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpugate.host.scan import Deadline, DeviceScan, DeviceUse, scan_device_users
from gpugate.host.scan_split import SplitScan, SplitScanError, _pinned
from tests.core.test_scan_fast import FAST, HOST_FOR_STRATEGIES, SOCKETS, tables
from tests.fakes import FakeProcess, fake_proc


@pytest.fixture(scope="module")
def split() -> Iterator[SplitScan]:
    with SplitScan(3) as scan:
        yield scan


def _split_scan(split: SplitScan, deadline: Deadline) -> DeviceScan:
    host = HOST_FOR_STRATEGIES
    return split(host.proc, host.prefix, SOCKETS, [host.area], (), deadline)


def _sorted(scan: DeviceScan) -> DeviceScan:
    """The PID lists in order (the one pass lists them in /proc's order, the split by PID)."""
    return replace(scan, unreadable=sorted(scan.unreadable), cut_short=sorted(scan.cut_short))


@FAST
@given(table=tables(HOST_FOR_STRATEGIES), passed=st.booleans())
def test_the_workers_find_what_one_pass_finds(
    split: SplitScan, table: list[FakeProcess], passed: bool
) -> None:
    host = HOST_FOR_STRATEGIES
    fake_proc(host.proc, table)
    deadline = Deadline(time.monotonic() - 1) if passed else Deadline()
    one_pass = scan_device_users(host.proc, host.prefix, SOCKETS, [host.area], deadline)
    assert _split_scan(split, deadline) == _sorted(one_pass)
    assert not split.broken


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_leaving_the_block_kills_and_reaps_every_worker() -> None:
    with pytest.raises(KeyboardInterrupt), SplitScan(2) as scan:
        pids = [worker.pid for worker in scan.workers]
        assert all(_alive(pid) for pid in pids)
        raise KeyboardInterrupt  # as SIGTERM's Interrupted ends a hook
    assert not any(_alive(pid) for pid in pids)
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_worker_silent_past_the_deadline_is_killed_and_its_share_cut_short() -> None:
    host = HOST_FOR_STRATEGIES
    table = [FakeProcess(pid, fds=(host.fd_targets()[0],)) for pid in (100, 101, 102, 103)]
    fake_proc(host.proc, table)
    with SplitScan(2, grace_s=0.0) as scan:
        stopped = scan.workers[1].pid
        os.kill(stopped, signal.SIGSTOP)  # our own child: it cannot answer
        found = scan(host.proc, host.prefix, SOCKETS, [host.area], (), Deadline(time.monotonic()))
        assert not _alive(stopped)
        assert scan.broken
        assert set(found.cut_short) >= {101, 103}  # the stopped worker's share (odd PIDs)
        # From then on the run scans in one pass.
        again = scan(host.proc, host.prefix, SOCKETS, [host.area], (), Deadline())
        assert _sorted(again) == _sorted(
            scan_device_users(host.proc, host.prefix, SOCKETS, [host.area])
        )


def test_no_workers_once_another_thread_runs() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        with pytest.raises(SplitScanError), SplitScan(2):
            pass
    finally:
        release.set()
        thread.join()


def test_a_split_needs_two_workers() -> None:
    with pytest.raises(ValueError):
        SplitScan(1)


def test_a_worker_that_died_leaves_its_share_cut_short() -> None:
    host = HOST_FOR_STRATEGIES
    table = [FakeProcess(pid, fds=(host.fd_targets()[0],)) for pid in (100, 101, 102, 103)]
    fake_proc(host.proc, table)
    with SplitScan(2) as scan:
        dead = scan.workers[0].pid
        os.kill(dead, signal.SIGKILL)  # our own child, as the OOM killer might
        os.waitid(os.P_PID, dead, os.WEXITED | os.WNOWAIT)  # dead, not reaped: the scan's
        found = scan(host.proc, host.prefix, SOCKETS, [host.area], (), Deadline())
        assert scan.broken and not scan.workers
        assert set(found.cut_short) >= {100, 102}  # its share (even PIDs)
        assert {101, 103} <= set(found.users)  # the other worker's holders


def test_a_holder_is_pinned_by_its_start_time(tmp_path: Path) -> None:
    """A PID another process took after its worker read it is no holder; nor is a worker."""
    use = DeviceUse(frozenset({"/dev/nvidia0"}), frozenset())
    for pid, start in ((10, 500), (11, 777), (12, 300)):
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1"] + ["0"] * 17 + [str(start)]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a) b) {' '.join(fields)}\n")
    part = DeviceScan({10: use, 11: use, 12: use}, [])
    read_then = {10: 500, 11: 600, 12: 300}  # 11 was another process when its worker read it
    found = _pinned(tmp_path, [(part, read_then)], own={12})
    assert set(found.users) == {10}
