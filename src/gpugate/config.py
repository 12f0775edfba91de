"""The unit's gpugate configuration: pydantic models and where they are read from.

Lookup for UNIT (first that exists): --config PATH, /etc/gpugate/UNIT.toml, for a template
instance /etc/gpugate/NAME@.service.toml, /etc/gpugate/default.toml, else built-in defaults.
Only what an operator sets lives here; where gpugate looks (/dev, /proc, the cgroup tree) is
`host.HostRoots`.
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
from gpugate.gpulist import GpuListError, GpuRef, gpu_refs
from gpugate.units import validate_unit_name

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
DEFAULT_LOCK_DIR = Path("/run/gpugate")
BUILTIN_SOURCE = "built-in defaults"
ECHO_MAX = 60  # characters of a value (or key) an error message repeats
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

GpuSelection = Literal["all"] | tuple[GpuRef, ...]  # resolved: what a run owns
GpusSetting = Literal["auto"] | GpuSelection  # as written; "auto" is resolved by gpu_source


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

    @model_validator(mode="after")
    def _kill_fits_in_deadline(self) -> PhasePolicy:
        kill_s = self.sigterm_grace_s + self.sigkill_wait_s
        if kill_s >= self.wait_timeout_s:
            raise ValueError(
                f"sigterm_grace_s + sigkill_wait_s ({kill_s:g} s) must be below wait_timeout_s "
                f"({self.wait_timeout_s:g} s), which also holds the memory wait"
            )
        return self


class GateConfig(_Frozen):
    gpus: GpusSetting = Field(
        default="auto",
        description='The unit\'s GPUs: "auto" (its own CUDA_VISIBLE_DEVICES, else '
        'NVIDIA_VISIBLE_DEVICES, else all), "all", or indices and/or UUIDs, e.g. [0, 1].',
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
    pre: PhasePolicy = PhasePolicy()
    post: PhasePolicy = PhasePolicy(kill_orphans=False, kill_app_tree=False)
    # Slurm's Prolog= and Epilog=: the job is over at the epilog, so its leftovers die too.
    prolog: PhasePolicy = PhasePolicy()
    epilog: PhasePolicy = PhasePolicy()
    lock_dir: Path = Field(
        default=DEFAULT_LOCK_DIR,
        strict=False,  # a TOML string becomes the Path
        description="Folder of gpugate's per-GPU locks (best on a tmpfs such as /run).",
    )
    metrics_textfile: Path | None = Field(
        default=None,
        strict=False,
        description="node_exporter textfile rewritten after each run (not set: no metrics).",
    )
    containers: tuple[str, ...] = Field(
        default=(),
        strict=False,  # a TOML list becomes the tuple
        description="Containers (names or ids) that are the unit's own (`docker run --name`).",
    )

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
        if value in ("all", "auto"):
            return value
        if not isinstance(value, list | tuple):
            raise ValueError('must be "all", "auto" or a list of GPU indices or UUIDs, e.g. [0, 1]')
        try:
            return gpu_refs(value)
        except GpuListError as exc:
            raise ValueError(str(exc)) from None

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

    @field_validator("containers")
    @classmethod
    def _container_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not CONTAINER_NAME.fullmatch(item):
                raise ValueError(f"{item!r} is not a container name or id")
        if len(set(value)) != len(value):
            raise ValueError("lists a container twice")
        return value

    @field_validator("metrics_textfile", "lock_dir")
    @classmethod
    def _absolute_path(cls, value: Path | None) -> Path | None:
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
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(parts)
        elif first["type"] in STRICT_TYPE_ERRORS:
            shown = first["input"]
            if isinstance(shown, bool | int | float | str):
                shown = toml_value(shown)
            message += f", not {_toml_type(first['input'])} {echo(shown, quote=False)}"
        field = echo(".".join(parts), quote=False)
        raise ConfigError(source, field or "(top level)", message + more) from None


STRICT_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "literal_error"}


def echo(value: object, *, quote: bool = True, limit: int = ECHO_MAX) -> str:
    """A value as an error message repeats it: repr'd, and cut short (a 10 MB value in a
    config file must not become a 10 MB stderr line)."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def to_toml(data: dict[str, object], prefix: str = "") -> str:
    """Enough TOML for gpugate's config: scalars, lists and nested tables."""
    lines: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if value is None:
            lines.append(f"# {key}: not set")
        elif isinstance(value, dict):
            name = f"{prefix}{key}"
            tables.append(f"\n\n[{name}]\n" + to_toml(value, f"{name}."))
        else:
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "".join(tables)


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
    check_lock_dir(loaded)
    return loaded


def check_lock_dir(loaded: LoadedConfig) -> None:
    """lock_dir must be, or be able to become, a folder (it is made at the first run);
    whether gpugate may write there is the run's to find out (a permission error)."""
    lock_dir = existing = loaded.config.lock_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(loaded.source, "lock_dir", f"{lock_dir}: {existing} is not a folder")


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
