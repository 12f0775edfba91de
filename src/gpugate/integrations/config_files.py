"""The config lookup as root reads it (docs/hardening.md, rule 2): a file another account may
change (its owner, group or other write, or any folder above it), or a `lock_dir` another
account may change, is refused with exit 78 and one line naming the path, its owner and mode;
a path that is not a regular file (a FIFO, a device) or is absurdly large is refused without
reading it. Every command that reads a config (pre, post, slurm prolog/epilog, run, status,
config check) reads it here."""

from __future__ import annotations

import os
from pathlib import Path

from gpugate.config import file
from gpugate.config.models import LoadedConfig
from gpugate.errors import ConfigError
from gpugate.host import trust_text
from gpugate.host.safe_files import read_capped, untrusted
from gpugate.host.trust_text import unreadable


def load_config(
    unit: str | None, explicit: Path | None = None, config_dir: Path = file.DEFAULT_CONFIG_DIR
) -> LoadedConfig:
    loaded = file.load_config(unit, explicit, config_dir, read=read_trusted)
    found = untrusted(loaded.config.lock_dir)
    if found is not None:
        raise ConfigError(
            loaded.source,
            "lock_dir",
            trust_text.untrusted_state(found) if found else "another account may change it",
        )
    return loaded


def read_trusted(path: Path) -> str:
    """path's text, once it and its folders are judged only trusted accounts' to change."""
    if not os.path.lexists(path):
        raise ConfigError(str(path), "", "no such file")
    found = untrusted(path)
    if found is not None:
        raise ConfigError(
            str(path),
            "",
            trust_text.untrusted_config(found) if found else "another account may change it",
        )
    try:
        data = read_capped(path.resolve())
    except FileNotFoundError:
        raise ConfigError(str(path), "", "no such file") from None
    except PermissionError:
        raise ConfigError(str(path), "", "permission denied reading it") from None
    except OSError as exc:
        raise ConfigError(str(path), "", f"{unreadable(exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(path), "", "is not UTF-8 text") from None
