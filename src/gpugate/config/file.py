"""Where the unit's configuration file is found, how it is read and parsed, and the one-line
error that names the file and field when it is wrong.

Lookup for UNIT (first that exists): --config PATH, /etc/gpugate/UNIT.toml, for a template
instance /etc/gpugate/NAME@.service.toml, /etc/gpugate/default.toml, else built-in defaults.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpugate.compat import tomllib
from gpugate.config.models import Config, LoadedConfig, pydantic_config
from gpugate.config.values import BUILTIN_SOURCE, DEFAULTS
from gpugate.errors import ConfigError, InvalidValue
from gpugate.untrusted import echo

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
if TYPE_CHECKING:
    from pydantic import ValidationError

STRICT_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "literal_error"}


def parse_config(text: str, source: str) -> Config:
    """The file's config: the built-in defaults where it sets nothing (empty, or comments
    only: nothing to validate, and pydantic is not loaded), else pydantic's model of it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    if not data:
        return DEFAULTS
    model = pydantic_config()
    from pydantic import ValidationError  # noqa: PLC0415 - loaded with the model

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _config_error(source, exc) from None


def _config_error(source: str, exc: ValidationError) -> ConfigError:
    """The first of pydantic's errors as gpugate's (pydantic's own words for a type it wanted
    as they are); how many more there were."""
    first = exc.errors()[0]
    loc = first["loc"]
    # A key the file names comes first (it may look like a tag: `"a[b" = 1`); tags follow it.
    parts = [str(part) for part in loc[:1]] + [
        str(part) for part in loc[1:] if not _is_union_tag(part)
    ]
    field = echo(".".join(parts), quote=False) or "(top level)"
    more = exc.error_count() - 1
    refused = (first.get("ctx") or {}).get("error")
    if isinstance(refused, InvalidValue):
        return ConfigError(source, field, str(refused), more=more)
    if first["type"] == "extra_forbidden":
        suggestion = _did_you_mean(parts)
        problem = "unknown key" + (f"; did you mean {suggestion!r}?" if suggestion else "")
        return ConfigError(source, field, problem, more=more, code="config-unknown-key")
    detail = first["msg"].removeprefix("Value error, ")
    if first["type"] in STRICT_TYPE_ERRORS:
        shown = first["input"]
        if isinstance(shown, (bool, int, float, str)):
            from gpugate.config.toml_text import toml_value  # noqa: PLC0415 (an error's)

            shown = toml_value(shown)
        problem = f"{detail}, not {_toml_type(first['input'])} {echo(shown, quote=False)}"
        return ConfigError(source, field, problem, more=more)
    return ConfigError(source, field, detail, more=more)


def _toml_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    return names.get(type(value), "a " + type(value).__name__)


def _did_you_mean(parts: list[str]) -> str:
    from pydantic import BaseModel  # noqa: PLC0415 - loaded with the model

    model: type[BaseModel] = pydantic_config()
    if not parts:
        return ""
    for part in parts[:-1]:
        annotation: Any = (
            model.model_fields[part].annotation if part in model.model_fields else None
        )
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1, cutoff=0.75)
    return close[0] if close else ""


def _is_union_tag(part: object) -> bool:
    # pydantic adds the union branch ("literal['all']", "tuple[...]") to the error location.
    return isinstance(part, str) and ("[" in part or part in {"int", "str"})


def candidate_paths(unit: str | None, config_dir: Path = DEFAULT_CONFIG_DIR) -> list[Path]:
    paths: list[Path] = []
    if unit:
        paths.append(config_dir / f"{unit}.toml")
        prefix, at, rest = unit.partition("@")
        if at and "." in rest:
            paths.append(config_dir / f"{prefix}@.{rest.rsplit('.', 1)[1]}.toml")
    paths.append(config_dir / "default.toml")
    return paths


def find_config(
    unit: str | None, explicit: Path | None = None, config_dir: Path = DEFAULT_CONFIG_DIR
) -> Path | None:
    """The file the lookup reads: --config PATH, else the first candidate there is."""
    if explicit is not None:
        return explicit
    return next((p for p in candidate_paths(unit, config_dir) if os.path.lexists(p)), None)


def load_config(
    unit: str | None,
    explicit: Path | None = None,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    read: Callable[[Path], str] | None = None,
) -> LoadedConfig:
    """The lookup, read and parsed. Production reads through
    integrations.config_files.load_config, which judges who may change the file first."""
    path = find_config(unit, explicit, config_dir)
    if path is None:
        loaded = LoadedConfig(DEFAULTS, BUILTIN_SOURCE)
    else:
        loaded = LoadedConfig(parse_config((read or _read)(path), str(path)), str(path))
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
