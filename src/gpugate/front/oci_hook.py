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
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from gpugate.config.models import LoadedConfig
from gpugate.core.run import RunDeps
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Deps, Hook, run_hook
from gpugate.front.interrupt import stopped_by_signals
from gpugate.host.nvml import GpuDriver, NvmlDriver
from gpugate.host.oci import ContainerSpec, ContainerState
from gpugate.host.oci_gpus import OciInputError
from gpugate.host.procfs import ProcFs
from gpugate.host.roots import HostRoots, on_units_tree
from gpugate.integrations.config_files import load_config
from gpugate.integrations.container import (
    NOT_STARTED,
    OWN_LEASE_PREFIX,
    ContainerIdentity,
    container_config,
    container_surroundings,
    gpu_selection,
    identify,
    request_text,
)
from gpugate.integrations.unit.gpu_source import GpuChoice
from gpugate.integrations.unit.leases import read_leases
from gpugate.integrations.unit.shared_host import UnitContext
from gpugate.phase import Phase
from gpugate.report import lines, oci_text
from gpugate.report.journal import Reporter, ReporterFactory
from gpugate.report.narrate import Narrator

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
    identity = identified(phase, state, spec, roots, reporter_factory, stream)
    if isinstance(identity, int):
        return identity
    reporter = reporter_factory(identity.unit, phase.value, fields=identity.fields())
    loaded = loaded or container_config()
    with stopped_by_signals():
        # The container's GPUs as the config's: a device minor is a GPU only NVML can name
        # (each call within NVML's own limit: no run deadline yet).
        driver: GpuDriver | None = None
        try:
            driver = driver_factory()
            source = request_text(spec.gpus)
            leased = leased_gpus(loaded, identity.unit) if phase is Phase.POST else None
            if leased is None and spec.gpus.unresolved is not None:
                raise spec.gpus.unresolved
            selection = leased or gpu_selection(spec.gpus, list(driver.gpus()), source)
        except GateError as exc:
            if driver is not None:
                driver.close()
            Narrator(reporter).failed(exc, stream)
            return int(exc.exit_code)
        opened = driver
        loaded = LoadedConfig(loaded.config.with_gpus(selection), loaded.source)
        context = UnitContext({}, roots, unit_state=unit_state)
        hook = Hook(
            phase,
            identity.unit,
            lambda: container_cgroup(phase, identity),
            metrics_unit=METRICS_UNIT,
            surroundings=container_surroundings(identity, GpuChoice(selection, source), context),
        )
        deps = Deps(reporter, RunDeps(roots=roots, driver_factory=lambda: opened), stream)
        return int(run_hook(hook, loaded, deps).exit_code)


def leased_gpus(loaded: LoadedConfig, unit: str) -> tuple[int, ...] | None:
    """After the stop the container's GPUs are those its start leased (what it resolved
    then), where its lease is still there."""
    for lease in read_leases(loaded.config.lock_dir).leases:
        if lease.unit == unit and lease.gpus:
            return lease.gpus
    return None


def identified(
    phase: Phase,
    state: ContainerState,
    spec: ContainerSpec,
    roots: HostRoots,
    reporter_factory: ReporterFactory,
    stream: TextIO,
) -> ContainerIdentity | int:
    """The container's identity, or the hook's exit code where it has no cgroup of its own:
    never gated as the unit around it; refused before its start (one line, one entry), and
    its poststop has no lease of its own to give back."""
    try:
        return identify(state, spec, ProcFs(roots.proc))
    except OciInputError as exc:
        if not phase.traits.before_start:
            return int(ExitCode.OK)
        fields = {"GPUGATE_OCI_CONTAINER": state.id}
        reporter = reporter_factory(f"{OWN_LEASE_PREFIX}{state.id}", phase.value, fields=fields)
        Narrator(reporter).failed(exc, stream)
        return int(exc.exit_code)


def container_cgroup(phase: Phase, identity: ContainerIdentity) -> str:
    """The run's unit cgroup. Before the start nothing in the scope is the container's yet
    (its init waits there): a cgroup below it that never exists; after the stop whatever is
    left in the scope is the container's."""
    top = identity.cgroup or ""
    return f"{top}/{NOT_STARTED}" if phase.traits.before_start or not top else top


def run_from_hook(
    stage: str,
    state: ContainerState,
    spec: ContainerSpec,
    *,
    roots: HostRoots | None = None,
    config: Path | None = None,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
) -> int:
    """The runtime's call, past the fast path: an error is one line and its exit code.
    driver_factory: NVML's, or `--nvml-library`'s through the full command line (the bench)."""
    phase = stage_phase(stage)
    if phase is None:
        return int(ExitCode.OK)
    try:
        loaded = load_config(None, config) if config is not None else None
        roots = roots or on_units_tree(HostRoots())
        return run_container_hook(
            phase, state, spec, roots=roots, loaded=loaded, driver_factory=driver_factory
        )
    except GateError as exc:
        print(oci_text.hook_failed(stage, exc.message), file=sys.stderr)
        return int(exc.exit_code)
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        print(
            oci_text.hook_failed(stage, lines.internal_error_text(exc)),
            file=sys.stderr,
        )
        return int(ExitCode.INTERNAL)
