"""Issue 34, rule 4: one lock_dir for every lease on a host. default.toml's `lock_dir` (else
the built-in) is the host's; a file that leaves it out gets it; a file of the lookup (a
unit's, a template's, containers.toml, slurm.toml) that names another is refused (78, one
line naming the file and `lock_dir`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpugate.config.values import DEFAULT_LOCK_DIR
from gpugate.errors import ConfigError, ExitCode
from gpugate.front.commands.slurm import load_slurm_config
from gpugate.integrations.config_files import load_config
from gpugate.integrations.container import container_config


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    folder = tmp_path / "etc-gpugate"
    folder.mkdir()
    return folder


def write(path: Path, lock_dir: Path | None, extra: str = "free_mib = 512\n") -> Path:
    path.write_text((f'lock_dir = "{lock_dir}"\n' if lock_dir else "") + extra)
    return path


# Each kind of config file the lookup reads, and how its command loads it.
KINDS = {
    "unit": ("vllm.service.toml", lambda etc: load_config("vllm.service", None, etc)),
    "template": ("vllm@.service.toml", lambda etc: load_config("vllm@a.service", None, etc)),
    "containers": ("containers.toml", container_config),
    "slurm": ("slurm.toml", lambda etc: load_slurm_config(None, etc)),
    "--config in the folder": (
        "other.toml",
        lambda etc: load_config("vllm.service", etc / "other.toml", etc),
    ),
}


@pytest.mark.message
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("host_sets", [True, False])
def test_a_file_naming_another_lock_dir_is_refused(
    etc: Path, tmp_path: Path, kind: str, host_sets: bool
) -> None:
    host = tmp_path / "locks" if host_sets else DEFAULT_LOCK_DIR
    if host_sets:
        write(etc / "default.toml", host)
    name, load = KINDS[kind]
    path = write(etc / name, tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as caught:
        load(etc)
    assert caught.value.code == "lock-dir-not-hosts"
    assert caught.value.exit_code == ExitCode.CONFIG
    assert caught.value.field == "lock_dir"
    text = caught.value.message
    assert text.startswith(f"{path}: lock_dir: ") and "\n" not in text
    assert str(host) in text


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_file_leaving_lock_dir_out_gets_the_hosts(etc: Path, tmp_path: Path, kind: str) -> None:
    write(etc / "default.toml", tmp_path / "locks")
    name, load = KINDS[kind]
    write(etc / name, None)
    loaded = load(etc)
    assert loaded.source == str(etc / name)
    assert loaded.config.lock_dir == tmp_path / "locks"
    assert loaded.config.free_mib == 512


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_file_naming_the_hosts_lock_dir_is_read(etc: Path, tmp_path: Path, kind: str) -> None:
    (tmp_path / "locks").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "locks")
    write(etc / "default.toml", tmp_path / "locks")
    name, load = KINDS[kind]
    for same in (tmp_path / "locks", tmp_path / "link", Path(f"{tmp_path}/./locks/")):
        write(etc / name, same)
        assert load(etc).config.lock_dir == same


def test_status_and_every_file_read_the_same_lock_dir(etc: Path, tmp_path: Path) -> None:
    write(etc / "default.toml", tmp_path / "locks")
    for name, _ in KINDS.values():
        write(etc / name, None)
    seen = {load(etc).config.lock_dir for _, load in KINDS.values()}
    seen.add(load_config(None, None, etc).config.lock_dir)  # what `status` reads
    assert seen == {tmp_path / "locks"}


def test_without_default_toml_the_builtin_is_the_hosts(etc: Path) -> None:
    write(etc / "vllm.service.toml", None)
    assert load_config("vllm.service", None, etc).config.lock_dir == DEFAULT_LOCK_DIR
    write(etc / "vllm.service.toml", DEFAULT_LOCK_DIR)
    assert load_config("vllm.service", None, etc).config.lock_dir == DEFAULT_LOCK_DIR
    write(etc / "default.toml", None)  # default.toml without lock_dir: the built-in too
    assert load_config("vllm.service", None, etc).config.lock_dir == DEFAULT_LOCK_DIR


def test_a_config_outside_the_folder_is_its_own(etc: Path, tmp_path: Path) -> None:
    """`--config PATH` elsewhere (tests, trials): its lock_dir stands; without one it gets
    the host's."""
    write(etc / "default.toml", tmp_path / "locks")
    trial = write(tmp_path / "trial.toml", tmp_path / "trial-locks")
    assert load_config("vllm.service", trial, etc).config.lock_dir == tmp_path / "trial-locks"
    write(trial, None)
    assert load_config("vllm.service", trial, etc).config.lock_dir == tmp_path / "locks"


def test_a_broken_default_toml_is_named(etc: Path) -> None:
    (etc / "default.toml").write_text("lock_dir = 3\n")
    write(etc / "vllm.service.toml", None)
    with pytest.raises(ConfigError) as caught:
        load_config("vllm.service", None, etc)
    assert caught.value.source == str(etc / "default.toml")
    assert caught.value.field == "lock_dir"
