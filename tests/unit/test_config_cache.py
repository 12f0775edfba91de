"""The config cache (integrations.config_files.ConfigCache): what a run validated, kept in the
host's /run for the next run. A hit is the very config a fresh parse gives (types, the keys the
file set, nested tables); an edit, an upgrade or a bad file is validated again; a cache file or
folder another account may change is neither read nor written; anything amiss is a miss."""

from __future__ import annotations

import marshal
import os
from pathlib import Path
from typing import Any

import pytest

from gpugate.config import file, schema
from gpugate.config.file import parse_config
from gpugate.config.schema import DEFAULTS, Model
from gpugate.errors import ConfigError
from gpugate.integrations import config_files
from gpugate.integrations.config_files import CACHE_NAME, ConfigCache, load_config

UUID = "GPU-4b5c1a2e-8f3d-4c1b-9a7e-0d2f6e8c1a3b"
CONFIGS = [
    "",
    "# nothing but a comment\n",
    "gpus = [0, 1]\n",
    f'gpus = [2, "{UUID}"]\nfree_mib = 4096\n',
    'gpus = "all"\nshare_gpus = true\n',
    'gpus = "auto"\nkill_other_units = true\n',
    'lock_dir = "/run/elsewhere"\nmetrics_textfile = "/var/lib/node_exporter/g.prom"\n',
    'protected_executables = ["/usr/bin/nvidia-persistenced"]\nports = [8000, 8001]\n',
    'protected_units = ["nvidia-persistenced.service"]\ncontainers = ["vllm-0"]\n',
    "shm_min_free_mib = 512\n",
    'private_shm = "off"\n',
    "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30.5\n",
    '[post]\non_timeout = "warn"\nremove_shm = false\n',
    "[sweep]\nreap_after_s = 600.0\nreap_sessions = true\n",
    "free_mib = 1\n[prolog]\nkill_orphans = false\n[epilog]\nsigkill_wait_s = 1.5\n",
]


def _exact(value: Any) -> Any:
    """A config's every value with its type, and each table's keys the file set."""
    if isinstance(value, Model):
        fields = {name: _exact(item) for name, item in value}
        return (type(value), fields, value.model_fields_set)
    if isinstance(value, tuple):
        return (tuple, [_exact(item) for item in value])
    return (type(value), value)


@pytest.mark.parametrize("text", CONFIGS)
def test_a_config_s_plain_form_gives_back_the_very_config(text: str) -> None:
    config = parse_config(text, "f.toml")
    plain = schema.to_plain(config)
    assert _exact(schema.from_plain(marshal.loads(marshal.dumps(plain)))) == _exact(config)


@pytest.mark.parametrize(
    "plain",
    [
        ("table", "NoSuchModel", (), ()),
        ("table", "GateConfig", (("free_mib", 1),), ()),  # a model whose fields changed
        ("frozenset", ()),
        ("table", "GateConfig"),
    ],
)
def test_a_plain_form_to_plain_does_not_make_is_refused(plain: Any) -> None:
    with pytest.raises((LookupError, ValueError)):
        schema.from_plain(plain)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    parsed: list[str] = []

    def parse(text: str, source: str) -> Any:
        parsed.append(text)
        return parse_config(text, source)

    monkeypatch.setattr(file, "parse_config", parse)
    return parsed


@pytest.mark.parametrize("text", CONFIGS)
def test_a_second_run_has_the_config_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    parsed = _counting(monkeypatch)
    cache = tmp_path / CACHE_NAME
    first = ConfigCache(cache).parse(text, "f.toml")
    second = ConfigCache(cache).parse(text, "f.toml")
    assert parsed == [text]
    assert _exact(second) == _exact(first) == _exact(parse_config(text, "f.toml"))
    assert cache.stat().st_mode & 0o777 == 0o600


def test_an_edit_is_validated_again_and_a_bad_file_never_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = _counting(monkeypatch)
    cache = tmp_path / CACHE_NAME
    assert ConfigCache(cache).parse("free_mib = 10\n", "f.toml").free_mib == 10
    assert ConfigCache(cache).parse("free_mib = 20\n", "f.toml").free_mib == 20
    for _ in range(2):
        with pytest.raises(ConfigError) as raised:
            ConfigCache(cache).parse("free_mib = -1\n", "f.toml")
        assert raised.value.exit_code == 78
    assert ConfigCache(cache).parse("free_mib = 10\n", "f.toml").free_mib == 10
    assert parsed == ["free_mib = 10\n", "free_mib = 20\n", "free_mib = -1\n", "free_mib = -1\n"]


