"""What Python 3.11 added, for 3.9 and 3.10: `tomllib` (through tomli, which it was made
from) and `StrEnum`, whose str() gives the value (format() of a str mix-in already does)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum

    import tomllib
else:
    import tomli as tomllib

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


__all__ = ["StrEnum", "tomllib"]
