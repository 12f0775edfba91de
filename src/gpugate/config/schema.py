"""pydantic's models of a config file: strict (TOML has real types), frozen, no unknown key; loaded
only where a file sets something (`config.file.pydantic_config`), with `config.values`' defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from gpugate.config import values
from gpugate.errors import GateError, InvalidValue
from gpugate.host.systemd import validate_unit_name
from gpugate.phase import Phase
from gpugate.untrusted import echo

_P = values.DefaultPolicy  # each field's default is the built-in one
_S = values.DefaultSweep
_C = values.DefaultConfig
# Not strict: a TOML list becomes the tuple, a TOML string the Path.
_Names = Annotated[tuple[str, ...], Strict(False)]
_Path = Annotated[Path, Strict(False)]
_Seconds = Annotated[float, Field(gt=0, le=3600)]
_MiB = Annotated[int, Field(ge=1)]
_SweepAge = Optional[Annotated[float, Field(le=values.MAX_SWEEP_AGE_S)]]


class _Frozen(BaseModel):
    # strict: TOML has real types, so "yes" is no bool and "2048" no number (an int is a float).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PhasePolicy(_Frozen):
    """What one phase (pre, post, prolog, epilog) may kill and how long it waits."""

    kill_orphans: bool = Field(
        default=_P.kill_orphans,
        description="Kill holders outside any unit (a server started by hand from ssh)?",
    )
    kill_app_tree: bool = Field(
        default=_P.kill_app_tree,
        description="Also kill the rest of such a holder's application (never a login shell).",
    )
    sigterm_grace_s: _Seconds = Field(
        default=_P.sigterm_grace_s, description="Seconds between SIGTERM and SIGKILL."
    )
    sigkill_wait_s: _Seconds = Field(
        default=_P.sigkill_wait_s,
        description="Seconds after SIGKILL before a survivor is reported.",
    )
    wait_timeout_s: float = Field(
        default=_P.wait_timeout_s,
        gt=0,
        le=86400,
        description="Deadline for the whole run (kill and memory wait), in seconds.",
    )
    on_timeout: Literal["fail", "warn"] = Field(
        default=_P.on_timeout,
        description='Memory not freed by the deadline: "fail" (the run fails) or "warn".',
    )
    on_nvml_error: Literal["fail", "warn"] = Field(
        default=_P.on_nvml_error,
        description='NVML unusable: "fail" (the run fails) or "warn" (clean the cgroup only).',
    )
    remove_shm: bool = Field(
        default=_P.remove_shm,
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


class SweepPolicy(_Frozen):
    """`gpugate sweep` (the gpugate-sweep.timer): what it may do to GPU memory nobody owns."""

    reap_after_s: _SweepAge = Field(
        default=_S.reap_after_s,
        description="Kill a holder unowned this many seconds, with pre's rules, on GPUs "
        "nothing holds a lease on (not set: report only).",
    )
    drain_after_s: _SweepAge = Field(
        default=_S.drain_after_s,
        description="Where slurmd runs: drain the node once a GPU holds memory unowned this "
        "many seconds (not set: never).",
    )
    reap_sessions: bool = Field(
        default=_S.reap_sessions,
        description="Reap (reap_after_s) a holder in a logind session its user is still logged "
        "in to, as one nobody owns (not set: shown as owner `session`, never reaped).",
    )

    @field_validator("reap_after_s", "drain_after_s")
    @classmethod
    def _not_below_interval(cls, value: float | None) -> float | None:
        if value is not None and value < values.SWEEP_INTERVAL_S:
            raise InvalidValue(
                f"{value} s is below the sweep timer's interval ({values.SWEEP_INTERVAL_S} s): "
                "a holder could not be seen unowned that long by two sweeps"
            )
        return value


def _built_in(policy: values.DefaultPolicy) -> PhasePolicy:
    return PhasePolicy(**dataclasses.asdict(policy))


class GateConfig(_Frozen):
    gpus: values.GpusSetting = Field(
        default=_C.gpus,
        description='The unit\'s GPUs: "auto" (its own CUDA_VISIBLE_DEVICES, else '
        'NVIDIA_VISIBLE_DEVICES, else all), "all", or indices, UUIDs and MIG slices, e.g. '
        '[0, 1] or ["MIG-..."].',
    )
    free_mib: _MiB = Field(
        default=_C.free_mib,
        description="Per GPU, MiB used at or below which the GPU counts as free (drivers keep "
        "some).",
    )
    kill_other_units: bool = Field(
        default=_C.kill_other_units,
        description="May processes of another active unit holding these GPUs be killed? "
        "(Never a way to share a GPU: that is share_gpus.)",
    )
    share_gpus: bool = Field(
        default=_C.share_gpus,
        description="Share these GPUs on purpose with other units, runs and containers that "
        "share them: their processes are never killed or waited for; orphans still are.",
    )
    protected_executables: _Names = Field(
        default=_C.protected_executables, description="Never killed, by exact /proc/PID/exe path."
    )
    protected_units: _Names = Field(
        default=_C.protected_units, description="Never killed, by the unit their cgroup belongs to."
    )
    ports: tuple[Annotated[int, Field(strict=True, ge=1, le=65535)], ...] = Field(
        default=_C.ports,
        strict=False,  # a TOML list becomes the tuple; each port stays a strict int
        description="The unit's TCP ports: before it starts (pre), a process listening on one "
        "is a holder like a GPU holder, and pre returns once they are free.",
    )
    pre: PhasePolicy = _built_in(values.DEFAULTS.pre)
    post: PhasePolicy = _built_in(values.DEFAULTS.post)
    prolog: PhasePolicy = _built_in(values.DEFAULTS.prolog)  # Slurm's Prolog= and Epilog=
    epilog: PhasePolicy = _built_in(values.DEFAULTS.epilog)
    sweep: SweepPolicy = SweepPolicy()
    lock_dir: _Path = Field(
        default=_C.lock_dir,
        description="Folder of gpugate's per-GPU locks (best on a tmpfs such as /run).",
    )
    metrics_textfile: Optional[_Path] = Field(
        default=_C.metrics_textfile,
        description="node_exporter textfile rewritten after each run (not set: no metrics).",
    )
    containers: _Names = Field(
        default=_C.containers,
        description="Containers (names or ids) that are the unit's own (`docker run --name`).",
    )
    shm_min_free_mib: Optional[_MiB] = Field(
        default=_C.shm_min_free_mib,
        description="pre (and prolog) fail with exit 29 when /dev/shm has less free after their "
        "cleanup (not set: no check).",
    )
    private_shm: str = Field(
        default=_C.private_shm,
        description="The unit's own /dev/shm, which the kernel frees when its last process ends: "
        'its size ("50%" of RAM, "64g", "16384m"; what `gpugate install` and `gpugate run` '
        'write as TemporaryFileSystem=/dev/shm), or "off": the unit shares the host\'s.',
    )

    @field_validator("private_shm")
    @classmethod
    def _tmpfs_size(cls, value: str) -> str:
        # It goes into the drop-in's TemporaryFileSystem= line: nothing but a size passes.
        if value != values.PRIVATE_SHM_OFF and not values.PRIVATE_SHM_SIZE.fullmatch(value):
            raise InvalidValue(
                f'{echo(value)}: "off", a percentage of RAM ("50%") or a size in k, m or g ("64g")'
            )
        return value

    @field_validator("post", mode="before")
    @classmethod
    def _post_defaults(cls, value: object) -> object:
        # A partial [post] table keeps post's own defaults for the keys it leaves out.
        if isinstance(value, dict):
            return {**dataclasses.asdict(values.DEFAULTS.post), **value}
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
        return values.gpu_refs(value)

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
            if not values.CONTAINER_NAME.fullmatch(item):
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

    def selection(self) -> values.GpuSelection:
        """The GPUs once "auto" is resolved (left unresolved: every GPU)."""
        return "all" if self.gpus == "auto" else self.gpus

    def changed(self, **changes: object) -> GateConfig:
        """A copy with these fields changed, validated as a file's are (model_copy does not)."""
        return GateConfig.model_validate({**dict(self), **changes})

    def policy(self, phase: Phase) -> PhasePolicy:
        policy: PhasePolicy = getattr(self, phase.value)  # a field per phase, named after it
        return policy
