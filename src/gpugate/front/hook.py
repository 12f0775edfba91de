"""One hook run, the same for systemd's ExecStartPre=/ExecStopPost= and Slurm's
Prolog=/Epilog=: locate the cgroup, run the phase, say a failure once, record the metrics."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TextIO

from gpugate.config.models import LoadedConfig
from gpugate.core.kill import Pinned, pin
from gpugate.core.outcome import RunSummary
from gpugate.core.run import PhaseRun, RunScope
from gpugate.core.shm_cleanup import ShmHost
from gpugate.errors import (
    ExitCode,
    GateError,
    Interrupted,
    ManualRunRefused,
    NvmlUnavailable,
    StateUnwritable,
)
from gpugate.host.nvml import GpuDriver, NoGpus, NvmlDriver
from gpugate.host.procfs import ProcessId, ProcFs
from gpugate.host.roots import HostRoots
from gpugate.host.shm import ShmArea
from gpugate.host.state_dirs import check_all
from gpugate.host.systemd import UnitEnvironment
from gpugate.integrations.unit.shared_host import METRICS, UnitSurroundings, prepare
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.report.narrate import Narrator
from gpugate.report.narrate_unit import UnitNarration


@dataclass(frozen=True)
class Hook:
    phase: Phase
    unit: str  # the unit, or the label standing for it (slurm-job-42)
    locate_cgroup: Callable[[], str]  # the cgroup whose processes all die
    metrics_unit: str  # the metrics' unit label (every Slurm job counts as "slurm")
    for_uid: int | None = None  # the hidden --for-uid: kill only this account's processes


@dataclass(frozen=True)
class HookOutcome:
    exit_code: ExitCode
    summary: RunSummary | None  # None where the run ended in an error
    error: GateError | None


def run_hook(
    hook: Hook,
    loaded: LoadedConfig,
    reporter: Reporter,
    *,
    roots: HostRoots | None = None,
    dry_run: bool = False,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin,
    clock: Callable[[], float] = time.monotonic,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    manual_refusal: str | None = None,
    ignore_leases: bool = False,
) -> HookOutcome:
    """environ, manual_refusal, ignore_leases: see run_phase."""
    stream = stream or sys.stderr
    summary: RunSummary | None = None
    error: GateError | None = None
    try:
        scope = RunScope(hook.phase, hook.unit, hook.locate_cgroup(), hook.for_uid)
        summary = run_phase(
            scope,
            loaded,
            reporter,
            roots=roots,
            dry_run=dry_run,
            driver_factory=driver_factory,
            pinner=pinner,
            clock=clock,
            environ=environ,
            manual_refusal=manual_refusal,
            ignore_leases=ignore_leases,
        )
        code = summary.exit_code
    except GateError as exc:
        error, code = exc, exc.exit_code
        reporter.echo = False  # failed() says it on stderr itself, once
        reporter.error_stream = stream
        Narrator(reporter, dry_run=dry_run).failed(exc)
    metrics_unwritable = isinstance(error, StateUnwritable) and error.what == METRICS
    if not dry_run and not metrics_unwritable:  # said once already: no warning after it
        record_metrics(loaded, hook, code, summary, stream)
    return HookOutcome(code, summary, error)


def run_phase(
    scope: RunScope,
    loaded: LoadedConfig,
    reporter: Reporter,
    *,
    roots: HostRoots | None = None,
    dry_run: bool = False,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin,
    clock: Callable[[], float] = time.monotonic,
    environ: Mapping[str, str] | None = None,
    manual_refusal: str | None = None,
    ignore_leases: bool = False,
    unit_env: Callable[[str], UnitEnvironment | None] | None = None,
    unit_state: Callable[[str], str | None] | None = None,
    shm_host: Callable[[list[ShmArea]], ShmHost] | None = None,
) -> RunSummary:
    """environ: the hook's environment (INVOCATION_ID, SERVICE_RESULT; default: ours);
    manual_refusal: why a hand-typed run must not kill (hook_guard), or None; ignore_leases:
    pre warns about other units' leases instead of refusing (`gpugate run --force` puts the
    hidden --ignore-leases on its unit's ExecStartPre=; never the environment); unit_env and
    unit_state stand in for systemd's answers, shm_host for /dev/shm's files (tests)."""
    roots = roots or HostRoots()
    surroundings = prepare(
        scope,
        loaded,
        os.environ if environ is None else environ,
        UnitNarration(reporter),
        roots=roots,
        manual_refusal=manual_refusal,
        ignore_leases=ignore_leases,
        environment=unit_env,
        unit_state=unit_state,
    )
    if not dry_run:  # before anything is killed: a run that cannot record its end does not begin
        check_all(*surroundings.state_to_write())
    narrator = Narrator(reporter, dry_run=dry_run)
    narrator.looking()
    run = PhaseRun(
        scope,
        surroundings.loaded,
        narrator,
        roots=roots,
        pinner=pinner,
        clock=clock,
        surroundings=surroundings,
        shm_host=shm_host,
    )
    return drive(run, surroundings, narrator, driver_factory, dry_run=dry_run)


def drive(
    run: PhaseRun,
    surroundings: UnitSurroundings,
    narrator: Narrator,
    driver_factory: Callable[[], GpuDriver],
    *,
    dry_run: bool,
) -> RunSummary:
    """The run with NVML opened (or degraded without it) and closed after; an error or an
    interruption recorded for this start's post."""
    try:
        driver = open_driver(run, surroundings, narrator, driver_factory)
        try:
            return run.run(driver, dry_run=dry_run)
        finally:
            driver.close()
    except ManualRunRefused:
        raise
    except Interrupted as exc:
        stopped = Interrupted(
            f"{exc.message} while {run.activity}; it left no GPU lock or lease", exc.signal_name
        )
        if not dry_run:
            surroundings.after_interrupt(stopped, run.last_busy)
        raise stopped from None
    except GateError as exc:
        if not dry_run:
            surroundings.after_error(exc)  # post need not wait on it again
        raise


def open_driver(
    run: PhaseRun,
    surroundings: UnitSurroundings,
    narrator: Narrator,
    driver_factory: Callable[[], GpuDriver],
) -> GpuDriver:
    hung = surroundings.nvml_hung_in_pre()
    if hung is not None:
        # This start's pre waited its deadline on a driver that did not answer: asking
        # again would hang post too. The cgroup still dies.
        narrator.nvml_skipped(hung, run.scope.phase.value)
        run.without_nvml()
        return NoGpus()
    try:
        return driver_factory()
    except NvmlUnavailable as exc:
        run.degrade(exc)
        return NoGpus()


def record_metrics(
    loaded: LoadedConfig,
    hook: Hook,
    code: ExitCode,
    summary: RunSummary | None,
    stream: TextIO,
) -> None:
    textfile = loaded.config.metrics_textfile
    if textfile is None:
        return  # no textfile: the metrics module is not even imported (start-up time)
    from gpugate.integrations.metrics import record_after_run, run_record  # noqa: PLC0415

    record = run_record(hook.phase.value, hook.metrics_unit, code, summary)
    record_after_run(textfile, record, stream=stream)
