"""gpugate's own state read back (leases, failed-start records, the metrics counters): read
with a size cap and parsed into sane values, or refused with why.

A record that is not what gpugate wrote (edited, truncated, or left by another version) must
never end a run: every fault here is a `BadRecord`, which the caller reports once and
ignores. Refused: more than MAX_RECORD_BYTES, not a regular file, not UTF-8, not JSON,
`NaN` and `Infinity` (Python's json takes them by default), numbers of more than MAX_DIGITS
digits, nesting deeper than the decoder allows, and, field by field, wrong types and values
out of range (`bool` is not taken for an int).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpugate.errors import InvalidValue
from gpugate.host.safe_files import NotRegularFile, TooLarge, read_capped

MAX_RECORD_BYTES = 64 * 1024  # what gpugate writes is under 2 KiB
MAX_DIGITS = 20  # a JSON number longer than this is no count, PID or time of gpugate's
MAX_ITEMS = 1024  # a list in a record: GPUs, UUIDs


class BadRecord(InvalidValue):
    """Why a state file is not one of gpugate's records: one phrase, no path (`why`)."""

    @property
    def why(self) -> str:
        return str(self)


def read_text(path: Path, limit: int = MAX_RECORD_BYTES) -> str:
    """The file's text. FileNotFoundError where it is gone; BadRecord where it is not a
    regular file of at most limit bytes of UTF-8 (host/safe_files.read_capped: a FIFO is not
    opened for a read that would block, a link is not followed)."""
    try:
        data = read_capped(path, limit)
    except FileNotFoundError:
        raise
    except NotRegularFile:
        raise BadRecord("not a regular file") from None
    except TooLarge:
        raise BadRecord(f"larger than {limit // 1024} KiB") from None
    except OSError as exc:
        raise BadRecord(f"cannot be read ({exc.strerror or str(exc)})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8") from None


def _constant(name: str) -> float:
    raise BadRecord(f"{name} is not a number gpugate writes")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BadRecord(f"a number of {len(text)} digits")
    return int(text)


def _real(text: str) -> float:
    if len(text) > 2 * MAX_DIGITS:
        raise BadRecord(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise BadRecord(f"{text} is out of range")
    return value


def parse_record(text: str) -> dict[str, Any]:
    """A JSON object with sane numbers, or BadRecord."""
    try:
        data = json.loads(text, parse_constant=_constant, parse_int=_integer, parse_float=_real)
    except RecursionError:
        raise BadRecord("nested too deeply") from None
    except BadRecord:
        raise
    except ValueError as exc:  # JSONDecodeError is one
        raise BadRecord(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(data, dict):
        raise BadRecord(f"a JSON {type(data).__name__}, not an object")
    return data


def read_record(path: Path) -> dict[str, Any]:
    return parse_record(read_text(path))


def text(data: Mapping[str, Any], key: str, limit: int, *, optional: bool = False) -> str | None:
    """A string field of at most limit characters; None where optional and absent, null or
    empty."""
    value = data.get(key)
    if optional and (value is None or value == ""):
        return None
    if not isinstance(value, str):
        raise BadRecord(f"{key} is not a string")
    if len(value) > limit:
        raise BadRecord(f"{key} is longer than {limit} characters")
    return value


def integer(
    data: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None
) -> int:
    value: object = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRecord(f"{key} is not an integer from {low} to {high}")
    return value


def number(data: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(f"{key} is not a number")
    if not low <= value <= high:
        raise BadRecord(f"{key} is out of range")
    return float(value)


def flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key)
    if not isinstance(value, bool):
        raise BadRecord(f"{key} is not true or false")
    return value


def integers(data: Mapping[str, Any], key: str, low: int, high: int) -> tuple[int, ...]:
    items = _items(data, key)
    return tuple(integer({key: item}, key, low, high) for item in items)


def texts(data: Mapping[str, Any], key: str, limit: int) -> tuple[str, ...]:
    items = _items(data, key)
    return tuple(str(text({key: item}, key, limit)) for item in items)


def _items(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise BadRecord(f"{key} is not a list")
    if len(value) > MAX_ITEMS:
        raise BadRecord(f"{key} has more than {MAX_ITEMS} items")
    return value
