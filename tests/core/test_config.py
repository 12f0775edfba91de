from __future__ import annotations

from pathlib import Path

import pytest

from gpugate.config import BUILTIN_SOURCE, GateConfig, load_config, parse_config
from gpugate.discover import owned_gpus
from gpugate.errors import ConfigError
from tests.fakes import FakeGpuMemory

BAD = [
    ("gpus = [", "f.toml: not valid TOML"),
    ("bogus = 1", "f.toml: bogus: Extra inputs are not permitted"),
    ('gpus = "some"', 'f.toml: gpus: must be "all"'),
    ("gpus = 3", 'f.toml: gpus: must be "all"'),
    ("gpus = []", "f.toml: gpus: must name at least one GPU"),
    ("gpus = [0, 0]", "f.toml: gpus: lists GPU 0 twice"),
    ('gpus = [1, "1"]', "f.toml: gpus: lists GPU 1 twice"),
    ('gpus = ["GPU-x"]', "f.toml: gpus: 'GPU-x' is not a GPU index (0, 1, ...) or UUID"),
    ('gpus = ["MIG-9f1e0a22-4b5c"]', "f.toml: gpus: 'MIG-9f1e0a22-4b5c': MIG devices are not"),
    ("gpus = [1024]", "f.toml: gpus: GPU index 1024 is out of range (0-1023)"),
    ("gpus = [true]", "f.toml: gpus: True is not a GPU index or UUID"),
    ("gpus = [-1]", "f.toml: gpus"),
    ("free_mib = -5", "f.toml: free_mib: Input should be greater than or equal to 0"),
    ('free_mib = "lots"', "f.toml: free_mib: Input should be a valid integer"),
    ("[pre]\nsigterm_grace_s = 0", "f.toml: pre.sigterm_grace_s: Input should be greater than 0"),
    ("[post]\nwait_timeout_s = -1", "f.toml: post.wait_timeout_s"),
    ('[pre]\non_timeout = "explode"', "f.toml: pre.on_timeout: Input should be 'fail' or 'warn'"),
    ("[pre]\nkill_orphans = 2", "f.toml: pre.kill_orphans: Input should be a valid boolean"),
    ("[pre]\ntypo = true", "f.toml: pre.typo: Extra inputs are not permitted"),
    ('lock_dir = "locks"', "f.toml: lock_dir: must be an absolute path"),
    ('protected_executables = ["sleep"]', "f.toml: protected_executables"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_config_names_file_and_field_on_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "f.toml")
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_partial_phase_table_keeps_that_phases_defaults() -> None:
    config = parse_config("[post]\nwait_timeout_s = 3\n[pre]\nsigterm_grace_s = 2", "f")
    assert config.post.wait_timeout_s == 3
    assert config.post.kill_orphans is False
    assert config.pre.kill_orphans is True
    assert config.pre.sigterm_grace_s == 2


def test_config_is_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        GateConfig().free_mib = 5  # type: ignore[misc]


def test_lookup_order(tmp_path: Path) -> None:
    assert load_config("vllm.service", config_dir=tmp_path).source == BUILTIN_SOURCE
    (tmp_path / "default.toml").write_text("free_mib = 1")
    assert load_config("vllm.service", config_dir=tmp_path).config.free_mib == 1
    (tmp_path / "vllm@.service.toml").write_text("free_mib = 2")
    assert load_config("vllm@a.service", config_dir=tmp_path).config.free_mib == 2
    (tmp_path / "vllm@a.service.toml").write_text("free_mib = 3")
    assert load_config("vllm@a.service", config_dir=tmp_path).config.free_mib == 3
    (tmp_path / "vllm.service.toml").write_text("free_mib = 4")
    assert load_config("vllm.service", config_dir=tmp_path).config.free_mib == 4


def test_unreadable_or_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(None, tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(None, tmp_path / "bin.toml")


def test_unknown_gpu_index_and_uuid() -> None:
    gpus = FakeGpuMemory(count=2).gpus()
    with pytest.raises(ConfigError, match="gpus: GPU index 5 does not exist; NVML lists GPUs 0-1"):
        owned_gpus(parse_config("gpus = [5]", "f.toml").gpus, gpus, "f.toml")
    with pytest.raises(ConfigError, match="no GPU has UUID"):
        owned_gpus(parse_config('gpus = ["GPU-99999999-0000"]', "f.toml").gpus, gpus, "f.toml")
    by_uuid = owned_gpus(parse_config(f'gpus = ["{gpus[1].uuid.upper()}"]', "f").gpus, gpus, "f")
    assert [gpu.index for gpu in by_uuid] == [1]
