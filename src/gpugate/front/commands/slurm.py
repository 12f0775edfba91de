"""`gpugate slurm prolog|epilog`: a Slurm job's hook run, and the drain reason when it fails;
`gpugate slurm check`: whether each job gets a private /dev/shm and gres.conf resolves every GPU
to an NVML GPU (exit 78 where not)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR, LoadedConfig
from gpugate.core.outcome import RunSummary
from gpugate.core.run import RunDeps
from gpugate.errors import ExitCode, GateError
from gpugate.front.commands import Front
from gpugate.front.hook import Deps, Hook, run_hook, stopped_by_signals
from gpugate.host.nvml import Gpu, GpuDriver
from gpugate.integrations.gres_conf import (
    DEFAULT_SLURM_CONF,
    DeviceNodes,
    GpuLayout,
    GresUnresolved,
    StatFn,
    gpu_order,
    gres_conf_path,
    job_gpus,
    parse_gres_conf,
    read_gres_conf,
    shm_privacy,
)
from gpugate.integrations.slurm import (
    METRICS_UNIT,
    SlurmJob,
    job_cgroup,
    job_fields,
    job_from_env,
    job_surroundings,
    load_slurm_config,
    set_drain_reason,
    with_job_gpus,
)
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.journal import Event, Reporter, ReporterFactory
from gpugate.report.lines import failure_detail


def slurm(front: Front, phase: Phase, config: Path | None, *, dry_run: bool = False) -> int:
    with stopped_by_signals():
        deps = SlurmDeps(
            front.environ,
            front.reporter_factory,
            RunDeps(roots=front.host_roots(), driver_factory=front.driver_factory),
        )
        return run_slurm_hook(phase, config, dry_run=dry_run, deps=deps)


@dataclass(frozen=True)
class SlurmDeps:
    environ: Mapping[str, str]  # slurmd's: the job
    reporter_factory: ReporterFactory = Reporter
    run: RunDeps = field(default_factory=RunDeps)
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    config_dir: Path = DEFAULT_CONFIG_DIR
    device_stat: StatFn = os.stat  # how gres.conf's File= are looked at (tests: a stand-in)


def run_slurm_hook(
    phase: Phase, config_path: Path | None, *, dry_run: bool, deps: SlurmDeps
) -> int:
    environ, stream = deps.environ, deps.stream
    job: SlurmJob | None = None
    summary: RunSummary | None = None
    try:
        job = job_from_env(environ)
        if not job.gpus:
            if job.no_gpus:  # Slurm's own words for "no GPU here"
                fields = job_fields(job)
                reporter = deps.reporter_factory(job.label, phase.value, fields=fields)
                reporter.event(
                    Event.RUN_FINISHED, lines.slurm_no_gpus(job.no_gpus), result="success"
                )
            return int(ExitCode.OK)  # a CPU job, or a node without GPUs: not gpugate's
        config = load_slurm_config(config_path, deps.config_dir)
        loaded, run_deps = job_config(config, job, deps)
    except GateError as exc:
        detail = exc.message
        print(lines.error(detail), file=stream)
        code = exc.exit_code
    else:
        code, summary, detail = run_job(
            phase, job, loaded, dry_run=dry_run, deps=replace(deps, run=run_deps)
        )
    if dry_run or code in (ExitCode.OK, ExitCode.INTERRUPTED):
        return int(code)  # stopped: slurmd, which stopped it, drains the node itself
    drain(phase, job, detail, code, environ=environ, stream=stream, said=summary is None)
    return int(code)


def job_config(
    config: LoadedConfig, job: SlurmJob, deps: SlurmDeps
) -> tuple[LoadedConfig, RunDeps]:
    """The config with the job's GPUs as NVML's UUIDs (through gres.conf), and the deps with
    the driver opened; numbers not resolved for certain: no GPU, the job's cgroup alone."""
    driver: GpuDriver | None = None
    numbers = ",".join(map(str, job.gpus))
    try:
        path = gres_conf_path(deps.environ.get("SLURM_CONF"))
        layout = parse_gres_conf(read_gres_conf(path), str(path), job.node_name)
        driver = deps.run.driver_factory()
        nodes = DeviceNodes(deps.run.roots.dev, deps.device_stat)
        unreadable = len(driver.faults())
        gpus = job_gpus(job.gpus, layout, driver.gpus(), nodes, unreadable)
    except (GresUnresolved, GateError) as exc:
        if driver is not None:
            driver.close()
        why = exc.message if isinstance(exc, GateError) else str(exc)
        print(
            lines.warning(lines.slurm_gpus_unresolved(job.gpus_from, numbers, why)),
            file=deps.stream,
        )
        note = f"{job.gpus_from}={numbers} not resolved: the job's cgroup only"
        return with_job_gpus(config, (), note), deps.run
    opened = driver
    note = f"gpus from {job.gpus_from}={numbers} through {layout.path}"
    uuids = tuple(gpu.uuid for gpu in gpus)
    return with_job_gpus(config, uuids, note), replace(deps.run, driver_factory=lambda: opened)


