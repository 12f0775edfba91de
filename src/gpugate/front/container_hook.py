"""`gpugate oci-hook STAGE` for a container that asks for GPUs: the unit's pre before it
starts (createRuntime, prestart), its post after it stopped (poststop), the container's scope
standing for the unit."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from gpugate.config.file import LoadedConfig
from gpugate.core.run import RunScope
from gpugate.errors import BadInput, ExitCode, GateError
from gpugate.front.hook import Hook, run_hook, stopped_by_signals
from gpugate.host.nvml import GpuDriver, NvmlDriver
from gpugate.host.oci import ContainerSpec, ContainerState
from gpugate.host.scan import ProcFs
from gpugate.host.systemd import HostRoots, on_units_tree
from gpugate.integrations.config_files import load_config
from gpugate.integrations.container import (
    NOT_STARTED,
    OWN_LEASE_PREFIX,
    container_config,
    gpu_selection,
    identify,
    request_text,
)
from gpugate.integrations.records import read_leases
from gpugate.integrations.unit import GpuChoice, UnitContext
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.journal import Reporter, ReporterFactory
from gpugate.report.narrate import Narrator

METRICS_UNIT = "container"  # every container counts as one label in the metrics
STAGE_PHASES = {"createRuntime": Phase.PRE, "prestart": Phase.PRE, "poststop": Phase.POST}


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
    stream = stream or sys.stderr
    try:
        ident = identify(state, spec, ProcFs(roots.proc))
    except BadInput as exc:  # no cgroup of its own: refused before its start
        if not phase.traits.before_start:
            return int(ExitCode.OK)
        unit, fields = f"{OWN_LEASE_PREFIX}{state.id}", {"GPUGATE_OCI_CONTAINER": state.id}
        Narrator(reporter_factory(unit, phase.value, fields=fields)).failed(exc, stream)
        return int(exc.exit_code)
    reporter = reporter_factory(ident.unit, phase.value, fields=ident.fields())
    reporter.shown = ident.label  # a pod as namespace/pod/container, not its scope
    loaded = loaded or container_config()
    with stopped_by_signals():
        driver: GpuDriver | None = None
        try:
            driver = driver_factory()
            choice = container_gpus(phase, spec, ident.unit, loaded, driver)
        except GateError as exc:
            if driver is not None:
                driver.close()
            Narrator(reporter).failed(exc, stream)
            return int(exc.exit_code)
        context = UnitContext(
            {}, unit_state=unit_state, choice=choice, container=ident.label, around=ident.around
        )
        top = ident.cgroup or ""
        cgroup = f"{top}/{NOT_STARTED}" if phase.traits.before_start or not top else top
        scope = RunScope(
            phase, ident.unit, lambda: cgroup, roots=roots, driver_factory=lambda: driver
        )
        hook = Hook(scope, context.surroundings, reporter, METRICS_UNIT, stream)
        return int(run_hook(hook, loaded).exit_code)


def container_gpus(
    phase: Phase, spec: ContainerSpec, unit: str, loaded: LoadedConfig, driver: GpuDriver
) -> GpuChoice:
    """The GPUs its spec reaches; after the stop, those its start leased (lease still there)."""
    source = request_text(spec.gpus)
    leases = read_leases(loaded.config.lock_dir).leases if phase is Phase.POST else []
    leased = next((x.gpus for x in leases if x.unit == unit and x.gpus), None)
    if leased is None and spec.gpus.unresolved is not None:
        raise spec.gpus.unresolved
    return GpuChoice(leased or gpu_selection(spec.gpus, list(driver.gpus()), source), source)


def run_from_hook(
    stage: str,
    state: ContainerState,
    spec: ContainerSpec,
    *,
    roots: HostRoots | None = None,
    config: Path | None = None,
    driver: Callable[[], GpuDriver] | None = None,
) -> int:
    """The runtime's call, past the fast path: an error is one line and its exit code."""
    phase = STAGE_PHASES[stage]  # one of commands/oci_hook.py's ACTING stages
    try:
        loaded = load_config(None, config) if config is not None else None
        roots = roots or on_units_tree(HostRoots())
        return run_container_hook(
            phase, state, spec, roots=roots, loaded=loaded, driver_factory=driver or NvmlDriver
        )
    except GateError as exc:
        print(lines.hook_failed(stage, exc.message), file=sys.stderr)
        return int(exc.exit_code)
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        print(lines.hook_failed(stage, lines.internal_error_text(exc)), file=sys.stderr)
        return int(ExitCode.INTERNAL)
