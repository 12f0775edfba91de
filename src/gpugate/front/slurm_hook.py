"""`gpugate slurm prolog|epilog`: a Slurm job's hook run, and the drain reason when it fails
(what a job is and where its cgroup lives: gpugate.integrations.slurm)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR
from gpugate.core.outcome import RunSummary
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Hook, run_hook
from gpugate.host.nvml import GpuDriver
from gpugate.host.roots import HostRoots
from gpugate.integrations.slurm import (
    MAX_REASON,
    METRICS_UNIT,
    SlurmJob,
    failure_detail,
    job_cgroup,
    job_fields,
    job_from_env,
    load_slurm_config,
    set_drain_reason,
    with_job_gpus,
)
from gpugate.phase import Phase
from gpugate.report.journal import Reporter, ReporterFactory


def run_slurm_hook(
    phase: Phase,
    *,
    config_path: Path | None,
    dry_run: bool,
    environ: Mapping[str, str],
    driver_factory: Callable[[], GpuDriver],
    reporter_factory: ReporterFactory = Reporter,
    stream: TextIO | None = None,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    roots: HostRoots | None = None,
) -> int:
    stream = stream or sys.stderr
    roots = roots or HostRoots()
    job: SlurmJob | None = None
    summary: RunSummary | None = None
    try:
        job = job_from_env(environ)
        if not job.gpus:
            return int(ExitCode.OK)  # a CPU job, or a node without GPUs: not gpugate's
        loaded = with_job_gpus(load_slurm_config(config_path, config_dir), job)
    except GateError as exc:
        print(f"gpugate: {exc.message}", file=stream)
        code, detail = exc.exit_code, exc.message
    else:
        job_id, node_name = job.job_id, job.node_name
        hook = Hook(
            phase,
            job.label,
            lambda: job_cgroup(job_id, roots.cgroup, node_name),
            metrics_unit=METRICS_UNIT,
        )
        reporter = reporter_factory(job.label, phase.value, fields=job_fields(job))
        outcome = run_hook(
            hook,
            loaded,
            reporter,
            roots=roots,
            dry_run=dry_run,
            driver_factory=driver_factory,
            stream=stream,
        )
        code, summary = outcome.exit_code, outcome.summary
        detail = outcome.error.message if outcome.error else failure_detail(outcome.summary)
    if dry_run or code in (ExitCode.OK, ExitCode.INTERRUPTED):
        return int(code)  # stopped: slurmd, which stopped it, drains the node itself
    drain(phase, job, detail, code, environ=environ, stream=stream, said=summary is None)
    return int(code)


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
    """A failed prolog or epilog: the drain reason, on stderr (unless an error said its one
    line already) and to slurmctld where the node is named."""
    who = f" job {job.job_id}" if job is not None else ""
    reason = f"gpugate {phase}{who}: {detail} (exit {int(code)})"[:MAX_REASON]
    if not said:
        print(f"gpugate: drain: {reason}", file=stream, flush=True)
    node = job.node_name if job is not None else environ.get("SLURMD_NODENAME")
    if node:
        set_drain_reason(node, reason, stream)
