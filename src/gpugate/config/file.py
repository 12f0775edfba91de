"""The config lookup (--config, /etc/gpugate/UNIT.toml, NAME@.service.toml, default.toml, built-in
defaults), its parse, its one-line error naming file and field; enough TOML to print it back."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from gpugate.config.schema import DEFAULTS, GateConfig, Model
from gpugate.config.values import BUILTIN_SOURCE
from gpugate.errors import ConfigError
from gpugate.untrusted import for_error

Config = GateConfig
ConfigOrPolicy = TypeVar("ConfigOrPolicy", bound=Model)

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
STRICT_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "literal_error"}
TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}


class LoadedConfig(NamedTuple):
    config: Config
    source: str  # the file it came from, or BUILTIN_SOURCE


def replaced(config: ConfigOrPolicy, **changes: Any) -> ConfigOrPolicy:
    """A copy of the same type with these fields changed, not validated (the code chose them)."""
    return config._made({**dict(config), **changes}, config.model_fields_set | set(changes))


def parse_config(text: str, source: str) -> Config:
    """The built-in defaults where the file sets nothing (no pydantic_core), else the file's
    values validated by pydantic_core; the first of its errors as gpugate's, and how many more
    there were."""
    from gpugate.compat import tomllib  # noqa: PLC0415 - not where the cache has the file

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    if not data:
        return DEFAULTS
    from pydantic_core import ValidationError  # noqa: PLC0415 - loaded with the validator

    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        parts = [str(part) for part in first["loc"]]
        # An InvalidValue's words are the message itself: "Value error, WORDS".
        problem, code = first["msg"].removeprefix("Value error, "), ""
        if first["type"] == "extra_forbidden":
            suggestion = _did_you_mean(parts)
            problem = "unknown key" + (f"; did you mean {suggestion!r}?" if suggestion else "")
            code = "config-unknown-key"
        elif first["type"] in STRICT_TYPE_ERRORS:
            shown = first["input"]
            kind = TOML_TYPES.get(type(shown), "a " + type(shown).__name__)
            if isinstance(shown, (bool, int, float, str)):
                shown = toml_value(shown)
            problem = f"{problem}, not {kind} {for_error(shown, quote=False)}"
        field = for_error(".".join(parts), quote=False) or "(top level)"
        raise ConfigError(source, field, problem, more=exc.error_count() - 1, code=code) from None


def _did_you_mean(parts: list[str]) -> str:
    model: Any = DEFAULTS  # the table holding the key: the file's, or [pre], [sweep]...
    for part in parts[:-1]:
        model = getattr(model, part, None)
        if not isinstance(model, Model):
            return ""
    import difflib  # noqa: PLC0415 - an error's words only

    close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1, cutoff=0.75)
    return close[0] if close else ""


def load_config(
    unit: str | None,
    explicit: Path | None = None,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    *,
    read: Callable[[Path], str],
    parse: Callable[[str, str], Config] = parse_config,
) -> LoadedConfig:
    """The lookup, read by integrations.config_files (which judges the file first), parsed
    (parse_config, or as its cache knows it)."""
    path = explicit
    if path is None:
        candidates = [config_dir / f"{unit}.toml"] if unit else []
        prefix, at, rest = (unit or "").partition("@")
        if at and "." in rest:
            candidates.append(config_dir / f"{prefix}@.{rest.rsplit('.', 1)[1]}.toml")
        candidates.append(config_dir / "default.toml")
        path = next((p for p in candidates if os.path.lexists(p)), None)
    if path is None:
        loaded = LoadedConfig(DEFAULTS, BUILTIN_SOURCE)
    else:
        loaded = LoadedConfig(parse(read(path), str(path)), str(path))
    check_lock_dir(loaded)
    return loaded


def check_lock_dir(loaded: LoadedConfig) -> None:
    """lock_dir must be, or be able to become, a folder (it is made at the first run)."""
    lock_dir = loaded.config.lock_dir
    existing = next(path for path in (lock_dir, *lock_dir.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(loaded.source, "lock_dir", f"{lock_dir}: {existing} is not a folder")


# A TOML basic string's short escapes, and \uXXXX for each other control character.
TOML_ESCAPES = {code: f"\\u{code:04X}" for code in [*range(0x20), 0x7F]} | str.maketrans(
    {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
)


def toml_value(value: object) -> str:
    """One value as TOML (scalars and flat lists); a string always one line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return '"' + str(value).translate(TOML_ESCAPES) + '"'


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
