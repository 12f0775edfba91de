"""The phase run as a stage machine (core/run.py): each path through it is a sequence of
stage and transition codes, asserted as codes; NVML failing is a transition back to looking;
an interrupted run names its stage as a code; the null surroundings are the plain case."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from gpugate.core.outcome import (
    PlainWorkload,
    Stage,
    Transition,
    Workload,
)
from gpugate.core.run import PhaseRun, RunScope
from gpugate.errors import Interrupted, NvmlUnavailable
from gpugate.front.commands.slurm import JobWorkload, with_job_gpus
from gpugate.front.hook import stopped_by_signals
from gpugate.host.nvml import Gpu, GpuUsage
from gpugate.phase import Phase
from gpugate.report.narrate import Narrator
from tests.fakes import UNIT, UNIT_CGROUP, FakeGpuMemory, FakeHost, RecordingJournal, alive

S, T = Stage, Transition


def machine(host: FakeHost, phase: str = "pre", *, dry_run: bool = False, **config: object):  # type: ignore[no-untyped-def]
    loaded = host.config(**config)
    reporter = host.reporter(phase)
    if dry_run:
        reporter = reporter.as_dry_run()
    surroundings: Workload = PlainWorkload(loaded)
    scope = RunScope(
        Phase(phase), UNIT, lambda: UNIT_CGROUP, None, dry_run, host.roots, lambda: host.memory
    )
    return PhaseRun(scope, UNIT_CGROUP, Narrator(reporter).tell, surroundings)


def test_a_kill_goes_through_every_stage(host: FakeHost) -> None:
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    host.memory.claim(member, {0}, 4000)
    run = machine(host, gpus=[0])
    summary = run.run()
    assert [pid.pid for pid in summary.killed] == [member]
    assert run.transitions == [
        (S.LOOKING, T.FOUND),
        (S.LOCKING, T.LOCKED),
        (S.STOPPING, T.STOPPED),
        (S.WAITING, T.SETTLED),
        (S.FINISHING, T.FINISHED),
    ]
    assert run.progress.stage is S.FINISHING  # the stage it ended in: the last one entered


def test_a_dry_run_stops_after_looking(host: FakeHost) -> None:
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    run = machine(host, gpus=[0], dry_run=True)
    summary = run.run()
    assert run.transitions == [(S.LOOKING, T.DRY_RUN), (S.FINISHING, T.FINISHED)]
    assert summary.would_kill == 1 and not summary.killed
    (finished,) = host.journal.events("run_finished")
    assert finished["GPUGATE_WOULD_KILL"] == "1" and finished["GPUGATE_DRY_RUN"] == "1"


def test_progress_is_the_stage_last_entered_on_every_path(host: FakeHost) -> None:
    """The stage an interruption names is the machine's: the one each transition led to."""
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    for run in (machine(host, gpus=[0]), machine(host, gpus=[0], dry_run=True)):
        run.run()
        assert run.transitions[-1] == (S.FINISHING, T.FINISHED)
        assert run.progress.stage is S.FINISHING


class RespawnsInTheWait(FakeGpuMemory):
    """Once the unit's first process is gone, a new one of the unit takes GPU 0 (once), when
    the wait asks (core.run.look): a respawn the kill rounds did not see."""

    host: FakeHost | None = None
    first: int = 0
    second: int = 0

    def usage(self, gpu: Gpu) -> GpuUsage:
        host = self.host
        asker = sys._getframe(1).f_code.co_name
        if host and not self.second and asker == "look" and not alive(self.first):
            (self.second,) = host.pool.holder(host.gpu_files(0))
            host.put_in_unit(self.second)
            self.claim(self.second, {0}, 3000)
        return super().usage(gpu)


