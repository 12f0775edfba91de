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

from gpugate.errors import InvalidValue, Problem
from gpugate.host.safe_files import NotRegularFile, TooLarge, read_capped
from gpugate.report.error_text import problem_text

MAX_RECORD_BYTES = 64 * 1024  # what gpugate writes is under 2 KiB
MAX_DIGITS = 20  # a JSON number longer than this is no count, PID or time of gpugate's
MAX_ITEMS = 1024  # a list in a record: GPUs, UUIDs


class BadRecord(InvalidValue):
    """Why a state file is not one of gpugate's records: a Problem code and its facts; `why`
    is report/'s phrase for it (no path)."""

    @property
    def why(self) -> str:
        return problem_text(self.problem, self.facts)

    def __str__(self) -> str:
        return self.why


def read_text(path: Path, limit: int = MAX_RECORD_BYTES) -> str:
    """The file's text. FileNotFoundError where it is gone; BadRecord where it is not a
    regular file of at most limit bytes of UTF-8 (host/safe_files.read_capped: a FIFO is not
    opened for a read that would block, a link is not followed)."""
    try:
        data = read_capped(path, limit)
    except FileNotFoundError:
        raise
    except NotRegularFile:
        raise BadRecord(Problem.RECORD_NOT_FILE) from None
    except TooLarge:
        raise BadRecord(Problem.RECORD_TOO_LARGE, kib=limit // 1024) from None
    except OSError as exc:
        raise BadRecord(Problem.RECORD_UNREADABLE, cause=exc.strerror or str(exc)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord(Problem.RECORD_NOT_UTF8) from None


def _constant(name: str) -> float:
    raise BadRecord(Problem.RECORD_CONSTANT, value=name)


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BadRecord(Problem.RECORD_DIGITS, count=len(text))
    return int(text)


def _real(text: str) -> float:
    if len(text) > 2 * MAX_DIGITS:
        raise BadRecord(Problem.RECORD_CHARS, count=len(text))
    value = float(text)
    if not math.isfinite(value):
        raise BadRecord(Problem.RECORD_OUT_OF_RANGE, key=text)
    return value


def parse_record(text: str) -> dict[str, Any]:
    """A JSON object with sane numbers, or BadRecord."""
    try:
        data = json.loads(text, parse_constant=_constant, parse_int=_integer, parse_float=_real)
    except RecursionError:
        raise BadRecord(Problem.RECORD_NESTED) from None
    except BadRecord:
        raise
    except ValueError as exc:  # JSONDecodeError is one
        raise BadRecord(Problem.RECORD_NOT_JSON, detail=str(exc)) from None
    if not isinstance(data, dict):
        raise BadRecord(Problem.RECORD_NOT_OBJECT, kind=type(data).__name__)
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
        raise BadRecord(Problem.RECORD_NOT_STRING, key=key)
    if len(value) > limit:
        raise BadRecord(Problem.RECORD_TOO_LONG, key=key, limit=limit)
    return value


def integer(
    data: Mapping[str, Any], key: str, low: int, high: int, default: int | None = None
) -> int:
    value: object = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRecord(Problem.RECORD_NOT_INTEGER, key=key, low=low, high=high)
    return value


def number(data: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRecord(Problem.RECORD_NOT_NUMBER, key=key)
    if not low <= value <= high:
        raise BadRecord(Problem.RECORD_OUT_OF_RANGE, key=key)
    return float(value)


def flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key)
    if not isinstance(value, bool):
        raise BadRecord(Problem.RECORD_NOT_FLAG, key=key)
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
        raise BadRecord(Problem.RECORD_NOT_LIST, key=key)
    if len(value) > MAX_ITEMS:
        raise BadRecord(Problem.RECORD_TOO_MANY, key=key, most=MAX_ITEMS)
    return value
