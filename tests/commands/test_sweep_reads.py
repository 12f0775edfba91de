"""What `gpugate sweep` reads: with NVML's lists accounting for every GPU's memory, only the
listed processes' fds (their owners and the gauges as a full scan gives them); where memory is
listed for nobody (a late free, a leak, a fork keeping a dead parent's context), where NVML
cannot list a GPU's processes or names a PID this /proc does not show, every process's fds."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpugate.core.discover import Discovery, Source, memory_accounted
from gpugate.core.roles import HolderOwner, Owner, owner_of
from gpugate.errors import ExitCode, GpuError
from gpugate.front.commands.sweep import discover_host, gauges, sweep
from gpugate.front.hook import HostAccess, collect
from gpugate.host import scan
from gpugate.host.nvml import Gpu, GpuFault, GpuProcess, GpuUsage, mig_key
from gpugate.integrations.config_files import load_config
from gpugate.report.journal import Reporter
from tests.fakes import FakeGpuMemory, FakeHost

NOWHERE_PID = 4194305  # above the kernel's largest pid_max: a PID of another namespace


def config_file(host: FakeHost) -> Path:
    path = host.root / "sweep.toml"
    path.write_text(
        f'lock_dir = "{host.root / "locks"}"\n'
        f'metrics_textfile = "{host.root / "metrics" / "gpugate.prom"}"\nfree_mib = 500\n'
    )
    return path


def front(host: FakeHost, driver: Callable[[], FakeGpuMemory] | None = None) -> HostAccess:
    return HostAccess(
        driver_factory=driver or (lambda: host.memory),
        reporter_factory=lambda unit, phase, **_: Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False
        ),
        roots=host.roots,
        unit_state=lambda unit: "inactive",
    )


@pytest.fixture
def fds_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The PIDs whose /proc/PID/fd the device-file scan opens, in order."""
    read: list[int] = []
    real = scan._fd_paths

    def recording(proc_fd: int, pid_name: str, *wanted: Any) -> object:
        read.append(int(pid_name.split("/", maxsplit=1)[0]))
        return real(proc_fd, pid_name, *wanted)

    monkeypatch.setattr(scan, "_fd_paths", recording)
    yield read


@dataclass
class Scene:
    server: int  # NVML lists it on GPU 2 with 4000 MiB
    watcher: int  # holds GPU 0's and 1's device files only
    idle: int  # holds GPU 3's device file and no memory (a fork's child, a monitor)


def scene(host: FakeHost) -> Scene:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    (watcher,) = host.pool.holder(host.gpu_files(0, 1))
    (idle,) = host.pool.holder(host.gpu_files(3))
    return Scene(server, watcher, idle)


def holdings(discovery: Discovery, host: FakeHost) -> list[HolderOwner]:
    config = load_config(None, config_file(host)).config
    return [
        HolderOwner(holder, owner_of(holder, discovery, config))
        for holder in sorted(discovery.holders.values(), key=lambda h: h.pid)
        if holder.gpus or holder.used_mib
    ]


def test_with_the_memory_accounted_for_only_the_listed_processes_fds_are_read(
    host: FakeHost, fds_read: list[int]
) -> None:
    found = scene(host)
    loaded = load_config(None, config_file(host))
    cheap = discover_host(loaded, front(host))
    assert set(fds_read) == {found.server}
    assert found.watcher not in cheap.holders and found.idle not in cheap.holders

    fds_read.clear()
    full = collect(None, loaded, host.memory, host.roots)
    assert {found.server, found.watcher, found.idle} <= set(fds_read)
    # The listed holder is the same holder, with the same owner, and the gauges are the same:
    # the unseen hold device files only, each a watcher in the full scan.
    assert cheap.holders[found.server] == full.holders[found.server]
    cheap_owned, full_owned = holdings(cheap, host), holdings(full, host)
    assert [h for h in full_owned if h.holder.pid not in cheap.holders] == [
        h for h in full_owned if h.owner is Owner.WATCHER
    ]
    assert cheap_owned == [h for h in full_owned if h.holder.pid in cheap.holders]
    assert [h.owner for h in cheap_owned] == [Owner.NOBODY]
    assert gauges(cheap, cheap_owned, {}, 1000.0) == gauges(full, full_owned, {}, 1000.0)


def test_the_sweep_reports_the_listed_holder_and_reads_no_other_fds(
    host: FakeHost, fds_read: list[int]
) -> None:
    found = scene(host)
    assert sweep(config_file(host), front(host), clock=lambda: 1000.0) == ExitCode.OK
    assert [e["GPUGATE_PID"] for e in host.journal.events("unowned_seen")] == [str(found.server)]
    assert set(fds_read) == {found.server}
    prom = (host.root / "metrics" / "gpugate.prom").read_text()
    assert 'gpugate_gpu_memory_mib{gpu="2",owner="nobody",uuid=' in prom
    assert 'gpugate_unowned_processes{gpu="2"} 1' in prom
    assert 'gpugate_unowned_processes{gpu="0"} 0' in prom


def leak(host: FakeHost, found: Scene) -> None:
    host.memory.leaked_mib[4] = 30000  # a driver leak: memory with no process


def late_free(host: FakeHost, found: Scene) -> None:
    (killed,) = host.pool.holder(host.gpu_files(5))
    host.memory.claim(killed, {5}, 8000)
    host.memory.release_lag_s = 3600.0  # the driver has not freed a killed holder's memory
    stop(host, killed)


def fork_kept_context(host: FakeHost, found: Scene) -> None:
    # A CUDA process forked; the child kept the context, its parent exited: NVML lists the
    # dead parent's memory for nobody while the child holds the device file.
    parent, child = host.pool.holder(host.gpu_files(6), children=1)
    host.memory.claim(parent, {6}, 6000)
    host.memory.release_lag_s = 3600.0
    stop(host, parent)
    assert child


