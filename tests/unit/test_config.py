from __future__ import annotations

from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.config.schema import GateConfig
from gpugate.config.values import BUILTIN_SOURCE
from gpugate.core.discover import owned_gpus
from gpugate.errors import ConfigError, ExitCode
from gpugate.integrations.config_files import load_config
from tests.fakes import FakeGpuMemory, raises_error

# Bad files: the field each error names ("": the file as a whole).
BAD = [
    ("gpus = [", ""),
    ("bogus = 1", "bogus"),
    ('gpus = "some"', "gpus"),
    ("gpus = 3", "gpus"),
    ("gpus = []", "gpus"),
    ("gpus = [0, 0]", "gpus"),
    ('gpus = [1, "1"]', "gpus"),
    ('gpus = ["GPU-x"]', "gpus"),
    ('gpus = ["MIG-9f1e"]', "gpus"),
    ("gpus = [1024]", "gpus"),
    ("gpus = [true]", "gpus"),
    ("gpus = [-1]", "gpus"),
    ("free_mib = -5", "free_mib"),
    ('free_mib = "lots"', "free_mib"),
    ("[pre]\nsigterm_grace_s = 0", "pre.sigterm_grace_s"),
    ("[post]\nwait_timeout_s = -1", "post.wait_timeout_s"),
    ('[pre]\non_timeout = "explode"', "pre.on_timeout"),
    ("[pre]\nkill_orphans = 2", "pre.kill_orphans"),
    ("[pre]\ntypo = true", "pre.typo"),
    ('lock_dir = "locks"', "lock_dir"),
    ('protected_executables = ["sleep"]', "protected_executables"),
]


# The strict rules (issue 12): real TOML types, nothing that can never work, bounded echoes.
STRICT = [
    (
        'kill_other_units = "yes"',
        'f.toml: kill_other_units: Input should be a valid boolean, not a string "yes"',
    ),
    (
        "kill_other_units = 1",
        "f.toml: kill_other_units: Input should be a valid boolean, not an integer 1",
    ),
    ('free_mib = "2048"', 'f.toml: free_mib: Input should be a valid integer, not a string "2048"'),
    ("free_mib = 2048.0", "f.toml: free_mib: Input should be a valid integer, not a float 2048.0"),
    ("free_mib = true", "f.toml: free_mib: Input should be a valid integer, not a boolean true"),
    ('[pre]\nkill_orphans = "false"', "f.toml: pre.kill_orphans: Input should be a valid boolean"),
    (
        '[post]\nsigterm_grace_s = "10"',
        "f.toml: post.sigterm_grace_s: Input should be a valid number",
    ),
    ("[pre]\nwait_timeout_s = true", "f.toml: pre.wait_timeout_s: Input should be a valid number"),
    ("[pre]\non_timeout = 1", "f.toml: pre.on_timeout: Input should be 'fail' or 'warn'"),
    ("free_mib = 0", "f.toml: free_mib: Input should be greater than or equal to 1"),
    (
        'protected_units = ["nvidia-persistenced"]',
        "f.toml: protected_units: 'nvidia-persistenced' is not a service or scope unit name with its suffix",
    ),
    ('protected_units = ["dcgm.timer"]', "f.toml: protected_units: 'dcgm.timer' is not"),
    ('protected_units = ["a b.service"]', "f.toml: protected_units: 'a b.service' is not"),
    ('protected_units = ["x.service\\n"]', "f.toml: protected_units: 'x.service\\n' is not"),
    ('protected_units = ["vllm@.service"]', "f.toml: protected_units: 'vllm@.service' is not"),
    ("protected_units = [3]", "f.toml: protected_units"),
    (
        "[pre]\nsigterm_grace_s = 100\nsigkill_wait_s = 20",
        "f.toml: pre: sigterm_grace_s + sigkill_wait_s (120 s) must be below wait_timeout_s (120 s)",
    ),
    (
        "[post]\nwait_timeout_s = 15",
        "f.toml: post: sigterm_grace_s + sigkill_wait_s (15 s) must be below wait_timeout_s (15 s)",
    ),
    ("[epilog]\nwait_timeout_s = 3", "f.toml: epilog: sigterm_grace_s + sigkill_wait_s (15 s)"),
    ("[prolog]\nsigkill_wait_s = 200", "f.toml: prolog: sigterm_grace_s + sigkill_wait_s (210 s)"),
    (
        'gpus = ["MIG-8c1f0a2e-1b2c-4d5e-8f90-123456789abc\\n"]',
        "f.toml: gpus: 'MIG-8c1f0a2e-1b2c-4d5e-8f90-123456789abc\\n' is not a MIG device UUID",
    ),
    (
        'gpus = [0, "MIG-GPU-8c1f0a2e/1"]',
        "f.toml: gpus: 'MIG-GPU-8c1f0a2e/1' is not a MIG device UUID (MIG-xxxxxxxx-...) or "
        "MIG-GPU-<uuid>/<gi>/<ci>",
    ),
    (
        'gpus = ["GPU-8c1f0a2e-1b2c\\n"]',
        "f.toml: gpus: 'GPU-8c1f0a2e-1b2c\\n' is not a GPU index (0, 1, ...) or UUID",
    ),
    ("free_mb = 3", "f.toml: free_mb: unknown key; did you mean 'free_mib'?"),
    (
        "kill_other_unit = true",
        "f.toml: kill_other_unit: unknown key; did you mean 'kill_other_units'?",
    ),
    (
        "[pre]\nwait_timout_s = 3",
        "f.toml: pre.wait_timout_s: unknown key; did you mean 'wait_timeout_s'?",
    ),
    (
        "[post]\nkill_orphan = true",
        "f.toml: post.kill_orphan: unknown key; did you mean 'kill_orphans'?",
    ),
    ('lockdir = "/run/x"', "f.toml: lockdir: unknown key; did you mean 'lock_dir'?"),
    ('[paths]\nproc_root = "/proc"', "f.toml: paths: unknown key"),
    ("[pree]\nkill_orphans = true", "f.toml: pree: unknown key; did you mean 'pre'?"),
    ("zebra = 1", "f.toml: zebra: unknown key"),
]


