"""The config lookup as root reads it (docs/hardening.md, rule 2): a file or `lock_dir`
another account may change is refused (exit 78), and one lock_dir serves every lease on a host
(`default.toml`'s, else /run/gpugate); `--config PATH` outside CONFIG_DIR keeps its own."""

from __future__ import annotations

import os
from pathlib import Path

from gpugate.config import file
from gpugate.config.file import LoadedConfig, replaced
from gpugate.config.values import BUILTIN_SOURCE, DEFAULT_LOCK_DIR
from gpugate.errors import ConfigError, Refused
from gpugate.host import safe_files
from gpugate.host.safe_files import untrusted, untrusted_text

HOST_FILE = "default.toml"  # its lock_dir is the host's


def load_config(
    unit: str | None, explicit: Path | None = None, config_dir: Path = file.DEFAULT_CONFIG_DIR
) -> LoadedConfig:
    loaded = one_lock_dir(
        file.load_config(unit, explicit, config_dir, read=read_trusted), config_dir
    )
    found = untrusted(loaded.config.lock_dir)
    if found is not None:
        raise ConfigError(loaded.source, "lock_dir", untrusted_text(found, state=True))
    return loaded


def one_lock_dir(loaded: LoadedConfig, config_dir: Path) -> LoadedConfig:
    """loaded with the host's lock_dir where it leaves it out; ConfigError where a file of
    the lookup names another."""
    if loaded.source == BUILTIN_SOURCE:
        return loaded
    source = Path(loaded.source)
    if source.name == HOST_FILE and _same(source.parent, config_dir):
        return loaded
    host, where = DEFAULT_LOCK_DIR, BUILTIN_SOURCE
    if os.path.lexists(config_dir / HOST_FILE):
        where = str(config_dir / HOST_FILE)
        host = file.parse_config(read_trusted(Path(where)), where).lock_dir
    mine = loaded.config.lock_dir
    if "lock_dir" not in loaded.config.model_fields_set:
        if mine == host:
            return loaded
        inherited = LoadedConfig(replaced(loaded.config, lock_dir=host), loaded.source)
        file.check_lock_dir(inherited)
        return inherited
    if not _same(mine, host) and _same(source.parent, config_dir):
        raise ConfigError(
            loaded.source,
            "lock_dir",
            f"{mine} is not the host's lock_dir {host} ({where}): every unit, gpugate run, "
            "container and Slurm job keeps its leases in one; set lock_dir in default.toml alone "
            "(docs/hardening.md: one lock_dir for every lease)",
            code="lock-dir-not-hosts",
        )
    return loaded


def _same(one: Path, other: Path) -> bool:
    """The same folder: as written, or once links are resolved (/var/run is /run)."""
    return one == other or os.path.realpath(one) == os.path.realpath(other)


def read_trusted(path: Path) -> str:
    """path's text, once it and its folders are judged only trusted accounts' to change."""
    try:
        return safe_files.read_trusted(path)
    except Refused as exc:
        raise ConfigError(str(path), "", str(exc)) from None
