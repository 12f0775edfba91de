"""`gpus = "auto"`: the GPUs a unit names for itself in the environment systemd gives it.

First CUDA_VISIBLE_DEVICES (indices or UUIDs), else NVIDIA_VISIBLE_DEVICES (the container
toolkit's variable: indices, UUIDs, `all`, `none`/`void`), else every GPU. Both come from the
unit's Environment= and EnvironmentFile= lines as systemd resolves them, never from
gpugate's own environment (a hand-typed run would see the shell's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpugate.config.gpulist import GpuRef, parse_gpu_text
from gpugate.config.models import LoadedConfig
from gpugate.config.values import BUILTIN_SOURCE, GpuSelection
from gpugate.errors import ConfigError, InvalidValue
from gpugate.host.systemd import UnitEnvironment, unit_environment
from gpugate.untrusted import echo

VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
NO_GPU = {"", "-1"}  # CUDA: an empty list or a first entry of -1 hides every GPU
NVIDIA_NO_GPU = {"", "none", "void"}


@dataclass(frozen=True)
class GpuChoice:
    gpus: GpuSelection  # "all", or the GPUs ((): the unit uses none)
    source: str  # said in the run's first journal entry and by `config check --unit`
    warn: bool = False  # all GPUs only because nothing named them, and no config file
    named: bool = True  # False: every GPU by default, because nothing named the unit's
    config_note: str = ""  # added to the config's source where the choice overrode its gpus


def parse_visible_devices(variable: str, value: str, where: str) -> GpuSelection:
    """A *_VISIBLE_DEVICES value: "all" or a tuple of indices and UUIDs."""
    text = value.strip()
    lowered = text.lower()
    if variable == "NVIDIA_VISIBLE_DEVICES":
        if lowered == "all":
            return "all"
        if lowered in NVIDIA_NO_GPU:
            return ()
    if text in NO_GPU or text.split(",")[0].strip() == "-1":
        return ()
    try:
        gpus: tuple[GpuRef, ...] = parse_gpu_text(text)
    except InvalidValue as exc:
        raise ConfigError(where, variable, f"{echo(value)}: {exc}") from None
    return gpus


def choose_gpus(
    unit: str | None,
    loaded: LoadedConfig,
    environment: Callable[[str], UnitEnvironment | None] | None = None,
) -> GpuChoice:
    """environment: the unit's environment (default: ask systemd)."""
    config = loaded.config
    environment = environment or unit_environment
    if config.gpus != "auto":
        return GpuChoice(config.gpus, f"gpus in {loaded.source}")
    env = environment(unit) if unit else None
    if env is not None:
        for variable in VARIABLES:
            if variable in env.variables:
                where = f"unit {unit}: {env.origin(variable)}"
                gpus = parse_visible_devices(variable, env.variables[variable], where)
                return GpuChoice(gpus, f"{variable} of {unit} ({env.origin(variable)})")
    why = f"{unit} sets neither {' nor '.join(VARIABLES)}" if unit else "no unit"
    if env is None and unit:
        why = "systemd cannot be asked for the unit's environment"
    if loaded.source == BUILTIN_SOURCE:
        return GpuChoice(
            "all",
            f"all GPUs: {why} and no config file names gpus (set gpus, or the unit's "
            "CUDA_VISIBLE_DEVICES)",
            warn=True,
            named=False,
        )
    return GpuChoice("all", f'all GPUs: {why} (gpus = "auto" in {loaded.source})', named=False)


def with_chosen_gpus(loaded: LoadedConfig, choice: GpuChoice) -> LoadedConfig:
    """The config with gpus replaced by the choice: the one step every run's GPUs are chosen
    by (a unit's hook, a Slurm job's, `config check`, `status`). Its source is kept, with
    the choice's note where it has one (a Slurm job's "gpus from SLURM_JOB_GPUS")."""
    config = loaded.config.with_gpus(choice.gpus)
    note = f" ({choice.config_note})" if choice.config_note else ""
    return LoadedConfig(config, f"{loaded.source}{note}")
