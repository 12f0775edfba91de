"""The config's built-in defaults and the forms of its values, without pydantic: what a run
reads when no file sets anything (most units), at no cost beyond this module.

`DefaultConfig` has the attribute names and types of `config.schema.GateConfig`, pydantic's
model of a file, and its defaults are the model's (the model takes them from here); where a
file sets anything the model validates it (`config.file`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from gpugate.config.gpulist import GpuRef
from gpugate.phase import Phase

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


# gpugate-sweep.timer's OnUnitActiveSec= (units/; tests/commands/test_sweep.py checks they agree)
SWEEP_INTERVAL_S = 60
MAX_SWEEP_AGE_S = 30 * 86400


@dataclass(frozen=True)
class DefaultSweep:
    """`gpugate sweep`'s policy as built in (config.schema.SweepPolicy's fields and defaults)."""

    reap_after_s: Optional[float] = None
    drain_after_s: Optional[float] = None


@dataclass(frozen=True)
class DefaultPolicy:
    """One phase's policy as built in (config.schema.PhasePolicy's fields and defaults)."""

    kill_orphans: bool = True
    kill_app_tree: bool = True
    sigterm_grace_s: float = 10.0
    sigkill_wait_s: float = 5.0
    wait_timeout_s: float = 120.0
    on_timeout: Literal["fail", "warn"] = "fail"
    on_nvml_error: Literal["fail", "warn"] = "fail"
    remove_shm: bool = True

    @classmethod
    def of(cls, phase: Phase) -> DefaultPolicy:
        kills = phase.traits.kills_orphans
        return cls(kill_orphans=kills, kill_app_tree=kills)


_BUILT_IN = {phase: DefaultPolicy.of(phase) for phase in Phase}


@dataclass(frozen=True)
class DefaultConfig:
    """The config as built in (config.schema.GateConfig's fields and defaults)."""

    gpus: GpusSetting = "auto"
    free_mib: int = 1024
    kill_other_units: bool = False
    share_gpus: bool = False
    protected_executables: tuple[str, ...] = DEFAULT_PROTECTED_EXECUTABLES
    protected_units: tuple[str, ...] = DEFAULT_PROTECTED_UNITS
    ports: tuple[int, ...] = ()
    pre: DefaultPolicy = _BUILT_IN[Phase.PRE]
    post: DefaultPolicy = _BUILT_IN[Phase.POST]
    prolog: DefaultPolicy = _BUILT_IN[Phase.PROLOG]
    epilog: DefaultPolicy = _BUILT_IN[Phase.EPILOG]
    sweep: DefaultSweep = DefaultSweep()
    lock_dir: Path = DEFAULT_LOCK_DIR
    metrics_textfile: Optional[Path] = None
    containers: tuple[str, ...] = ()
    shm_min_free_mib: Optional[int] = None
    private_shm: str = DEFAULT_PRIVATE_SHM

    def selection(self) -> GpuSelection:
        """The GPUs once gpu_source resolved them ("auto" left unresolved: every GPU)."""
        return "all" if self.gpus == "auto" else self.gpus

    def with_gpus(self, gpus: GpuSelection) -> DefaultConfig:
        """A copy owning these GPUs (a selection the one GPU-list parser or NVML made)."""
        return dataclasses.replace(self, gpus=gpus)

    def policy(self, phase: Phase) -> DefaultPolicy:
        return {
            Phase.PRE: self.pre,
            Phase.POST: self.post,
            Phase.PROLOG: self.prolog,
            Phase.EPILOG: self.epilog,
        }[phase]


DEFAULTS = DefaultConfig()