def run_job(
    phase: Phase, job: SlurmJob, loaded: LoadedConfig, *, dry_run: bool, deps: SlurmDeps
) -> tuple[ExitCode, RunSummary | None, str]:
    job_id, node_name, cgroup_root = job.job_id, job.node_name, deps.run.roots.cgroup
    hook = Hook(
        phase,
        job.label,
        lambda: job_cgroup(job_id, cgroup_root, node_name),
        metrics_unit=METRICS_UNIT,
        surroundings=lambda scope, loaded, reporter: job_surroundings(loaded),
        dry_run=dry_run,
    )
    reporter = deps.reporter_factory(job.label, phase.value, fields=job_fields(job))
    outcome = run_hook(hook, loaded, Deps(reporter, deps.run, deps.stream))
    detail = outcome.error.message if outcome.error else failure_detail(outcome.summary)
    return outcome.exit_code, outcome.summary, detail


def drain(
    phase: Phase,
    job: SlurmJob | None,
    detail: str,
    code: ExitCode,
    *,
    environ: Mapping[str, str],
    stream: TextIO,
    said: bool,
) -> None:
    """A failed prolog or epilog: the drain reason on stderr (unless said) and to slurmctld."""
    reason = lines.drain_reason(phase.value, job.job_id if job else None, detail, int(code))
    if not said:
        print(lines.error(f"drain: {reason}"), file=stream, flush=True)
    node = job.node_name if job is not None else environ.get("SLURMD_NODENAME")
    if node:
        set_drain_reason(node, reason, stream)


def slurm_check(
    environ: Mapping[str, str],
    node: str | None,
    driver_factory: Callable[[], GpuDriver],
    nodes: DeviceNodes,
    stream: TextIO | None = None,
) -> int:
    out = stream or sys.stdout
    node = node or environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_conf = environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF
    try:
        gres_conf_path(slurm_conf)  # SLURM_CONF an absolute path, or GresUnresolved
        privacy = shm_privacy(Path(slurm_conf))
        print(lines.slurm_shm(privacy.private, privacy.plugin, privacy.dirs), file=out)
    except GresUnresolved as exc:
        print(lines.slurm_shm_unknown(str(exc)), file=out)
    try:
        path = gres_conf_path(slurm_conf)
        layout = parse_gres_conf(read_gres_conf(path), str(path), node)
    except GresUnresolved as exc:
        print(lines.slurm_gres_unresolved(node, str(exc)), file=out)
        return int(ExitCode.CONFIG)
    return check_gpus(layout, node, driver_factory, nodes, out)


def check_gpus(
    layout: GpuLayout,
    node: str,
    driver_factory: Callable[[], GpuDriver],
    nodes: DeviceNodes,
    out: TextIO,
) -> int:
    driver: GpuDriver | None = None
    try:
        driver = driver_factory()
        gpus = list(driver.gpus())
        faults = list(driver.faults())
    except GateError as exc:
        print(lines.error(exc.message), file=sys.stderr)
        return int(exc.exit_code)
    finally:
        if driver is not None:
            driver.close()
    try:
        ordered: list[Gpu] = gpu_order(layout, gpus, nodes, len(layout.files), len(faults))
    except GresUnresolved as exc:
        print(lines.slurm_gres_unresolved(node, str(exc)), file=out)
        return int(ExitCode.CONFIG)
    files = list(layout.files) if not layout.nvml_order else []
    print(lines.slurm_gres_resolved(node, layout.path, layout.nvml_order), file=out)
    for number, gpu in enumerate(ordered):
        print(lines.slurm_gpu_number(number, files[number] if files else None, gpu.label), file=out)
    return int(ExitCode.OK)
