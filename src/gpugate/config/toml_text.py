"""Enough TOML writing for gpugate's config: scalars, flat lists and nested tables."""

from __future__ import annotations


def toml_value(value: object) -> str:
    """One value as TOML: enough for gpugate's config (scalars and flat lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return _toml_string(str(value))


_TOML_ESCAPES = {
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
    '"': '\\"',
    "\\": "\\\\",
}


def _toml_string(text: str) -> str:
    """A TOML basic string: every control character escaped, so that an error message that
    echoes a value stays one line and `config check` prints TOML that parses back."""
    escaped = (
        _TOML_ESCAPES.get(char)
        or (f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F else char)
        for char in text
    )
    return '"' + "".join(escaped) + '"'


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