def test_other_validating_code_validates_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = _counting(monkeypatch)
    cache = tmp_path / CACHE_NAME
    ConfigCache(cache).parse("free_mib = 10\n", "f.toml")
    monkeypatch.setattr(config_files, "__version__", "99.0")
    ConfigCache(cache).parse("free_mib = 10\n", "f.toml")
    assert len(parsed) == 2


def _cached_once(cache: Path, text: str = "free_mib = 10\n") -> None:
    ConfigCache(cache).parse(text, "f.toml")
    assert cache.exists()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda cache: cache.write_bytes(b"not marshal"),
        lambda cache: cache.write_bytes(marshal.dumps(("a key", {}))),
        lambda cache: cache.write_bytes(marshal.dumps([1, 2, 3])),
        lambda cache: cache.write_bytes(cache.read_bytes()[:-7]),
        lambda cache: cache.write_bytes(b""),
        lambda cache: cache.chmod(0o620),  # another account could have written it
        lambda cache: cache.chmod(0o602),
        pytest.param(
            lambda cache: os.chown(cache, 4242, 4242),
            marks=pytest.mark.root("giving a file away needs root"),
        ),
    ],
)
def test_a_cache_amiss_or_another_account_s_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spoil: Any
) -> None:
    cache = tmp_path / CACHE_NAME
    _cached_once(cache)
    spoil(cache)
    parsed = _counting(monkeypatch)
    assert ConfigCache(cache).parse("free_mib = 10\n", "f.toml").free_mib == 10
    assert parsed == ["free_mib = 10\n"]


def test_a_link_in_the_cache_s_place_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    _cached_once(elsewhere)
    before = elsewhere.read_bytes()
    cache = tmp_path / CACHE_NAME
    cache.symlink_to(elsewhere)
    parsed = _counting(monkeypatch)
    ConfigCache(cache).parse("free_mib = 10\n", "f.toml")
    ConfigCache(cache).parse("free_mib = 20\n", "f.toml")
    assert parsed == ["free_mib = 10\n", "free_mib = 20\n"]
    assert not cache.is_symlink()  # replaced by a file of its own; the link's target untouched
    assert elsewhere.read_bytes() == before


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_no_cache_is_written_in_a_folder_another_account_may_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(mode)
    parsed = _counting(monkeypatch)
    for _ in range(2):
        ConfigCache(folder / CACHE_NAME).parse("free_mib = 10\n", "f.toml")
    assert len(parsed) == 2
    assert list(folder.iterdir()) == []


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder" / CACHE_NAME
    assert ConfigCache(missing).parse("free_mib = 10\n", "f.toml").free_mib == 10
    assert not missing.parent.exists()


def test_the_cache_keeps_the_newest_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_files, "CACHE_ENTRIES", 2)
    cache = tmp_path / CACHE_NAME
    for value in (1, 2, 3):
        ConfigCache(cache).parse(f"free_mib = {value}\n", "f.toml")
    parsed = _counting(monkeypatch)
    for value in (3, 2, 1):
        ConfigCache(cache).parse(f"free_mib = {value}\n", "f.toml")
    assert parsed == ["free_mib = 1\n"]


def test_load_config_through_the_cache_is_load_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup, the host's lock_dir (default.toml parsed through the cache too) and the
    LoadedConfig are the same with and without it."""
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / "default.toml").write_text(f'lock_dir = "{tmp_path / "locks"}"\n')
    (config_dir / "m.service.toml").write_text("gpus = [1]\n")
    cache = tmp_path / CACHE_NAME
    plain = load_config("m.service", config_dir=config_dir)
    for _ in range(2):
        cached = load_config("m.service", config_dir=config_dir, cache=cache)
        assert cached.source == plain.source
        assert _exact(cached.config) == _exact(plain.config)
    parsed = _counting(monkeypatch)
    load_config("m.service", config_dir=config_dir, cache=cache)
    assert parsed == []
    assert _exact(load_config("x.service", config_dir=config_dir, cache=cache).config) == _exact(
        load_config("x.service", config_dir=config_dir).config
    )
    assert DEFAULTS.lock_dir != plain.config.lock_dir
