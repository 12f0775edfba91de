"""Rule 2 (docs/hardening.md): root reads only root's config. A config file another account may
change (its owner, group or other write, or a folder above it that is), for every command that
reads one, is exit 78 with one line naming the path, its owner and mode, and nothing is killed;
lock_dir likewise; a path that is not a regular file or is absurdly large is not read."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from gpugate.errors import ConfigError, ExitCode
from gpugate.front.cli import main
from gpugate.host.safe_files import MAX_BYTES
from gpugate.integrations.config_files import load_config
from tests.fakes import FakeHost, alive

OTHER = 65534
needs_root = pytest.mark.root("chown to another account")
STEER = 'gpus = "all"\nkill_other_units = true\n'
HAS_SYSTEMD_RUN = any(os.access(p, os.X_OK) for p in ("/usr/bin/systemd-run", "/bin/systemd-run"))


def account_config(tmp_path: Path, how: str) -> Path:
    """The issue's variants: the file the account's; its folder the account's; a root file of
    mode 0666; a file in the account's home; group-writable; a folder higher up the account's."""
    home = tmp_path / "etc" / "gpugate"
    home.mkdir(parents=True)
    path = home / "vllm.service.toml"
    path.write_text(STEER + f'lock_dir = "{tmp_path}/locks"\n')
    if how == "file-owner":
        os.chown(path, OTHER, -1)
    elif how == "folder-owner":
        os.chown(home, OTHER, -1)
    elif how == "mode-0666":
        path.chmod(0o666)
    elif how == "group-writable":
        os.chown(path, -1, OTHER)
        path.chmod(0o664)
    elif how == "folder-world-writable":
        home.chmod(0o777)
    elif how == "grandparent-owner":
        os.chown(tmp_path / "etc", OTHER, -1)
    elif how == "account-home":
        account_home = tmp_path / "home" / "alice"
        account_home.mkdir(parents=True)
        os.chown(account_home, OTHER, -1)
        moved = account_home / "x.toml"
        path.rename(moved)
        return moved
    return path


VARIANTS = [
    "file-owner",
    "folder-owner",
    "mode-0666",
    "group-writable",
    "folder-world-writable",
    "grandparent-owner",
    "account-home",
]


@needs_root
@pytest.mark.parametrize("how", VARIANTS)
def test_pre_refuses_an_account_config_and_kills_nothing(
    host: FakeHost, tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (other_units_holder,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(other_units_holder, {0}, 500)
    config = account_config(tmp_path, how)
    code = main(
        ["pre", "vllm.service", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
        reporter_factory=lambda unit, phase: host.reporter(phase),
    )
    err = capsys.readouterr().err
    assert code == ExitCode.CONFIG, err
    assert err.count("\n") == 1 and err.startswith(f"gpugate: {config}: ")
    assert alive(other_units_holder)


@needs_root
@pytest.mark.parametrize("how", VARIANTS)
def test_every_reading_command_refuses(
    host: FakeHost,
    tmp_path: Path,
    how: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")
    config = account_config(tmp_path, how)
    for argv in (
        ["post", "vllm.service", "--config", str(config)],
        ["status", "--config", str(config)],
        ["config", "check", str(config)],
        ["slurm", "prolog", "--config", str(config)],
        *([["run", "--config", str(config), "--", "/bin/true"]] if HAS_SYSTEMD_RUN else []),
    ):
        code = main(argv, driver_factory=lambda: host.memory, roots=host.roots)
        assert code == ExitCode.CONFIG, (argv, capsys.readouterr().err)


@needs_root
def test_the_lookup_refuses_the_units_file(tmp_path: Path) -> None:
    """/etc/gpugate/UNIT.toml, the template's file and default.toml: each found by the lookup."""
    for name in ("vllm.service.toml", "vllm@.service.toml", "default.toml"):
        config_dir = tmp_path / name
        config_dir.mkdir()
        path = config_dir / name
        path.write_text(STEER)
        os.chown(path, OTHER, -1)
        unit = "vllm@a.service" if "@" in name else "vllm.service"
        with pytest.raises(ConfigError) as caught:
            load_config(unit, None, config_dir)
        assert caught.value.source == str(path)
        assert caught.value.exit_code == ExitCode.CONFIG


def test_roots_configs_are_read(tmp_path: Path) -> None:
    """The suite's own configs live in pytest's folders (the runner's, under sticky /tmp):
    they pass the rule, so every other test reads its config as production does."""
    path = tmp_path / "c.toml"
    path.write_text(f'lock_dir = "{tmp_path}/locks"\ngpus = [0]\n')
    path.chmod(0o644)
    assert load_config("vllm.service", path).source == str(path)
    path.chmod(0o600)
    assert load_config("vllm.service", path).source == str(path)


@needs_root
@pytest.mark.parametrize("how", ["owner", "mode", "missing-in-sticky"])
def test_lock_dir_another_account_may_change_is_refused(tmp_path: Path, how: str) -> None:
    locks = tmp_path / "locks"
    if how == "missing-in-sticky":
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        locks = shared / "gpugate"  # not there yet: any account could make it first
    else:
        locks.mkdir()
        if how == "owner":
            os.chown(locks, OTHER, -1)
        else:
            locks.chmod(0o777)
    path = tmp_path / "c.toml"
    path.write_text(f'lock_dir = "{locks}"\n')
    with pytest.raises(ConfigError) as caught:
        load_config("vllm.service", path)
    assert caught.value.field == "lock_dir"
    assert str(locks) in caught.value.message


def test_a_sticky_folder_with_roots_entry_is_fine(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "gpugate").mkdir()
    path = shared / "gpugate" / "c.toml"
    path.write_text(f'lock_dir = "{shared / "gpugate"}"\n')
    assert load_config("vllm.service", path).source == str(path)


def test_paths_that_are_not_files_are_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # a plain open would block the hook until a writer came
    sock = tmp_path / "sock.toml"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sock))
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as handle:
        handle.truncate(MAX_BYTES + 1)
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    cases = [fifo, sock, folder, huge]
    if os.geteuid() == 0:
        device = tmp_path / "null.toml"
        os.mknod(device, stat.S_IFCHR | 0o644, os.makedev(1, 3))
        cases.append(device)
    for path in cases:
        with pytest.raises(ConfigError) as caught:
            load_config("vllm.service", path)
        assert caught.value.source == str(path), caught.value.message
        assert caught.value.exit_code is ExitCode.CONFIG
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_every_command_reads_its_config_through_the_trusted_loader() -> None:
    """Only integrations/config_files.py may call config.file.load_config (which does not
    judge who may change the file): every other module imports the checked one."""
    import ast

    src = Path(__file__).resolve().parents[2] / "src" / "gpugate"
    wrong = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).as_posix() in {"integrations/config_files.py", "config/file.py"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            imported = (
                isinstance(node, ast.ImportFrom)
                and node.module == "gpugate.config.file"
                and any(alias.name == "load_config" for alias in node.names)
            )
            called = (
                isinstance(node, ast.Attribute)
                and node.attr == "load_config"
                and isinstance(node.value, ast.Name)
                and node.value.id == "file"
            )
            if imported or called:
                wrong.append(str(path.relative_to(src)))
    assert not wrong
