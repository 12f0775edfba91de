"""`gpugate slurm prolog|epilog`: slurm.conf's Prolog= and Epilog= on a GPU node.

slurmd runs them as root with the job in the environment and no PATH. The job's GPUs
(SLURM_JOB_GPUS, else SLURM_STEP_GPUS, else CUDA_VISIBLE_DEVICES; indices or UUIDs) take the
place of the unit's, and the job's cgroup (cgroup v2: /system.slice/NODE_slurmstepd.scope/job_ID
as Debian's multiple-slurmd build names it, or /system.slice/slurmstepd.scope/job_ID, with
step_*/ below) the place of the unit's cgroup. At Prolog= and Epilog= time that cgroup often
does not exist (not yet, or no longer): then it holds no process, and every holder of the
job's GPUs is found by its device files and by NVML, and judged by the orphan rules.
A non-zero exit makes slurmd drain the node; where slurmd names the node (SLURMD_NODENAME)
and scontrol is there, the drain reason says which GPU holds how many MiB.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR, load_config
from gpugate.config.gpulist import GpuListError, GpuRef, parse_gpu_text
from gpugate.config.models import LoadedConfig
from gpugate.core.outcome import RunSummary
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import Hook, run_hook
from gpugate.host.nvml import GpuDriver
from gpugate.host.roots import HostRoots
from gpugate.report.journal import Reporter, ReporterFactory

JOB_SCOPE = "slurmstepd.scope"  # where Slurm's cgroup/v2 plugin puts every job
METRICS_UNIT = "slurm"  # one label for all jobs: a job ID label would grow without bound
CONFIG_NAME = "slurm.toml"
JOB_ID = re.compile(r"[1-9][0-9]{0,9}")
UID = re.compile(r"[0-9]{1,10}")
MAX_JOB_ID = 2**32 - 1
# Where slurmd says which GPUs a job has, in order: the prolog/epilog see SLURM_JOB_GPUS, an
# srun task sees SLURM_STEP_GPUS; CUDA_VISIBLE_DEVICES is what the job's programs see.
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES")
MAX_REASON = 250
# slurmd gives prologs and epilogs no PATH: look where Slurm is installed.
SCONTROL_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin", "/usr/local/sbin")
SCONTROL_TIMEOUT_S = 15


class SlurmEnvError(GateError):
    """The environment slurmd gave is not a job gpugate understands; nothing was touched."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    uid: int | None
    gpus: tuple[GpuRef, ...]  # NVML indices or UUIDs; () where the job has no GPU here
    gpus_from: str  # the variable they came from
    node_name: str | None  # SLURMD_NODENAME: Slurm's name for this node

    @property
    def label(self) -> str:
        """Stands for the unit in reports: GPUGATE_UNIT, stderr lines, decision reasons."""
        return f"slurm-job-{self.job_id}"


def job_from_env(environ: Mapping[str, str]) -> SlurmJob:
    raw_id = environ.get("SLURM_JOB_ID", "")
    if not JOB_ID.fullmatch(raw_id) or int(raw_id) > MAX_JOB_ID:
        shown = repr(raw_id) if raw_id else "not set"
        raise SlurmEnvError(f"SLURM_JOB_ID {shown}: not a Slurm job ID (a positive integer)")
    raw_uid = environ.get("SLURM_JOB_UID")
    if raw_uid is not None and not UID.fullmatch(raw_uid):
        raise SlurmEnvError(f"SLURM_JOB_UID {raw_uid!r}: not a user ID")
    gpus: tuple[GpuRef, ...] = ()
    source = next((name for name in GPU_VARIABLES if environ.get(name, "").strip()), "")
    if source:
        try:
            gpus = parse_gpu_text(environ[source])
        except GpuListError as exc:
            shown = repr(environ[source][:80])
            raise SlurmEnvError(f"{source} {shown}: {exc}") from None
    return SlurmJob(
        job_id=int(raw_id),
        uid=int(raw_uid) if raw_uid is not None else None,
        gpus=gpus,
        gpus_from=source,
        node_name=environ.get("SLURMD_NODENAME") or None,
    )


def stepd_scopes(cgroup_root: Path) -> list[Path]:
    """Every slurmstepd scope: `slurmstepd.scope`, or `NODE_slurmstepd.scope` (Debian builds
    Slurm with multiple-slurmd support, and the scope carries the node's name)."""
    scopes: list[Path] = []
    for parent in [cgroup_root, *sorted(cgroup_root.glob("*.slice"))]:
        scopes.extend(
            scope
            for scope in sorted(parent.glob(f"*{JOB_SCOPE}"))
            if scope.name == JOB_SCOPE or scope.name.endswith("_" + JOB_SCOPE)
        )
    return scopes


