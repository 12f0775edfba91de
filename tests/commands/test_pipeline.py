"""The pre and post runs end to end, with real processes holding stand-in device files, a
stand-in cgroup tree and a fake GPU memory that is freed only when its holders exit."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from gpugate.core.kill import Pinned
from gpugate.errors import ExitCode, NvmlUnavailable
from gpugate.host.nvml import Gpu, GpuUsage
from gpugate.host.scan import ProcessId, ProcFs
from tests.fakes import FakeGpuMemory, FakeHost, alive


def run(host: FakeHost, phase: str = "pre", **config: object):  # type: ignore[no-untyped-def]
    return host.run_phase(
        phase,
        host.config(**config),
        host.reporter(phase),
        driver_factory=lambda: host.memory,
    )


def test_parent_killed_first_workers_are_reaped(host: FakeHost) -> None:
    server, *workers = host.pool.holder(host.gpu_files(0, 1), children=2)
    for pid in workers:
        host.memory.claim(pid, {0, 1}, 40000)
    os.kill(server, signal.SIGKILL)  # as `pkill -9 -f vllm` does: the workers live on
    host.pool.popens[0].wait()
    assert all(alive(pid) for pid in workers)

    summary = run(host, "pre")

    assert summary.exit_code is ExitCode.OK
    assert not any(alive(pid) for pid in workers)
    assert {ident.pid for ident in summary.killed} == set(workers)
    assert host.memory.usage(host.memory.gpus()[0]).used_mib == 0


def test_worker_ignoring_sigterm_is_killed_after_grace(host: FakeHost) -> None:
    (worker,) = host.pool.holder(host.gpu_files(2), ignore_term=True)
    host.put_in_unit(worker)
    host.memory.claim(worker, {2}, 1000)

    summary = run(host, "post", post={"sigterm_grace_s": 0.5})

    assert summary.exit_code is ExitCode.OK
    assert not alive(worker)
    sent = host.journal.events("signal_sent")
    assert [e["GPUGATE_SIGNAL"] for e in sent] == ["SIGTERM", "SIGKILL"]
    assert {e["GPUGATE_PID"] for e in sent} == {str(worker)}
    assert [ident.pid for ident in summary.killed] == [worker]


def test_orphan_outside_cgroup_killed_by_pre_not_by_post(host: FakeHost) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(3))
    host.memory.claim(orphan, {3}, 5000)

    post = run(host, "post")
    assert post.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(orphan)
    refused = host.journal.events("refused")
    assert refused and refused[0]["GPUGATE_PID"] == str(orphan)

    pre = run(host, "pre")
    assert pre.exit_code is ExitCode.OK
    assert not alive(orphan)


def test_bystander_on_other_gpu_and_protected_daemon_survive(host: FakeHost) -> None:
    (mine,) = host.pool.holder(host.gpu_files(0))
    (bystander,) = host.pool.holder(host.gpu_files(5))
    host.memory.claim(mine, {0}, 9000)
    host.memory.claim(bystander, {5}, 9000)
    # A daemon that holds every device file and is protected by its executable's path.
    daemon_exe = host.root / "nvidia-persistenced"
    shutil.copy("/bin/sleep", daemon_exe)
    redirects = " ".join(f"{3 + i}<{path}" for i, path in enumerate(sorted(host.dev.iterdir())))
    daemon = host.pool.command(["/bin/bash", "-c", f"exec {redirects} {daemon_exe} 3600"])
    # bash opens the redirects, then execs: once /proc shows the new program, it holds them.
    host.pool.until(lambda: exe_of(daemon.pid) == str(daemon_exe), "the daemon did not start")

    summary = run(host, "pre", gpus=[0, 1, 2, 3], protected_executables=[str(daemon_exe)])

    assert summary.exit_code is ExitCode.OK
    assert not alive(mine)
    assert alive(bystander)
    assert alive(daemon.pid)
    spared = {e["GPUGATE_PID"] for e in host.journal.events("process_spared")}
    assert str(daemon.pid) in spared


def test_unkillable_holder_ends_at_deadline_with_exit_unkillable(host: FakeHost) -> None:
    (stuck,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(stuck)
    host.memory.claim(stuck, {1}, 3000)

    class DeafProcess:
        """Stands in for a process in D state: signals are accepted but never acted on."""

        def __init__(self, ident: ProcessId) -> None:
            self.ident = ident

        def send(self, signum: int) -> bool:
            return True

        def exited(self) -> bool:
            return False

        def fileno(self) -> int | None:
            return None

        def close(self) -> None:
            pass

    def pinner(ident: ProcessId, procfs: ProcFs) -> Pinned | None:
        return DeafProcess(ident)

    summary = host.run_phase(
        "post",
        host.config(post={"wait_timeout_s": 2.0, "sigkill_wait_s": 0.5, "sigterm_grace_s": 0.3}),
        host.reporter("post"),
        driver_factory=lambda: host.memory,
        pinner=pinner,
    )

    assert summary.exit_code is ExitCode.UNKILLABLE
    signals = [e["GPUGATE_SIGNAL"] for e in host.journal.events("signal_sent")]
    assert signals[:2] == ["SIGTERM", "SIGKILL"] and set(signals) == {"SIGTERM", "SIGKILL"}
    survivor = host.journal.events("survivor")
    assert survivor and survivor[0]["GPUGATE_PID"] == str(stuck)
    assert "GPUGATE_WCHAN" in survivor[0]
    assert alive(stuck)  # the deaf stand-in took the signals; the process never saw them


def test_leaked_memory_times_out_naming_gpu_and_mib(host: FakeHost) -> None:
    host.memory.leaked_mib[4] = 2048
    summary = run(host, "pre", pre={"wait_timeout_s": 0.5})
    assert summary.exit_code is ExitCode.MEMORY_TIMEOUT
    (timeout,) = host.journal.events("timeout")
    assert timeout["GPUGATE_GPU"] == "4"
    assert timeout["GPUGATE_USED_MIB"] == "2048"

    warned = run(host, "pre", pre={"wait_timeout_s": 0.3, "on_timeout": "warn"})
    assert warned.exit_code is ExitCode.OK


def test_memory_below_free_level_counts_as_free(host: FakeHost) -> None:
    host.memory.leaked_mib[4] = 300
    assert run(host, "pre", free_mib=512).exit_code is ExitCode.OK
    assert run(host, "pre", free_mib=200, pre={"wait_timeout_s": 0.3}).exit_code is (
        ExitCode.MEMORY_TIMEOUT
    )


def test_waits_for_late_release_then_succeeds(host: FakeHost) -> None:
    host.memory.release_lag_s = 3.0
    (worker,) = host.pool.holder(host.gpu_files(6))
    host.memory.claim(worker, {6}, 8000)
    summary = run(host, "pre")
    assert summary.exit_code is ExitCode.OK
    # The lag starts when the fake driver first sees the worker gone, after the kill: the run
    # waited (it told systemd so, and asked again) instead of ending at the kill.
    assert summary.seconds_wait > 0
    assert host.memory.usage(host.memory.gpus()[6]).used_mib == 0
    assert any(s.startswith("EXTEND_TIMEOUT_USEC=") for s in host.notifier.states)


def test_dry_run_kills_nothing(host: FakeHost) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(orphan, {0}, 100)
    summary = host.run_phase(
        "pre",
        host.config(),
        host.reporter(),
        dry_run=True,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK
    assert alive(orphan)
    (found,) = host.journal.events("holder_found")
    assert (found["GPUGATE_DRY_RUN"], found["GPUGATE_PID"]) == ("1", str(orphan))
    assert not host.journal.events("signal_sent")


def test_nvml_failure_fails_or_cleans_cgroup_only(host: FakeHost) -> None:
    (member,) = host.pool.holder([])
    host.put_in_unit(member)

    def broken() -> FakeGpuMemoryLike:
        raise NvmlUnavailable("NVML: the NVIDIA kernel driver is not loaded")

    with pytest.raises(NvmlUnavailable):
        host.run_phase("post", host.config(), host.reporter("post"), driver_factory=broken)
    assert alive(member)

    summary = host.run_phase(
        "post",
        host.config(post={"on_nvml_error": "warn"}),
        host.reporter("post"),
        driver_factory=broken,
    )
    assert summary.exit_code is ExitCode.OK
    assert not alive(member)


FakeGpuMemoryLike = object


def test_gpu_is_found_by_minor_number_not_index(host: FakeHost) -> None:
    host.memory.minors = [7, 6, 5, 4, 3, 2, 1, 0]
    (holder,) = host.pool.holder([host.dev / "nvidia7"])  # minor 7 is GPU index 0
    host.memory.claim(holder, {0}, 500)
    summary = run(host, "pre", gpus=[0])
    assert summary.exit_code is ExitCode.OK
    assert not alive(holder)
    (found,) = host.journal.events("holder_found")
    assert found["GPUGATE_GPU"] == "0"


def test_control_device_only_holder_outside_cgroup_survives(host: FakeHost) -> None:
    (ctl_only,) = host.pool.holder([host.dev / "nvidiactl", host.dev / "nvidia-uvm"])
    (ctl_member,) = host.pool.holder([host.dev / "nvidiactl"])
    host.put_in_unit(ctl_member)
    assert run(host, "pre").exit_code is ExitCode.OK
    assert alive(ctl_only)
    assert not alive(ctl_member)


def exe_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def wait_for_ready(directory: Path, names: tuple[str, ...]) -> dict[str, int]:
    """The PIDs the named processes wrote to directory/NAME once ready (written whole: a
    rename); a handshake, not a guess at how long they take."""
    deadline = time.monotonic() + 30
    while not all((directory / name).exists() for name in names):
        assert time.monotonic() < deadline, f"not ready: {names} in {directory}"
        time.sleep(0.01)
    return {name: int((directory / name).read_text()) for name in names}


def test_app_tree_taken_but_login_session_untouched(host: FakeHost) -> None:
    # A login shell (an interactive bash on its own terminal, with job control) starts a
    # server as a job; the server forks a worker on GPU 0 and a helper that holds no GPU (like
    # the resource tracker). Each says it is ready only once it runs its own program: the
    # helper without the device file, the worker with it, NVML listing the worker.
    ready = host.root / "ready"
    ready.mkdir()
    (host.root / "claims").mkdir()
    host.memory.claim_dir = host.root / "claims"
    announce = (
        "import os, sys, time; "
        "path = sys.argv[1]; "
        "open(path + '.tmp', 'w').write(str(os.getpid())); "
        "os.rename(path + '.tmp', path); "
        "time.sleep(3600)"
    )
    script = host.root / "server.sh"
    script.write_text(
        f"exec 3<{host.dev / 'nvidia0'}\n"
        f'python3 -c "{announce}" {ready}/helper 3<&- &\n'  # helper: no GPU
        f'python3 -c "{announce}" {ready}/worker &\n'  # worker: inherits fd 3 on nvidia0
        f"echo 0 500 > {host.root}/claims/$!\n"  # NVML lists the worker on GPU 0
        f"echo $$ > {ready}/server.tmp && mv {ready}/server.tmp {ready}/server\n"
        "wait\n"
    )
    master, terminal = os.openpty()
    shell = host.pool.command(
        ["setsid", "--ctty", "/bin/bash", "--norc", "--noprofile", "-i"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    os.write(master, f"/bin/bash {script} &\n".encode())
    pids = wait_for_ready(ready, ("server", "helper", "worker"))
    server, helper, worker = pids["server"], pids["helper"], pids["worker"]
    procfs = ProcFs()
    assert procfs.children(shell.pid) == [server]
    assert sorted(procfs.children(server)) == sorted([helper, worker])
    for pid in (server, helper, worker):
        host.pool.started.append((pid, procfs.stat(pid).start_time))  # type: ignore[union-attr]

    summary = run(host, "pre", gpus=[0])

    assert summary.exit_code is ExitCode.OK
    assert alive(shell.pid), "the session leader (login shell) must never be taken"
    signalled = {e["GPUGATE_PID"] for e in host.journal.events("signal_sent")}
    assert str(shell.pid) not in signalled
    for pid in (server, helper, worker):
        assert not alive(pid)
    reasons = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert reasons[str(helper)] == "app-tree"
    os.close(master)


class ListedDuringTheWait(FakeGpuMemory):
    """NVML lists a newcomer on GPU 0 from the second query of it after the stale holder died:
    the kill round's rediscovery (the first) does not see it, the memory wait's poll does."""

    def __init__(self, stale: int, newcomer: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.stale, self.newcomer, self.queries_after = stale, newcomer, 0

    def usage(self, gpu: Gpu) -> GpuUsage:
        if gpu.index == 0 and not alive(self.stale):
            self.queries_after += 1
            if self.queries_after == 2:
                self.claim(self.newcomer, {0}, 700)
        return super().usage(gpu)


def test_holder_found_during_the_wait_is_announced(host: FakeHost) -> None:
    (stale,) = host.pool.holder(host.gpu_files(0))
    (newcomer,) = host.pool.holder([])
    memory = ListedDuringTheWait(stale, newcomer, release_lag_s=0.5)
    memory.claim(stale, {0}, 9000)

    summary = host.run_phase(
        "pre", host.config(gpus=[0]), host.reporter("pre"), driver_factory=lambda: memory
    )

    assert summary.exit_code is ExitCode.OK
    assert memory.queries_after >= 2, "the wait never polled GPU 0"
    assert not alive(stale) and not alive(newcomer)
    found = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("holder_found")}
    assert found == {str(stale): "orphan", str(newcomer): "orphan"}


def test_app_tree_off_takes_only_gpu_holders(host: FakeHost) -> None:
    server, worker = host.pool.holder([], children=1)
    os.close(os.open(host.dev / "nvidia0", os.O_RDONLY))
    host.memory.claim(worker, {0}, 10)
    # only the worker is listed by NVML; the server holds nothing
    summary = run(host, "pre", pre={"kill_app_tree": False})
    assert summary.exit_code is ExitCode.OK
    assert alive(server) and not alive(worker)


@pytest.mark.parametrize("phase", ["pre", "post"])
def test_first_word_to_systemd_asks_for_the_whole_run(host: FakeHost, phase: str) -> None:
    """The unit's own short TimeoutStartSec=/TimeoutStopSec= is kept by install: the hook asks
    for its deadline before it reads anything, so a slow discovery cannot outlive the unit's
    timeout (and asks nothing more where there is nothing to wait for)."""
    summary = run(host, phase, **{phase: {"wait_timeout_s": 45}})
    assert summary.exit_code is ExitCode.OK
    first = host.notifier.states[0]
    assert first == f"EXTEND_TIMEOUT_USEC={(45 + 10) * 1_000_000}", host.notifier.states
