"""The unit's gpugate configuration: pydantic models and where they are read from.

Lookup for UNIT (first that exists): --config PATH, /etc/gpugate/UNIT.toml, for a template
instance /etc/gpugate/NAME@.service.toml, /etc/gpugate/default.toml, else built-in defaults.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpugate.errors import ConfigError, GateError
from gpugate.units import validate_unit_name

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
BUILTIN_SOURCE = "built-in defaults"

UUID_PATTERN = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,}\Z")
ECHO_MAX = 60  # characters of a value (or key) an error message repeats

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
    # strict: TOML has real types, so "yes" is no bool and "2048" no number (an int is a float).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PhasePolicy(_Frozen):
    """What one phase (pre or post) may kill and how long it waits."""

    kill_orphans: bool = True
    kill_app_tree: bool = True
    sigterm_grace_s: float = Field(default=10.0, gt=0, le=3600)
    sigkill_wait_s: float = Field(default=5.0, gt=0, le=3600)
    wait_timeout_s: float = Field(default=120.0, gt=0, le=86400)
    on_timeout: Literal["fail", "warn"] = "fail"
    on_nvml_error: Literal["fail", "warn"] = "fail"

    @model_validator(mode="after")
    def _kill_fits_in_deadline(self) -> PhasePolicy:
        kill_s = self.sigterm_grace_s + self.sigkill_wait_s
        if kill_s >= self.wait_timeout_s:
            raise ValueError(
                f"sigterm_grace_s + sigkill_wait_s ({kill_s:g} s) must be below wait_timeout_s "
                f"({self.wait_timeout_s:g} s), which also holds the memory wait"
            )
        return self


class Paths(_Frozen):
    """Production roots; tests point them at stand-ins."""

    dev_root: Path = Field(default=Path("/dev"), strict=False)
    proc_root: Path = Field(default=Path("/proc"), strict=False)
    cgroup_root: Path = Field(default=Path("/sys/fs/cgroup"), strict=False)
    lock_dir: Path = Field(default=Path("/run/gpugate"), strict=False)

    @field_validator("dev_root", "proc_root", "cgroup_root", "lock_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value


class GateConfig(_Frozen):
    gpus: Literal["all"] | tuple[GpuRef, ...] = "all"
    free_mib: int = Field(default=1024, ge=1)  # drivers keep some memory: 0 is never reached
    kill_other_units: bool = False
    protected_executables: tuple[str, ...] = Field(
        default=DEFAULT_PROTECTED_EXECUTABLES, strict=False
    )
    protected_units: tuple[str, ...] = Field(default=DEFAULT_PROTECTED_UNITS, strict=False)
    pre: PhasePolicy = PhasePolicy()
    post: PhasePolicy = PhasePolicy(kill_orphans=False, kill_app_tree=False)
    # Slurm's Prolog= and Epilog=: the job is over at the epilog, so its leftovers die too.
    prolog: PhasePolicy = PhasePolicy()
    epilog: PhasePolicy = PhasePolicy()
    paths: Paths = Paths()
    # node_exporter textfile, rewritten after each run
    metrics_textfile: Path | None = Field(default=None, strict=False)

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
                if isinstance(item, str) and item.startswith("MIG-"):
                    raise ValueError(
                        f"{echo(item)} is a MIG device: not supported yet; name its GPU"
                    )
                if isinstance(item, str) and not UUID_PATTERN.match(item):
                    raise ValueError(f"{echo(item)} is not a GPU UUID (GPU-xxxxxxxx-...)")
            if len(set(value)) != len(value):
                raise ValueError("lists a GPU twice")
            return tuple(value)
        return value

    @field_validator("protected_executables")
    @classmethod
    def _absolute_executables(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"{echo(path)} is not an absolute path")
        return value

    @field_validator("protected_units")
    @classmethod
    def _unit_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            try:
                validate_unit_name(name)
            except GateError:
                raise ValueError(
                    f"{echo(name)} is not a service or scope unit name with its suffix "
                    "(e.g. nvidia-persistenced.service)"
                ) from None
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
        parts = [str(part) for part in first["loc"] if not _is_union_tag(part)]
        field = ".".join(parts)
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(parts)
        elif first["type"] in STRICT_TYPE_ERRORS:
            shown = first["input"]
            if isinstance(shown, bool | int | float | str):
                shown = toml_value(shown)
            message += f", not {_toml_type(first['input'])} {echo(shown, quote=False)}"
        raise ConfigError(
            source, echo(field, quote=False) or "(top level)", message + more
        ) from None


STRICT_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "literal_error"}


def echo(value: object, *, quote: bool = True, limit: int = ECHO_MAX) -> str:
    """A value as an error message repeats it: repr'd, and cut short (a 10 MB value in a
    config file must not become a 10 MB stderr line)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _toml_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    return names.get(type(value), "a " + type(value).__name__)


def _did_you_mean(parts: list[str]) -> str:
    model: type[BaseModel] = GateConfig
    for part in parts[:-1]:
        annotation: Any = (
            model.model_fields[part].annotation if part in model.model_fields else None
        )
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


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
        loaded = LoadedConfig(parse_config(_read(explicit), str(explicit)), str(explicit))
    else:
        path = next((p for p in candidate_paths(unit, config_dir) if p.exists()), None)
        if path is None:
            loaded = LoadedConfig(GateConfig(), BUILTIN_SOURCE)
        else:
            loaded = LoadedConfig(parse_config(_read(path), str(path)), str(path))
    check_paths(loaded)
    return loaded


def check_paths(loaded: LoadedConfig) -> None:
    """What the file system must hold for the config to work: a /proc to read, and a lock
    folder that is (or can become) a folder. Permission is the run's to find out."""
    paths = loaded.config.paths
    if not paths.proc_root.is_dir():
        raise ConfigError(loaded.source, "paths.proc_root", f"{paths.proc_root}: no such folder")
    lock_dir = paths.lock_dir
    while not lock_dir.exists() and lock_dir != lock_dir.parent:
        lock_dir = lock_dir.parent
    if not lock_dir.is_dir():
        raise ConfigError(
            loaded.source, "paths.lock_dir", f"{paths.lock_dir}: {lock_dir} is not a folder"
        )


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
