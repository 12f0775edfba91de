"""The config lookup as root reads it (docs/hardening.md, rule 2): a file or `lock_dir`
another account may change is refused (exit 78), and one lock_dir serves every lease on a host
(`default.toml`'s, else /run/gpugate); `--config PATH` outside CONFIG_DIR keeps its own. What a
run validated is kept in /run for the next run (ConfigCache)."""

from __future__ import annotations

import contextlib
import marshal
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpugate import __version__
from gpugate.config import file, schema, values
from gpugate.config.file import Config, LoadedConfig, replaced
from gpugate.config.values import BUILTIN_SOURCE, DEFAULT_LOCK_DIR
from gpugate.errors import ConfigError, Refused
from gpugate.host import safe_files
from gpugate.host.safe_files import untrusted, untrusted_text

HOST_FILE = "default.toml"  # its lock_dir is the host's
CACHE_NAME = "gpugate-config.cache"  # in the host's /run (HostRoots.run)
CACHE_ENTRIES = 256  # files; the oldest goes first
CACHE_MOST_BYTES = 4 << 20


def load_config(
    unit: str | None,
    explicit: Path | None = None,
    config_dir: Path = file.DEFAULT_CONFIG_DIR,
    *,
    cache: Path | None = None,
) -> LoadedConfig:
    """The lookup (--config, UNIT.toml, NAME@.service.toml, default.toml, built-in defaults):
    its file judged, read and parsed (through the cache where one is given: the runs), its
    lock_dir the host's and judged too."""
    parse = file.parse_config if cache is None else ConfigCache(cache).parse
    path = explicit
    if path is None:
        candidates = [config_dir / f"{unit}.toml"] if unit else []
        prefix, at, rest = (unit or "").partition("@")
        if at and "." in rest:
            candidates.append(config_dir / f"{prefix}@.{rest.rsplit('.', 1)[1]}.toml")
        candidates.append(config_dir / HOST_FILE)
        path = next((p for p in candidates if os.path.lexists(p)), None)
    if path is None:
        loaded = LoadedConfig(schema.DEFAULTS, BUILTIN_SOURCE)
    else:
        loaded = LoadedConfig(parse(read_trusted(path), str(path)), str(path))
    check_lock_dir(loaded)
    loaded = one_lock_dir(loaded, config_dir, parse)
    found = untrusted(loaded.config.lock_dir)
    if found is not None:
        raise ConfigError(loaded.source, "lock_dir", untrusted_text(found, state=True))
    return loaded


def check_lock_dir(loaded: LoadedConfig) -> None:
    """lock_dir must be, or be able to become, a folder (it is made at the first run)."""
    lock_dir = loaded.config.lock_dir
    existing = next(path for path in (lock_dir, *lock_dir.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(loaded.source, "lock_dir", f"{lock_dir}: {existing} is not a folder")


def one_lock_dir(
    loaded: LoadedConfig, config_dir: Path, parse: Callable[[str, str], Config]
) -> LoadedConfig:
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
        host = parse(read_trusted(Path(where)), where).lock_dir
    mine = loaded.config.lock_dir
    if "lock_dir" not in loaded.config.model_fields_set:
        if mine == host:
            return loaded
        inherited = LoadedConfig(replaced(loaded.config, lock_dir=host), loaded.source)
        check_lock_dir(inherited)
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


class ConfigCache:
    """The configs this host's runs validated, kept in /run for the next run, so that a start
    whose files have not changed loads neither the TOML parser nor pydantic_core (about 11 ms of
    every start: docs/benchmarks.md). The key is the file's exact text and the code that
    validated it (gpugate's version, the interpreter's, the config modules' files), so an edit
    or an upgrade is validated again, and a reboot empties it. It is read and written only
    where no account but root (and gpugate's own) may change it or a folder above it: marshal's
    data is then as trusted as Python's own bytecode. Anything amiss with it is a miss, never an
    error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Any] | None = None

    def parse(self, text: str, source: str) -> Config:
        """file.parse_config's answer for text, from the cache where it has it."""
        if self.entries is None:
            self.entries = {}
            if safe_files.untrusted(self.path) is None:
                with contextlib.suppress(OSError, EOFError, ValueError, TypeError):
                    data = safe_files.read_capped(self.path, CACHE_MOST_BYTES)
                    key, entries = marshal.loads(data)  # noqa: S302 - root's own file, judged above
                    if key == _code_key() and isinstance(entries, dict):
                        self.entries = entries
        try:
            found = schema.from_plain(self.entries[text])
        except (LookupError, TypeError, ValueError):
            found = None
        if isinstance(found, schema.GateConfig):
            return found
        config = file.parse_config(text, source)
        try:
            self.entries[text] = schema.to_plain(config)
            while len(self.entries) > CACHE_ENTRIES:
                del self.entries[next(iter(self.entries))]
            data = marshal.dumps((_code_key(), self.entries))
            if safe_files.untrusted(self.path.parent) is None:
                with safe_files.folder(self.path.parent, make=False) as folder:
                    safe_files.write_in(folder, self.path.name, data, 0o600)
        except (OSError, TypeError, ValueError):
            pass
        return config


def _code_key() -> tuple[Any, ...]:
    """What validated the cached configs: a change of any of it validates them again."""
    files = [os.stat(module.__file__ or "") for module in (schema, values, file)]
    return (
        __version__,
        sys.implementation.cache_tag,
        *((info.st_ino, info.st_size, info.st_mtime_ns) for info in files),
    )
