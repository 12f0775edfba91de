"""The unit's gpugate configuration: the pydantic models of its fields, and the loaded result.

Where the file is found and how it is read is `config_file`. Only what an operator sets
lives here; where gpugate looks (/dev, /proc, the cgroup tree) is `host.HostRoots`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gpugate.config.gpulist import GpuRef, gpu_refs
from gpugate.errors import GateError, InvalidValue
from gpugate.host.systemd import validate_unit_name
from gpugate.phase import Phase
from gpugate.untrusted import echo

DEFAULT_LOCK_DIR = Path("/run/gpugate")
BUILTIN_SOURCE = "built-in defaults"
CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")  # docker's and podman's rule

DEFAULT_PROTECTED_EXECUTABLES = (
    "/usr/bin/nvidia-persistenced",
    "/usr/bin/nv-hostengine",
    "/usr/bin/dcgm-exporter",
    "/usr/bin/nvidia-smi",
    "/usr/bin/Xorg",
    "/usr/lib/xorg/Xorg",
)
DEFAULT_PROTECTED_UNITS = (
    "nvidia-persistenced.service",
    "nvidia-dcgm.service",
    "dcgm-exporter.service",
    "nvidia-fabricmanager.service",
    "display-manager.service",
)

# private_shm: tmpfs's size= (a percentage of RAM, or k/m/g), or "off".
DEFAULT_PRIVATE_SHM = "50%"
PRIVATE_SHM_OFF = "off"
PRIVATE_SHM_SIZE = re.compile(r"(?:[1-9][0-9]?%|100%|[1-9][0-9]{0,8}[kmg])")

GpuSelection = Union[Literal["all"], tuple[GpuRef, ...]]  # resolved: what a run owns
GpusSetting = Union[Literal["auto"], GpuSelection]  # as written; "auto" is resolved by gpu_source


class _Frozen(BaseModel):
    # strict: TOML has real types, so "yes" is no bool and "2048" no number (an int is a float).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PhasePolicy(_Frozen):
    """What one phase (pre, post, prolog, epilog) may kill and how long it waits."""

    kill_orphans: bool = Field(
        default=True,
        description="Kill holders outside any unit (a server started by hand from ssh)?",
    )
    kill_app_tree: bool = Field(
        default=True,
        description="Also kill the rest of such a holder's application (never a login shell).",
    )
    sigterm_grace_s: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds between SIGTERM and SIGKILL."
    )
    sigkill_wait_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Seconds after SIGKILL before a survivor is reported.",
    )
    wait_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description="Deadline for the whole run (kill and memory wait), in seconds.",
    )
    on_timeout: Literal["fail", "warn"] = Field(
        default="fail",
        description='Memory not freed by the deadline: "fail" (the run fails) or "warn".',
    )
    on_nvml_error: Literal["fail", "warn"] = Field(
        default="fail",
        description='NVML unusable: "fail" (the run fails) or "warn" (clean the cgroup only).',
    )
    remove_shm: bool = Field(
        default=True,
        description="Remove the /dev/shm files the killed processes held open or mapped, once "
        "they are gone, where no other process holds them (docs/shared-memory.md).",
    )

    @model_validator(mode="after")
    def _kill_fits_in_deadline(self) -> PhasePolicy:
        kill_s = self.sigterm_grace_s + self.sigkill_wait_s
        if kill_s >= self.wait_timeout_s:
            raise InvalidValue(
                f"sigterm_grace_s + sigkill_wait_s ({kill_s:g} s) must be below wait_timeout_s "
                f"({self.wait_timeout_s:g} s), which also holds the memory wait"
            )
        return self


# gpugate-sweep.timer's OnUnitActiveSec= (units/; tests/commands/test_sweep.py checks they agree)
SWEEP_INTERVAL_S = 60
MAX_SWEEP_AGE_S = 30 * 86400


class SweepPolicy(_Frozen):
    """`gpugate sweep` (the gpugate-sweep.timer): what it may do to GPU memory nobody owns."""

    reap_after_s: Optional[float] = Field(
        default=None,
        le=MAX_SWEEP_AGE_S,
        description="Kill a holder unowned this many seconds, with pre's rules, on GPUs "
        "nothing holds a lease on (not set: report only).",
    )
    drain_after_s: Optional[float] = Field(
        default=None,
        le=MAX_SWEEP_AGE_S,
        description="Where slurmd runs: drain the node once a GPU holds memory unowned this "
        "many seconds (not set: never).",
    )

    @field_validator("reap_after_s", "drain_after_s")
    @classmethod
    def _not_below_interval(cls, value: float | None) -> float | None:
        if value is not None and value < SWEEP_INTERVAL_S:
            raise InvalidValue(
                f"{value} s is below the sweep timer's interval ({SWEEP_INTERVAL_S} s): a holder "
                "could not be seen unowned that long by two sweeps"
            )
        return value


def _phase_defaults(phase: Phase) -> dict[str, bool]:
    kills = phase.traits.kills_orphans
    return {"kill_orphans": kills, "kill_app_tree": kills}


def default_policy(phase: Phase) -> PhasePolicy:
    kills = phase.traits.kills_orphans
    return PhasePolicy(kill_orphans=kills, kill_app_tree=kills)


class GateConfig(_Frozen):
    gpus: GpusSetting = Field(
        default="auto",
        description='The unit\'s GPUs: "auto" (its own CUDA_VISIBLE_DEVICES, else '
        'NVIDIA_VISIBLE_DEVICES, else all), "all", or indices, UUIDs and MIG slices, e.g. '
        '[0, 1] or ["MIG-..."].',
    )
    free_mib: int = Field(
        default=1024,
        ge=1,
        description="Per GPU, MiB used at or below which the GPU counts as free (drivers keep "
        "some).",
    )
    kill_other_units: bool = Field(
        default=False,
        description="May processes of another active unit holding these GPUs be killed?",
    )
    share_gpus: bool = Field(
        default=False,
        description="May this unit hold its GPUs together with another unit that also shares?",
    )
    protected_executables: tuple[str, ...] = Field(
        default=DEFAULT_PROTECTED_EXECUTABLES,
        strict=False,  # a TOML list becomes the tuple
        description="Never killed, by exact /proc/PID/exe path.",
    )
    protected_units: tuple[str, ...] = Field(
        default=DEFAULT_PROTECTED_UNITS,
        strict=False,
        description="Never killed, by the unit their cgroup belongs to.",
    )
    ports: tuple[Annotated[int, Field(strict=True, ge=1, le=65535)], ...] = Field(
        default=(),
        strict=False,  # a TOML list becomes the tuple; each port stays a strict int
        description="The unit's TCP ports: before it starts (pre), a process listening on one "
        "is a holder like a GPU holder, and pre returns once they are free.",
    )
    pre: PhasePolicy = default_policy(Phase.PRE)
    post: PhasePolicy = default_policy(Phase.POST)
    prolog: PhasePolicy = default_policy(Phase.PROLOG)  # Slurm's Prolog= and Epilog=
    epilog: PhasePolicy = default_policy(Phase.EPILOG)
    sweep: SweepPolicy = SweepPolicy()
    lock_dir: Path = Field(
        default=DEFAULT_LOCK_DIR,
        strict=False,  # a TOML string becomes the Path
        description="Folder of gpugate's per-GPU locks (best on a tmpfs such as /run).",
    )
    metrics_textfile: Optional[Path] = Field(
        default=None,
        strict=False,
        description="node_exporter textfile rewritten after each run (not set: no metrics).",
    )
    containers: tuple[str, ...] = Field(
        default=(),
        strict=False,  # a TOML list becomes the tuple
        description="Containers (names or ids) that are the unit's own (`docker run --name`).",
    )
    shm_min_free_mib: Optional[int] = Field(
        default=None,
        ge=1,
        description="pre (and prolog) fail with exit 29 when /dev/shm has less free after their "
        "cleanup (not set: no check).",
    )

    private_shm: str = Field(
        default=DEFAULT_PRIVATE_SHM,
        description="The unit's own /dev/shm, which the kernel frees when its last process ends: "
        'its size ("50%" of RAM, "64g", "16384m"; what `gpugate install` and `gpugate run` '
        'write as TemporaryFileSystem=/dev/shm), or "off": the unit shares the host\'s.',
    )

    @field_validator("private_shm")
    @classmethod
    def _tmpfs_size(cls, value: str) -> str:
        # It goes into the drop-in's TemporaryFileSystem= line: nothing but a size passes.
        if value != PRIVATE_SHM_OFF and not PRIVATE_SHM_SIZE.fullmatch(value):
            raise InvalidValue(
                f'{echo(value)}: "off", a percentage of RAM ("50%") or a size in k, m or g ("64g")'
            )
        return value

    @field_validator("post", mode="before")
    @classmethod
    def _post_defaults(cls, value: object) -> object:
        # A partial [post] table keeps post's own defaults for the keys it leaves out.
        if isinstance(value, dict):
            return {**_phase_defaults(Phase.POST), **value}
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: object) -> object:
        if value in ("all", "auto"):
            return value
        if not isinstance(value, (list, tuple)):
            raise InvalidValue(
                'must be "all", "auto" or a list of GPU indices or UUIDs, e.g. [0, 1]'
            )
        return gpu_refs(value)

    @field_validator("protected_executables")
    @classmethod
    def _absolute_executables(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/"):
                raise InvalidValue(
                    f"{echo(path)} is not an absolute path" if path else "must be an absolute path"
                )
        return value

    @field_validator("protected_units")
    @classmethod
    def _unit_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            try:
                validate_unit_name(name)
            except GateError:
                raise InvalidValue(
                    f"{echo(name)} is not a service or scope unit name with its suffix (e.g. "
                    "nvidia-persistenced.service)"
                ) from None
        return value

    @field_validator("containers")
    @classmethod
    def _container_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not CONTAINER_NAME.fullmatch(item):
                raise InvalidValue(f"{echo(item)} is not a container name or id")
        if len(set(value)) != len(value):
            raise InvalidValue("lists a container twice")
        return value

    @field_validator("metrics_textfile", "lock_dir")
    @classmethod
    def _absolute_path(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise InvalidValue("must be an absolute path")
        return value

    def selection(self) -> GpuSelection:
        """The GPUs once gpu_source resolved them ("auto" left unresolved: every GPU)."""
        return "all" if self.gpus == "auto" else self.gpus

    def changed(self, **changes: object) -> GateConfig:
        """A copy with these fields changed, validated as a file's are (strict: a tuple field
        takes a tuple). pydantic's model_copy(update=) validates nothing: a list kept in a
        tuple field made every dump warn (`gpugate run --port`)."""
        return GateConfig.model_validate({**dict(self), **changes})

    def policy(self, phase: Phase) -> PhasePolicy:
        policies = {
            Phase.PRE: self.pre,
            Phase.POST: self.post,
            Phase.PROLOG: self.prolog,
            Phase.EPILOG: self.epilog,
        }
        return policies[phase]


@dataclass(frozen=True)
class LoadedConfig:
    config: GateConfig
    source: str  # the file it came from, or BUILTIN_SOURCE