@pytest.mark.message
@pytest.mark.parametrize(("text", "message"), STRICT)
def test_strict_config_rules(text: str, message: str) -> None:
    """The words an operator reads for a bad file: the field, what it should be, what it is."""
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "f.toml")
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


@pytest.mark.message
def test_unknown_key_far_from_every_field_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config("zebra = 1", "f.toml")
    assert str(raised.value) == "f.toml: zebra: unknown key"


@pytest.mark.parametrize(
    "text",
    [
        'gpus = ["{big}"]',
        'protected_units = ["{big}"]',
        'protected_executables = ["{big}"]',
        'free_mib = "{big}"',
        '[pre]\non_timeout = "{big}"',
        "{big} = 1",
        "[pre]\n{big} = 1",
    ],
)
def test_echoed_values_are_cut_short(text: str) -> None:
    big = "a" * 10_000_000
    with pytest.raises(ConfigError) as raised:
        parse_config(text.replace("{big}", big), "f.toml")
    assert len(str(raised.value)) < 300 and "\n" not in str(raised.value)
    assert "…" in str(raised.value)


def test_kill_shorter_than_deadline_is_valid() -> None:
    config = parse_config(
        "[pre]\nsigterm_grace_s = 1\nsigkill_wait_s = 1\nwait_timeout_s = 2.5", "f"
    )
    assert config.pre.wait_timeout_s == 2.5
    assert parse_config("free_mib = 1", "f").free_mib == 1


def test_lock_dir_that_is_no_folder_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    (tmp_path / "file").write_text("")
    for lock_dir in (tmp_path / "file", tmp_path / "file" / "gpugate"):
        config.write_text(f'lock_dir = "{lock_dir}"\n')
        with pytest.raises(ConfigError) as raised:
            load_config(None, config)
        assert str(raised.value).startswith(f"{config}: lock_dir: {lock_dir}: "), raised.value
    config.write_text(f'lock_dir = "{tmp_path}/not/yet"\n')  # made at the first run
    assert load_config(None, config).config.lock_dir == tmp_path / "not" / "yet"


@pytest.mark.parametrize(("text", "field"), BAD)
def test_bad_config_names_file_and_field_on_one_line(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "f.toml")
    refused = raised.value
    assert (refused.source, refused.field, refused.exit_code) == ("f.toml", field, ExitCode.CONFIG)
    assert "\n" not in refused.message


def test_partial_phase_table_keeps_that_phases_defaults() -> None:
    config = parse_config("[post]\nwait_timeout_s = 30\n[pre]\nsigterm_grace_s = 2", "f")
    assert config.post.wait_timeout_s == 30
    assert config.post.kill_orphans is False
    assert config.pre.kill_orphans is True
    assert config.pre.sigterm_grace_s == 2


def test_config_is_frozen() -> None:
    config = GateConfig()
    before = config.free_mib
    with pytest.raises(ValueError):
        config.free_mib = before + 5  # type: ignore[misc]
    assert config.free_mib == before


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
    with raises_error(ConfigError):
        load_config(None, tmp_path / "nope.toml")
    with raises_error(ConfigError):
        load_config(None, tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with raises_error(ConfigError):
        load_config(None, tmp_path / "bin.toml")


def test_unknown_gpu_index_and_uuid() -> None:
    gpus = FakeGpuMemory(count=2).gpus()
    with pytest.raises(ConfigError):
        owned_gpus(parse_config("gpus = [5]", "f.toml").gpus, gpus, "f.toml")
    with raises_error(ConfigError, field="gpus"):
        owned_gpus(parse_config('gpus = ["GPU-99999999-0000"]', "f.toml").gpus, gpus, "f.toml")
    by_uuid = owned_gpus(parse_config(f'gpus = ["{gpus[1].uuid.upper()}"]', "f").gpus, gpus, "f")
    assert [gpu.index for gpu in by_uuid] == [1]


@pytest.mark.parametrize("key", ['"a[b"', "int", "str", '"[pre]"', '"x\\u001b[2J"'])
def test_a_key_that_looks_like_a_union_tag_is_still_the_field_named(key: str) -> None:
    """pydantic marks a union's branch in an error's location (`literal['all']`, `int`); a key
    the file itself names is never taken for one (an IndexError, exit 70, before)."""
    with pytest.raises(ConfigError) as caught:
        parse_config(f"{key} = 1\n", "f.toml")
    assert caught.value.code == "config-unknown-key"
    assert caught.value.source == "f.toml"
    assert "\n" not in caught.value.message and "\x1b" not in caught.value.message
