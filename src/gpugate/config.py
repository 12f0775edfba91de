"""The unit's gpugate configuration: pydantic models and where they are read from.

Lookup for UNIT (first that exists): --config PATH, /etc/gpugate/UNIT.toml, for a template
instance /etc/gpugate/NAME@.service.toml, /etc/gpugate/default.toml, else built-in defaults.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpugate.errors import ConfigError

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
BUILTIN_SOURCE = "built-in defaults"

UUID_PATTERN = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,}$")
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

GpuRef = Annotated[int, Field(ge=0, le=1023)] | str


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PhasePolicy(_Frozen):
    """What one phase (pre or post) may kill and how long it waits."""

    kill_orphans: bool = True
    kill_app_tree: bool = True
    sigterm_grace_s: float = Field(default=10.0, gt=0, le=3600)
    sigkill_wait_s: float = Field(default=5.0, gt=0, le=3600)
    wait_timeout_s: float = Field(default=120.0, gt=0, le=86400)
    on_timeout: Literal["fail", "warn"] = "fail"
    on_nvml_error: Literal["fail", "warn"] = "fail"


class Paths(_Frozen):
    """Production roots; tests point them at stand-ins."""

    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    lock_dir: Path = Path("/run/gpugate")

    @field_validator("dev_root", "proc_root", "cgroup_root", "lock_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value


class GateConfig(_Frozen):
    gpus: Literal["all"] | tuple[GpuRef, ...] = "all"
    free_mib: int = Field(default=1024, ge=0)
    kill_other_units: bool = False
    protected_executables: tuple[str, ...] = DEFAULT_PROTECTED_EXECUTABLES
    protected_units: tuple[str, ...] = DEFAULT_PROTECTED_UNITS
    pre: PhasePolicy = PhasePolicy()
    post: PhasePolicy = PhasePolicy(kill_orphans=False, kill_app_tree=False)
    # Slurm's Prolog= and Epilog=: the job is over at the epilog, so its leftovers die too.
    prolog: PhasePolicy = PhasePolicy()
    epilog: PhasePolicy = PhasePolicy()
    paths: Paths = Paths()
    metrics_textfile: Path | None = None  # node_exporter textfile, rewritten after each run
    # Containers (names or ids) whose processes are the unit's own: `docker run --name vllm`.
    containers: tuple[str, ...] = ()

    @field_validator("post", mode="before")
    @classmethod
    def _post_defaults(cls, value: object) -> object:
        # A partial [post] table keeps post's own defaults for the keys it leaves out.
        if isinstance(value, dict):
            return {"kill_orphans": False, "kill_app_tree": False, **value}
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_list(cls, value: object) -> object:
        if value != "all" and not isinstance(value, list | tuple):
            raise ValueError('must be "all" or a list of GPU indices or UUIDs, e.g. [0, 1]')
        if isinstance(value, list):
            if not value:
                raise ValueError('must name at least one GPU, or be "all"')
            for item in value:
                if isinstance(item, bool) or not isinstance(item, int | str):
                    raise ValueError("each GPU is an index (0, 1, ...) or a UUID string")
                if isinstance(item, str) and not UUID_PATTERN.match(item):
                    raise ValueError(f"{item!r} is not a GPU UUID (GPU-xxxxxxxx-...)")
            if len(set(value)) != len(value):
                raise ValueError("lists a GPU twice")
            return tuple(value)
        return value

    @field_validator("protected_executables")
    @classmethod
    def _absolute_executables(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"{path!r} is not an absolute path")
        return value

    @field_validator("containers")
    @classmethod
    def _container_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not CONTAINER_NAME.fullmatch(item):
                raise ValueError(f"{item!r} is not a container name or id")
        if len(set(value)) != len(value):
            raise ValueError("lists a container twice")
        return value

    @field_validator("metrics_textfile")
    @classmethod
    def _absolute_textfile(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value

    def policy(self, phase: str) -> PhasePolicy:
        policies = {"pre": self.pre, "prolog": self.prolog, "epilog": self.epilog}
        return policies.get(phase, self.post)


@dataclass(frozen=True)
class LoadedConfig:
    config: GateConfig
    source: str  # the file it came from, or BUILTIN_SOURCE


def parse_config(text: str, source: str) -> GateConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part))
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(source, field or "(top level)", message + more) from None


def _is_union_tag(part: object) -> bool:
    # pydantic adds the union branch ("literal['all']", "tuple[...]") to the error location.
    return isinstance(part, str) and ("[" in part or part in {"int", "str"})


def toml_value(value: object) -> str:
    """One value as TOML: enough for gpugate's config (scalars and flat lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def candidate_paths(unit: str | None, config_dir: Path = DEFAULT_CONFIG_DIR) -> list[Path]:
    paths: list[Path] = []
    if unit:
        paths.append(config_dir / f"{unit}.toml")
        prefix, at, rest = unit.partition("@")
        if at and "." in rest:
            paths.append(config_dir / f"{prefix}@.{rest.rsplit('.', 1)[1]}.toml")
    paths.append(config_dir / "default.toml")
    return paths


def load_config(
    unit: str | None, explicit: Path | None = None, config_dir: Path = DEFAULT_CONFIG_DIR
) -> LoadedConfig:
    if explicit is not None:
        return LoadedConfig(parse_config(_read(explicit), str(explicit)), str(explicit))
    for path in candidate_paths(unit, config_dir):
        if path.exists():
            return LoadedConfig(parse_config(_read(path), str(path)), str(path))
    return LoadedConfig(GateConfig(), BUILTIN_SOURCE)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "no such file") from None
    except PermissionError:
        raise ConfigError(str(path), "", "permission denied reading it") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "", "is a directory, not a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), "", "is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(str(path), "", exc.strerror or str(exc)) from None
