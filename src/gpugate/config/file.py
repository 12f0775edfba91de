"""The config's parse, its one-line error naming file and field; enough TOML to print it back
(integrations.config_files looks the file up)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from gpugate.config.schema import DEFAULTS, GateConfig, Model, ModelT
from gpugate.errors import ConfigError
from gpugate.untrusted import for_error

Config = GateConfig

DEFAULT_CONFIG_DIR = Path("/etc/gpugate")
STRICT_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "literal_error"}
TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}


class LoadedConfig(NamedTuple):
    config: Config
    source: str  # the file it came from, or BUILTIN_SOURCE


def replaced(config: ModelT, **changes: Any) -> ModelT:
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
            import difflib  # noqa: PLC0415 - an error's words only

            table: Any = DEFAULTS  # the table holding the key: the file's, or [pre], [sweep]...
            for part in parts[:-1]:
                table = getattr(table, part, None)
            keys = list(table.model_fields) if isinstance(table, Model) else []
            close = difflib.get_close_matches(parts[-1], keys, n=1, cutoff=0.75)
            problem = "unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
            code = "config-unknown-key"
        elif first["type"] in STRICT_TYPE_ERRORS:
            shown = first["input"]
            kind = TOML_TYPES.get(type(shown), "a " + type(shown).__name__)
            if isinstance(shown, (bool, int, float, str)):
                shown = toml_value(shown)
            problem = f"{problem}, not {kind} {for_error(shown, quote=False)}"
        field = for_error(".".join(parts), quote=False) or "(top level)"
        raise ConfigError(source, field, problem, more=exc.error_count() - 1, code=code) from None


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
