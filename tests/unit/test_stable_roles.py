"""Roles are stable within a run (issue 18, item 4): a process spared as a watcher, a protected
one, or another unit's, is not judged again into a target while the driver is still freeing a
killed holder's memory (memory used that NVML lists for nobody); one that starts using a GPU
(NVML lists it) is judged again. Each decision names its rule in GPUGATE_REASON."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from gpugate.core.outcome import RunSummary
from gpugate.errors import ExitCode
from gpugate.host.nvml import Gpu, GpuUsage
from tests.fakes import FakeGpuMemory, FakeHost, alive

LAG_S = 1.5  # the driver frees a killed holder's memory this late (real drivers: seconds)


def run(host: FakeHost, memory: FakeGpuMemory | None = None, **config: object) -> RunSummary:
    driver = memory or host.memory
    return host.run_phase(
        "pre", host.config(**config), host.reporter("pre"), driver_factory=lambda: driver
    )


def stale_server(host: FakeHost) -> list[int]:
    """A server left on GPUs 0-3 by hand: a parent and two workers that NVML lists."""
    server, *workers = host.pool.holder(host.gpu_files(0, 1, 2, 3), children=2)
    for pid in workers:
        host.memory.claim(pid, {0, 1, 2, 3}, 20000)
    host.memory.release_lag_s = LAG_S
    return [server, *workers]


def spared_reasons(host: FakeHost, pid: int) -> set[str]:
    return {
        e["GPUGATE_REASON"]
        for e in host.journal.events("process_spared")
        if e["GPUGATE_PID"] == str(pid)
    }


@pytest.mark.parametrize("gpus", [[0, 1, 2, 3], "all"])
def test_watcher_stays_a_watcher_while_the_driver_frees_late(host: FakeHost, gpus: object) -> None:
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))  # nvidia-smi -l, nvtop
    stale = stale_server(host)
    summary = run(host, gpus=gpus)
    assert summary.exit_code is ExitCode.OK
    assert alive(watcher)
    assert not any(alive(pid) for pid in stale)
    assert summary.rounds >= 1 and summary.seconds_wait > 0  # the wait saw the late release
    assert watcher not in {int(e["GPUGATE_PID"]) for e in host.journal.events("signal_sent")}
    assert spared_reasons(host, watcher) == {"watcher"}
    found = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert found[str(stale[1])] == "orphan"


def test_another_units_watcher_is_not_refused_while_memory_is_freed(host: FakeHost) -> None:
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))  # an exporter in its own unit
    host.put_in_unit(watcher, cgroup="/system.slice/gpu-exporter.service")
    stale = stale_server(host)
    summary = run(host, gpus=[0, 1, 2, 3])
    assert summary.exit_code is ExitCode.OK
    assert alive(watcher) and not any(alive(pid) for pid in stale)
    assert not host.journal.events("refused")


def test_protected_process_is_spared_in_every_round(host: FakeHost) -> None:
    # nvidia-persistenced: every device file open, protected by its executable's path
    sleep = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    opened = " ".join(f"{3 + i}<{path}" for i, path in enumerate(host.gpu_files(*range(8))))
    daemon = host.pool.command(["/bin/bash", "-c", f"exec {opened} {sleep} 3600"]).pid
    deadline = time.monotonic() + 15
    while os.path.realpath(f"/proc/{daemon}/exe") != sleep:  # exec'd, its files open
        assert time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.02)
    stale = stale_server(host)
    summary = run(host, gpus="all", protected_executables=[sleep])
    assert summary.exit_code is ExitCode.OK
    assert alive(daemon) and not any(alive(pid) for pid in stale)
    assert spared_reasons(host, daemon) == {"protected"}


class WatcherStartsComputing(FakeGpuMemory):
    """Once the stale server's workers are gone, the watcher creates a context on GPU 0:
    NVML lists it with memory from then on."""

    def __init__(self, stale: list[int], watcher: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.stale, self.watcher, self.started = stale, watcher, False

    def usage(self, gpu: Gpu) -> GpuUsage:
        if not self.started and not any(alive(pid) for pid in self.stale):
            self.started = True
            self.claim(self.watcher, {0}, 8000)
        return super().usage(gpu)


def test_watcher_that_starts_using_a_gpu_is_judged_again(host: FakeHost) -> None:
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))
    stale = stale_server(host)
    memory = WatcherStartsComputing(stale, watcher, release_lag_s=LAG_S)
    memory.claims = dict(host.memory.claims)
    summary = run(host, memory, gpus="all")
    assert summary.exit_code is ExitCode.OK
    assert not alive(watcher), "NVML lists it on GPU 0: a GPU user, killed as an orphan"
    assert spared_reasons(host, watcher) == {"watcher"}  # the first round spared it
    judged = [e for e in host.journal.events("holder_found") if e["GPUGATE_PID"] == str(watcher)]
    assert [e["GPUGATE_REASON"] for e in judged] == ["orphan"]


@pytest.mark.parametrize("leak_on", [4, 6, 7])
def test_a_leak_on_a_gpu_the_unit_does_not_own_leaves_watchers_watchers(
    host: FakeHost, leak_on: int
) -> None:
    """A driver leak (memory NVML lists for no process) elsewhere says nothing of the unit's
    GPUs: nvtop on every GPU is spared, not an orphan straddling them (exit 22)."""
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))
    stale = stale_server(host)
    host.memory.leaked_mib[leak_on] = 30000
    summary = run(host, gpus=[0, 1, 2, 3])
    assert summary.exit_code is ExitCode.OK
    assert alive(watcher) and not any(alive(pid) for pid in stale)
    assert spared_reasons(host, watcher) == {"watcher"}


def test_memory_listed_for_nobody_on_the_units_gpu_still_makes_a_device_holder_an_orphan(
    host: FakeHost,
) -> None:
    """The fork that kept a dead parent's context: device files only, memory on the unit's
    GPU listed for nobody: killed, as before."""
    (fork,) = host.pool.holder(host.gpu_files(0))
    host.memory.leaked_mib[0] = 8000
    summary = run(host, gpus=[0], pre={"wait_timeout_s": 2.0})
    assert not alive(fork)
    found = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert found[str(fork)] == "orphan"
    assert summary.exit_code is not ExitCode.HELD_BY_OTHERS
