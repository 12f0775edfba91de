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
    return '"' + "".join(_escaped(char) for char in str(value)) + '"'


_SHORT_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _escaped(char: str) -> str:
    """A TOML basic string's character: a control character escaped, so that a value is always
    one line (in `config check` output and in error messages that repeat it)."""
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04X}"
    return char


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
