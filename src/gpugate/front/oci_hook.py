"""`gpugate oci-hook STAGE` for a container that asks for GPUs (front/oci_entry.py decided
that, cheaply): the unit's pre before the container starts, its post after it stopped, with
the container's scope as the unit (integrations/container.py).

Before the start (createRuntime, or prestart): a stale holder of its GPUs is killed, one of
another running unit or container refused (exit 22: the runtime does not start it), then the
hook waits until NVML says the GPUs are free, and the container's lease is taken. After the
stop (poststop): its lease goes, what is left in its scope dies, and the hook waits, bounded,
until the GPUs are free.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from gpugate.config.file import load_config
from gpugate.config.models import LoadedConfig
from gpugate.core.kill import pin
from gpugate.core.outcome import RunSummary
from gpugate.core.run import PhaseRun, RunScope
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Hook, drive, record_metrics
from gpugate.front.interrupt import stopped_by_signals
from gpugate.host.nvml import GpuDriver, NvmlDriver
from gpugate.host.oci import ContainerSpec, ContainerState
from gpugate.host.procfs import ProcFs
from gpugate.host.roots import HostRoots
from gpugate.host.state_dirs import check_all
from gpugate.integrations.container import (
    NOT_STARTED,
    ContainerIdentity,
    ContainerSurroundings,
    container_config,
    gpu_selection,
    identify,
    request_text,
)
from gpugate.integrations.unit.gpu_source import GpuChoice
from gpugate.integrations.unit.start_failure import failed_pre_of_this_start
from gpugate.phase import Phase
from gpugate.report.journal import Reporter, ReporterFactory
from gpugate.report.narrate import Narrator
from gpugate.report.narrate_unit import UnitNarration

METRICS_UNIT = "container"  # every container counts as one label in the metrics
# The stages gpugate acts at: before the container's process starts, and after it stopped.
START_STAGES = frozenset({"createRuntime", "prestart"})
STOP_STAGES = frozenset({"poststop"})


def stage_phase(stage: str) -> Phase | None:
    """The unit phase a stage runs as; None for the stages gpugate has nothing to do at."""
    if stage in START_STAGES:
        return Phase.PRE
    if stage in STOP_STAGES:
        return Phase.POST
    return None


def run_container_hook(
    phase: Phase,
    state: ContainerState,
    spec: ContainerSpec,
    *,
    roots: HostRoots,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
    reporter_factory: ReporterFactory = Reporter,
    stream: TextIO | None = None,
    loaded: LoadedConfig | None = None,
    unit_state: Callable[[str], str | None] | None = None,
) -> int:
    """loaded: the config (tests); default /etc/gpugate/containers.toml; unit_state stands in
    for systemd's answer on a lease's scope (tests)."""
    stream = stream or sys.stderr
    identity = identify(state, spec, ProcFs(roots.proc))
    reporter = reporter_factory(identity.unit, phase.value, fields=identity.fields())
    summary: RunSummary | None = None
    loaded = loaded or container_config()
    with stopped_by_signals():
        try:
            summary = _run(
                phase,
                identity=identity,
                spec=spec,
                loaded=loaded,
                reporter=reporter,
                roots=roots,
                driver_factory=driver_factory,
                unit_state=unit_state,
            )
            code = summary.exit_code
        except GateError as exc:
            code = exc.exit_code
            reporter.echo = False  # failed() says it on stderr itself, once
            reporter.error_stream = stream
            Narrator(reporter).failed(exc)
    hook = Hook(phase, identity.unit, lambda: identity.cgroup or "/", metrics_unit=METRICS_UNIT)
    record_metrics(loaded, hook, code, summary, stream)
    return int(code)


def _run(
    phase: Phase,
    *,
    identity: ContainerIdentity,
    spec: ContainerSpec,
    loaded: LoadedConfig,
    reporter: Reporter,
    roots: HostRoots,
    driver_factory: Callable[[], GpuDriver],
    unit_state: Callable[[str], str | None] | None,
) -> RunSummary:
    driver = driver_factory()
    source = request_text(spec.gpus)
    try:
        selection = gpu_selection(spec.gpus, list(driver.gpus()), source)
    except GateError:
        driver.close()
        raise
    loaded = LoadedConfig(loaded.config.model_copy(update={"gpus": selection}), loaded.source)
    top = identity.cgroup or ""
    # Before the start nothing in the scope is the container's yet (its init waits there);
    # after the stop whatever is left in it is.
    unit_cgroup = f"{top}/{NOT_STARTED}" if phase.traits.before_start or not top else top
    scope = RunScope(phase, identity.unit, unit_cgroup)
    surroundings = ContainerSurroundings(
        scope,
        loaded,
        {},
        GpuChoice(selection, source),
        UnitNarration(reporter),
        roots=roots,
        identity=identity,
        unit_state=unit_state,
    )
    if phase.traits.reads_failed_start:
        lock_dir = loaded.config.lock_dir
        surroundings.failed_pre = failed_pre_of_this_start(lock_dir, identity.unit, {})
    check_all(*surroundings.state_to_write())
    narrator = Narrator(reporter)
    narrator.looking()
    run = PhaseRun(
        scope, loaded, narrator, roots=roots, pinner=pin, clock=time.monotonic,
        surroundings=surroundings,
    )  # fmt: skip
    return drive(run, surroundings, narrator, lambda: driver, dry_run=False)


def run_from_hook(
    stage: str,
    state: ContainerState,
    spec: ContainerSpec,
    *,
    roots: HostRoots | None = None,
    config: Path | None = None,
) -> int:
    """The runtime's call, past the fast path: an error is one line and its exit code."""
    from gpugate.front.commands import Front  # noqa: PLC0415

    phase = stage_phase(stage)
    if phase is None:
        return int(ExitCode.OK)
    try:
        loaded = load_config(None, config) if config is not None else None
        roots = roots or Front().roots
        return run_container_hook(phase, state, spec, roots=roots, loaded=loaded)
    except GateError as exc:
        print(f"gpugate: oci-hook {stage}: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        print(
            f"gpugate: oci-hook {stage}: internal error: {type(exc).__name__}: {exc} "
            "(set GPUGATE_DEBUG=1 for a traceback, and please report it)",
            file=sys.stderr,
        )
        return int(ExitCode.INTERNAL)
