"""What Python 3.11 added, for 3.9 and 3.10: `tomllib` (through tomli, which it was made
from) and `StrEnum`, whose str() gives the value (format() of a str mix-in already does).
tomllib is imported at its first use: a start whose config the cache has parses no TOML."""

from __future__ import annotations

import sys
from enum import Enum
from typing import TYPE_CHECKING

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
else:

    def __getattr__(name: str) -> object:
        if name != "tomllib":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if sys.version_info >= (3, 11):
            import tomllib  # noqa: PLC0415 - at its first use
        else:
            import tomli as tomllib  # noqa: PLC0415
        return tomllib


__all__ = ["StrEnum", "tomllib"]
