"""What Python 3.11 added that gpugate uses, for 3.9 and 3.10: `StrEnum` and `tomllib`.

On 3.11+ these are the standard library's own; on older interpreters `StrEnum` is a `str` enum
whose `str()` and `format()` give the value (as 3.11's does, where a plain `(str, Enum)` gives
`Class.MEMBER` from 3.12 on), and TOML is parsed by `tomli`, the library `tomllib` was made from.
"""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum

    import tomllib
else:
    import tomli as tomllib

    class StrEnum(str, Enum):
        """A string enum: its members are strings and print as their values."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, format_spec: str) -> str:
            return format(str(self.value), format_spec)


__all__ = ["StrEnum", "tomllib"]
