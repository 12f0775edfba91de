"""`gpugate slurm prolog|epilog`: a Slurm job's hook run, and the drain reason when it fails
(what a job is and where its cgroup lives: gpugate.integrations.slurm)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR
from gpugate.config.models import LoadedConfig
from gpugate.core.outcome import RunSummary
from gpugate.core.run import RunDeps
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Deps, Hook, run_hook
from gpugate.integrations.slurm import (
    MAX_REASON,
    METRICS_UNIT,
    JobSurroundings,
    SlurmJob,
    job_cgroup,
    job_fields,
    job_from_env,
    load_slurm_config,
    set_drain_reason,
    with_job_gpus,
)
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.journal import Reporter, ReporterFactory
from gpugate.report.lines import failure_detail


@dataclass(frozen=True)
class SlurmDeps:
    """What `gpugate slurm` reaches outside itself through (tests give stand-ins)."""

    environ: Mapping[str, str]  # slurmd's: the job
    reporter_factory: ReporterFactory = Reporter
    run: RunDeps = field(default_factory=RunDeps)
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    config_dir: Path = DEFAULT_CONFIG_DIR


def run_slurm_hook(
    phase: Phase, config_path: Path | None, *, dry_run: bool, deps: SlurmDeps
) -> int:
    environ, stream = deps.environ, deps.stream
    job: SlurmJob | None = None
    summary: RunSummary | None = None
    try:
        job = job_from_env(environ)
        if not job.gpus:
            return int(ExitCode.OK)  # a CPU job, or a node without GPUs: not gpugate's
        loaded = with_job_gpus(load_slurm_config(config_path, deps.config_dir), job)
    except GateError as exc:
        detail = exc.message
        print(lines.error(detail), file=stream)
        code = exc.exit_code
    else:
        code, summary, detail = run_job(phase, job, loaded, dry_run=dry_run, deps=deps)
    if dry_run or code in (ExitCode.OK, ExitCode.INTERRUPTED):
        return int(code)  # stopped: slurmd, which stopped it, drains the node itself
    drain(phase, job, detail, code, environ=environ, stream=stream, said=summary is None)
    return int(code)


def run_job(
    phase: Phase, job: SlurmJob, loaded: LoadedConfig, *, dry_run: bool, deps: SlurmDeps
) -> tuple[ExitCode, RunSummary | None, str]:
    """The job's hook run: its exit code, summary and what a drain reason would say."""
    job_id, node_name, cgroup_root = job.job_id, job.node_name, deps.run.roots.cgroup
    hook = Hook(
        phase,
        job.label,
        lambda: job_cgroup(job_id, cgroup_root, node_name),
        metrics_unit=METRICS_UNIT,
        surroundings=lambda scope, loaded, reporter: JobSurroundings.of(loaded, job),
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
    """A failed prolog or epilog: the drain reason, on stderr (unless an error said its one
    line already) and to slurmctld where the node is named."""
    who = f" job {job.job_id}" if job is not None and job.job_id is not None else ""
    reason = f"gpugate {phase.value}{who}: {detail} (exit {int(code)})"[:MAX_REASON]
    if not said:
        print(lines.error(f"drain: {reason}"), file=stream, flush=True)
    node = job.node_name if job is not None else environ.get("SLURMD_NODENAME")
    if node:
        set_drain_reason(node, reason, stream)