def per_process_memory_unknown(host: FakeHost, found: Scene) -> None:
    host.memory.listed_without_memory[2] = [found.server]


def stop(host: FakeHost, pid: int) -> None:
    """Ends a process this test started (and reaps it)."""
    os.kill(pid, signal.SIGKILL)
    for popen in host.pool.popens:
        if popen.pid == pid:
            popen.wait(timeout=10)


@pytest.mark.parametrize(
    "unaccounted", [leak, late_free, fork_kept_context, per_process_memory_unknown]
)
def test_with_memory_listed_for_nobody_every_process_fds_are_read(
    host: FakeHost, fds_read: list[int], unaccounted: Callable[[FakeHost, Scene], None]
) -> None:
    found = scene(host)
    unaccounted(host, found)
    discovery = discover_host(load_config(None, config_file(host)), front(host))
    assert {found.server, found.watcher, found.idle} <= set(fds_read)
    assert {found.watcher, found.idle} <= set(discovery.holders)
    assert discovery.holders[found.watcher].gpus == {0, 1}
    assert Source.DEVICE_FD in discovery.holders[found.idle].sources


@pytest.mark.parametrize("leaked", [False, True])
def test_mig_slices_memory_accounted_for_as_each_slice_lists_it(
    host: FakeHost, fds_read: list[int], leaked: bool
) -> None:
    host.memory.mig = {0: [(1, 0, 20000), (2, 0, 20000)]}
    (on_second,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(on_second, {mig_key(0, 1)}, 7000)
    (watcher,) = host.pool.holder(host.gpu_files(0))
    if leaked:
        host.memory.leaked_mib[mig_key(0, 0)] = 9000  # a slice's memory listed for nobody
    loaded = load_config(None, config_file(host))
    fds_read.clear()
    cheap = discover_host(loaded, front(host))
    assert (set(fds_read) == {on_second}) is not leaked
    full = collect(None, loaded, host.memory, host.roots)
    assert (watcher in cheap.holders) is leaked and watcher in full.holders
    assert cheap.holders[on_second] == full.holders[on_second]
    assert cheap.holders[on_second].using == {mig_key(0, 1)}
    assert gauges(cheap, holdings(cheap, host), {}, 1.0) == gauges(
        full, holdings(full, host), {}, 1.0
    )


def test_memory_within_free_mib_is_accounted_for(host: FakeHost, fds_read: list[int]) -> None:
    found = scene(host)
    host.memory.leaked_mib[4] = 500  # free_mib: what a start would leave anyway
    discovery = discover_host(load_config(None, config_file(host)), front(host))
    assert set(fds_read) == {found.server} and found.watcher not in discovery.holders


@dataclass
class Unlisting(FakeGpuMemory):
    """A driver that cannot list GPU 1's processes (NotSupported), or lists a PID of another
    PID namespace on GPU 1, or cannot read GPU 7 at all."""

    how: str = "not-listed"

    def usage(self, gpu: Gpu) -> GpuUsage:
        found = super().usage(gpu)
        if gpu.index != 1:
            return found
        if self.how == "not-listed":
            return GpuUsage(gpu, found.used_mib, (), processes_listed=False)
        return GpuUsage(gpu, found.used_mib + 100, (GpuProcess(NOWHERE_PID, 100),))


@pytest.mark.parametrize("how", ["not-listed", "invisible", "lost", "failing"])
def test_where_nvml_cannot_list_or_read_a_gpu_every_process_fds_are_read(
    host: FakeHost, fds_read: list[int], how: str
) -> None:
    found = scene(host)
    driver = Unlisting(claims=host.memory.claims, how=how)
    if how == "lost":
        driver.lost = {7}
    if how == "failing":
        driver.failing_usage = {7}
    discovery = discover_host(load_config(None, config_file(host)), front(host, lambda: driver))
    assert {found.server, found.watcher, found.idle} <= set(fds_read)
    assert {found.watcher, found.idle} <= set(discovery.holders)
    if how == "invisible":
        assert discovery.invisible == [(1, NOWHERE_PID)]


def test_status_reads_every_process_fds_whatever_nvml_accounts_for(
    host: FakeHost, fds_read: list[int]
) -> None:
    found = scene(host)
    discovery = collect(None, load_config(None, config_file(host)), host.memory, host.roots)
    assert {found.server, found.watcher, found.idle} <= set(fds_read)
    assert found.watcher in discovery.holders


def usage_of(used: int, *mibs: int | None, listed: bool = True) -> GpuUsage:
    gpu = Gpu(0, "GPU-0", 0, "g", 1000)
    processes = tuple(GpuProcess(100 + i, mib) for i, mib in enumerate(mibs))
    return GpuUsage(gpu, used, processes, processes_listed=listed)


@pytest.mark.parametrize(
    ("usage", "faults", "accounted"),
    [
        ({0: usage_of(0)}, [], True),
        ({0: usage_of(4000, 4000)}, [], True),
        ({0: usage_of(4600, 4000)}, [], True),  # within free_mib
        ({0: usage_of(4601, 4000)}, [], False),
        ({0: usage_of(30000)}, [], False),  # a leak
        ({0: usage_of(4000, 4000, None)}, [], False),  # memory of a process not said
        ({0: usage_of(0, listed=False)}, [], False),
        ({}, [], False),  # no GPU NVML reads: nothing to account for the device files by
        ({0: usage_of(0)}, [GpuFault(1, GpuError(1, "NVML: GPU 1 is lost"))], False),
    ],
)
def test_memory_accounted(
    usage: dict[int, GpuUsage], faults: list[GpuFault], accounted: bool
) -> None:
    assert memory_accounted(usage, faults, 600) is accounted
