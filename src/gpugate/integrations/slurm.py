"""`gpugate slurm prolog|epilog` (slurm.conf's Prolog=/Epilog=, run by slurmd as root): the
job's GPUs are slurmd's numbers (integrations.gres_conf), its cgroup stands for the unit's, and
a non-zero exit drains the node with a reason naming what holds which GPU (docs/slurm.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gpugate.config.file import DEFAULT_CONFIG_DIR, LoadedConfig, replaced
from gpugate.config.values import GpuRef, parse_gpu_text
from gpugate.core.outcome import NullSurroundings
from gpugate.errors import ExitCode, GateError, InvalidValue
from gpugate.host.safe_files import find_program, run_program
from gpugate.integrations.config_files import load_config
from gpugate.report import lines
from gpugate.untrusted import echo

JOB_SCOPE = "slurmstepd.scope"  # where Slurm's cgroup/v2 plugin puts every job
METRICS_UNIT = "slurm"  # one label for all jobs: a job ID label would grow without bound
CONFIG_NAME = "slurm.toml"
JOB_ID = re.compile(r"[1-9][0-9]{0,9}")
UID = re.compile(r"[0-9]{1,10}")
MAX_JOB_ID = 2**32 - 1
# The prolog/epilog see SLURM_JOB_GPUS, an srun task SLURM_STEP_GPUS. Not CUDA_VISIBLE_DEVICES:
# in a task it is the task's own numbering, and alone it is not slurmd's.
GPU_VARIABLES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
NO_DEVICE_FILES = "NoDevFiles"  # Slurm before 15.08, for a gres without device files
SCONTROL_TIMEOUT_S = 15


class SlurmEnvError(GateError):
    """The environment slurmd gave is not a job gpugate understands; nothing was touched."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    uid: int | None
    gpus: tuple[int, ...]  # slurmd's numbers (gres.conf's order); () where it has no GPU here
    gpus_from: str  # the variable they came from
    node_name: str | None  # SLURMD_NODENAME: Slurm's name for this node
    no_gpus: str = ""  # the value that said "no GPU" (NoDevFiles, an empty list): said once

    @property
    def label(self) -> str:
        """Stands for the unit in reports: GPUGATE_UNIT, stderr lines, decision reasons."""
        return f"slurm-job-{self.job_id}"


def job_from_env(environ: Mapping[str, str]) -> SlurmJob:
    raw_id = environ.get("SLURM_JOB_ID", "")
    if not JOB_ID.fullmatch(raw_id) or int(raw_id) > MAX_JOB_ID:
        raise SlurmEnvError(
            f"SLURM_JOB_ID {(echo(raw_id) if raw_id else 'not set')}: not a Slurm job ID (a "
            "positive integer)"
        )
    raw_uid = environ.get("SLURM_JOB_UID")
    if raw_uid is not None and not UID.fullmatch(raw_uid):
        raise SlurmEnvError(f"SLURM_JOB_UID {raw_uid!r}: not a user ID")
    gpus: tuple[int, ...] = ()
    source = next((name for name in GPU_VARIABLES if environ.get(name, "").strip()), "")
    said = "" if source else next((f"{n}=" for n in GPU_VARIABLES if n in environ), "")
    if source and environ[source].strip() == NO_DEVICE_FILES:
        said = f"{source}={NO_DEVICE_FILES}"
    elif source:
        gpus = gpu_numbers(source, environ[source])
    return SlurmJob(
        job_id=int(raw_id),
        uid=int(raw_uid) if raw_uid is not None else None,
        gpus=gpus,
        gpus_from=source,
        node_name=environ.get("SLURMD_NODENAME") or None,
        no_gpus=said,
    )


def gpu_numbers(variable: str, value: str) -> tuple[int, ...]:
    """slurmd's numbers: `0,1,5`, each once (a UUID or a range is none of slurmd's)."""
    try:
        refs = parse_gpu_text(value)
        text = next((ref for ref in refs if isinstance(ref, str)), None)
        if text is not None:
            raise InvalidValue(
                f"{echo(text)} is not a GPU number slurmd writes (0, 1, ... as gres.conf lists "
                "them)"
            )
    except InvalidValue as exc:
        raise SlurmEnvError(f"{variable} {echo(value)}: {exc}") from None
    return tuple(ref for ref in refs if isinstance(ref, int))


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


def with_job_gpus(loaded: LoadedConfig, gpus: tuple[GpuRef, ...], note: str) -> LoadedConfig:
    """The config with the job's GPUs: their UUIDs, or () where slurmd's numbers could not be
    resolved (the job's cgroup only)."""
    return LoadedConfig(replaced(loaded.config, gpus=gpus), f"{loaded.source} ({note})")


def job_surroundings(loaded: LoadedConfig) -> NullSurroundings:
    """A Slurm job's (loaded: with_job_gpus's). Slurm gives out its GPUs itself and drains a
    node whose prolog or epilog fails: no lease is checked, taken or recorded."""
    return NullSurroundings(loaded, gpu_source=f"gpus in {loaded.source}")


def job_fields(job: SlurmJob) -> dict[str, str]:
    """On every journal entry of the job's run (`journalctl -u slurmstepd.scope` lists them)."""
    fields = {"GPUGATE_SLURM_JOB": str(job.job_id), "OBJECT_SYSTEMD_UNIT": JOB_SCOPE}
    if job.uid is not None:
        fields["GPUGATE_SLURM_JOB_UID"] = str(job.uid)
    return fields


def set_drain_reason(node: str, reason: str, stream: TextIO) -> None:
    """Best effort: drain the node first with gpugate's reason, which slurmctld keeps when
    the failed hook drains it too. scontrol from the system folders: the job's PATH must not
    choose it."""
    scontrol = find_program("scontrol")
    if scontrol is None:
        return
    try:
        result = run_program(
            [scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
            SCONTROL_TIMEOUT_S,
        )
    except GateError as exc:
        print(lines.warning(exc.message), file=stream)
        return
    if result.returncode != 0:
        said = f"scontrol exited {result.returncode}: {result.first_line()}"
        print(lines.warning(said), file=stream)