def job_cgroup(job_id: int, cgroup_root: Path, node_name: str | None = None) -> str:
    """The job's cgroup (cgroup v2). slurmd creates it after the prolog and removes it before
    the epilog; then the path it would have stands for it, and matches no process."""
    name = f"job_{job_id}"
    scopes = stepd_scopes(cgroup_root)
    for scope in scopes:
        if (scope / name).is_dir():
            return "/" + str((scope / name).relative_to(cgroup_root))
    names = [f"{node_name}_{JOB_SCOPE}"] if node_name else []
    preferred = [s for name in [*names, JOB_SCOPE] for s in scopes if s.name == name]
    for scope in preferred[:1] or scopes[:1]:
        return "/" + str((scope / name).relative_to(cgroup_root))
    return f"/system.slice/{JOB_SCOPE}/{name}"


def load_slurm_config(explicit: Path | None, config_dir: Path = DEFAULT_CONFIG_DIR) -> LoadedConfig:
    """--config PATH, else /etc/gpugate/slurm.toml, else default.toml, else built-in."""
    if explicit is None and (config_dir / CONFIG_NAME).exists():
        explicit = config_dir / CONFIG_NAME
    return load_config(None, explicit, config_dir)


def with_job_gpus(loaded: LoadedConfig, job: SlurmJob) -> LoadedConfig:
    config = loaded.config.model_copy(update={"gpus": job.gpus})
    return LoadedConfig(config, f"{loaded.source} (gpus from {job.gpus_from})")


def job_fields(job: SlurmJob) -> dict[str, str]:
    """On every journal entry of the job's run. OBJECT_SYSTEMD_UNIT names the scope that holds
    all jobs, so `journalctl -u slurmstepd.scope` lists gpugate's Slurm runs."""
    fields = {"GPUGATE_SLURM_JOB": str(job.job_id), "OBJECT_SYSTEMD_UNIT": JOB_SCOPE}
    if job.uid is not None:
        fields["GPUGATE_SLURM_JOB_UID"] = str(job.uid)
    return fields


def failure_detail(summary: RunSummary | None) -> str:
    """What went wrong, naming the GPUs and MiB where memory stayed used."""
    if summary is None:
        return "failed"
    exit_code = summary.exit_code
    gpus = ",".join(str(gpu.index) for gpu in summary.owned) or "none"
    if summary.busy:
        return "; ".join(
            f"GPU {item.gpu.index} ({item.gpu.uuid}) still {item.used_mib} MiB used"
            for item in summary.busy
        )
    if exit_code is ExitCode.UNKILLABLE:
        return f"GPU {gpus}: processes survived SIGKILL (D state?)"
    if exit_code is ExitCode.HELD_BY_OTHERS:
        return f"GPU {gpus}: held by processes gpugate may not kill (another job or unit)"
    return f"GPU {gpus}: {exit_code.name.lower()}"


def scontrol_path(environ: Mapping[str, str]) -> str | None:
    search = os.pathsep.join([environ.get("PATH", ""), *SCONTROL_DIRS])
    return shutil.which("scontrol", path=search)


def set_drain_reason(node: str, reason: str, environ: Mapping[str, str], stream: TextIO) -> None:
    """Best effort: drain the node first with gpugate's reason, so slurmctld keeps it when
    the failed prolog/epilog drains it too. slurmd drains the node anyway."""
    scontrol = scontrol_path(environ)
    if scontrol is None:
        return
    try:
        result = subprocess.run(
            [scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpugate: warning: scontrol: {exc}", file=stream)
        return
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        print(
            f"gpugate: warning: scontrol exited {result.returncode}: {said[0] if said else ''}",
            file=stream,
        )


def main(
    phase: str,
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
        reporter = reporter_factory(job.label, phase, fields=job_fields(job))
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
    who = f" job {job.job_id}" if job is not None else ""
    reason = f"gpugate {phase}{who}: {detail} (exit {int(code)})"[:MAX_REASON]
    if summary is not None:  # an error has said its one line already
        print(f"gpugate: drain: {reason}", file=stream, flush=True)
    node = job.node_name if job is not None else environ.get("SLURMD_NODENAME")
    if node:
        set_drain_reason(node, reason, environ, stream)
    return int(code)