def test_a_respawn_killed_in_the_wait_is_a_transition_back_to_stopping(host: FakeHost) -> None:
    memory = RespawnsInTheWait()
    (memory.first,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(memory.first)
    memory.claim(memory.first, {0}, 4000)
    memory.host, host.memory = host, memory
    run = machine(host, gpus=[0], pre={"wait_timeout_s": 20})
    summary = run.run()
    assert memory.second and not alive(memory.second)
    assert {p.pid for p in summary.killed} == {memory.first, memory.second}
    assert run.transitions == [
        (S.LOOKING, T.FOUND),
        (S.LOCKING, T.LOCKED),
        (S.STOPPING, T.STOPPED),
        (S.WAITING, T.RESPAWNED),
        (S.STOPPING, T.STOPPED),
        (S.WAITING, T.SETTLED),
        (S.FINISHING, T.FINISHED),
    ]


class FailsInTheWait(FakeGpuMemory):
    """Answers until the unit's process is gone (killed), then fails."""

    killed: int = 0

    def usage(self, gpu: Gpu) -> GpuUsage:
        if self.killed and not alive(self.killed):
            raise NvmlUnavailable("NVML: GPU 0 is lost (fell off the bus)")
        return super().usage(gpu)


def test_nvml_failing_is_a_transition_back_to_looking(host: FakeHost) -> None:
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    host.memory = FailsInTheWait(leaked_mib={0: 5000})
    host.memory.killed = member
    run = machine(host, "post", gpus=[0], post={"on_nvml_error": "warn", "wait_timeout_s": 5})
    summary = run.run()
    assert summary.degraded
    codes = run.transitions
    failed_at = codes.index(next(c for c in codes if c[1] is T.NVML_FAILED))
    assert codes[failed_at][0] in (S.STOPPING, S.WAITING)
    assert codes[failed_at + 1][0] is S.LOOKING
    assert codes[-1] == (S.FINISHING, T.FINISHED)
    assert len(host.journal.events("run_started")) == 1  # announced once, by the first look


@pytest.mark.message
def test_a_degraded_run_names_its_own_phases_setting_whatever_its_reporter(
    host: FakeHost,
) -> None:
    """The sweep's reap is a pre run told through the sweep's reporter: the setting it names
    is pre's, the one that exists."""

    def no_nvml() -> FakeGpuMemory:
        raise NvmlUnavailable("NVML: driver not loaded")

    loaded = host.config(gpus=[0], pre={"on_nvml_error": "warn"})
    scope = RunScope(Phase.PRE, UNIT, lambda: UNIT_CGROUP, roots=host.roots, driver_factory=no_nvml)
    tell = Narrator(host.reporter("sweep")).tell
    assert PhaseRun(scope, UNIT_CGROUP, tell, PlainWorkload(loaded)).run().degraded
    (warned,) = host.journal.events("warning")
    assert warned["GPUGATE_REASON"] == "nvml-degraded"
    assert "; pre.on_nvml_error = warn:" in warned["MESSAGE"]


def test_nvml_failing_with_on_nvml_error_fail_ends_the_run(host: FakeHost) -> None:
    host.memory = FailsInTheWait(leaked_mib={0: 5000})
    (member,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member)
    host.memory.killed = member
    run = machine(host, "post", gpus=[0], post={"on_nvml_error": "fail"})
    with pytest.raises(NvmlUnavailable):
        run.run()
    assert run.transitions[-1][1] is not T.FINISHED


class SignalOnWaiting(RecordingJournal):
    def send(self, message: str, fields: dict[str, str]) -> None:
        super().send(message, fields)
        if fields.get("GPUGATE_WAITING_FOR") == "memory" and not getattr(self, "fired", False):
            self.fired = True
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()


def test_an_interrupted_run_names_its_stage_as_a_code(host: FakeHost) -> None:
    from tests.fakes import run_unit_phase

    host.memory.leaked_mib[0] = 50000  # freed by nobody: pre waits for it
    journal = SignalOnWaiting()
    reporter = host.reporter("pre")
    reporter.journal = journal
    loaded = host.config(gpus=[0], pre={"wait_timeout_s": 60})
    scope = RunScope(Phase.PRE, UNIT, lambda: UNIT_CGROUP)
    with pytest.raises(Interrupted) as caught, stopped_by_signals():
        run_unit_phase(
            scope,
            loaded,
            reporter,
            roots=host.roots,
            driver_factory=lambda: host.memory,
            environ={},
            unit_state=lambda _: "inactive",
        )
    assert caught.value.stage == Stage.WAITING.value


@pytest.mark.message
def test_an_interrupted_run_says_what_it_was_doing() -> None:
    from gpugate.core.outcome import BusyGpu, Progress, interrupted

    gpu = FakeGpuMemory(count=2).gpus()[1]
    assert Progress(Stage.STOPPING, processes=1, round_number=2).doing == (
        "stopping 1 process(es) (round 2)"
    )
    assert Progress(Stage.LOCKING, lock_gpu=gpu).doing == (
        f"waiting for another gpugate run's lock on {gpu.label}"
    )
    assert Progress(Stage.WAITING, waiting_on=(BusyGpu(gpu, 50000, ()),)).doing == (
        "waiting for the driver to free memory (GPU 1 50000 MiB)"
    )
    error = interrupted("SIGINT", Progress())
    assert (error.message, error.stage) == (
        "stopped by SIGINT while looking for the GPUs' holders; it left no GPU lock or lease",
        Stage.LOOKING.value,
    )


def test_the_null_and_slurm_surroundings_refuse_and_record_nothing(
    host: FakeHost, tmp_path: Path
) -> None:
    loaded = host.config(metrics_textfile=tmp_path / "m" / "gpugate.prom")
    null = PlainWorkload(loaded)
    folders, files = null.state_to_write()
    # Not the metrics textfile: metrics are never a run's failure (a warning after the run).
    assert [folder for folder, _ in folders] == [loaded.config.lock_dir] and files == []
    assert not null.refuses_start([], dry_run=False)
    assert null.not_to_wait_on([]) == [] and null.driver_hung_earlier() is None
    job_loaded = with_job_gpus(
        loaded, ("GPU-0a0a0a0a-0000", "GPU-0b0b0b0b-0000"), "gpus from SLURM_JOB_GPUS=0,1"
    )
    slurm = JobWorkload(job_loaded, frozenset())
    assert slurm.loaded.config.gpus == ("GPU-0a0a0a0a-0000", "GPU-0b0b0b0b-0000")
    assert job_loaded.source in slurm.gpu_source and "SLURM_JOB_GPUS" in slurm.gpu_source
