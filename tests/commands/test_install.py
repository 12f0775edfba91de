"""`gpugate install|uninstall`: round trips in temporary folders standing in for
/etc/systemd/system and /etc/gpugate, through the functions and through the command line."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpugate.config.file import parse_config, replaced
from gpugate.errors import ExitCode, InstallError, UnknownUnit
from gpugate.front.install import (
    DEFAULT_GPUGATE,
    Action,
    Ownership,
    apply,
    ownership,
    parse_gpus,
    plan_install,
    plan_uninstall,
    render_dropin,
    with_header,
)

UNIT = "vllm.service"


class Dirs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.systemd = root / "systemd"
        self.config = root / "gpugate"
        self.reloads = 0

    @property
    def dropin(self) -> Path:
        return self.systemd / f"{UNIT}.d" / "gpugate.conf"

    @property
    def toml(self) -> Path:
        return self.config / f"{UNIT}.toml"

    def reload(self) -> bool:
        self.reloads += 1
        return True

    def install(self, dry_run: bool = False, unit: str = UNIT, **kwargs: Any) -> str:
        out = io.StringIO()
        changes = plan_install(unit, systemd_dir=self.systemd, config_dir=self.config, **kwargs)
        apply(changes, dry_run=dry_run, reload=self.reload, out=out)
        return out.getvalue()

    def uninstall(self, dry_run: bool = False, **kwargs: Any) -> str:
        out = io.StringIO()
        changes = plan_uninstall(UNIT, systemd_dir=self.systemd, config_dir=self.config, **kwargs)
        apply(changes, dry_run=dry_run, reload=self.reload, out=out)
        return out.getvalue()

    def files(self) -> dict[str, bytes]:
        return {
            str(path.relative_to(self.root)): path.read_bytes() if path.is_file() else b"<dir>"
            for path in sorted(self.root.rglob("*"))
        }


EMPTY = {"systemd": b"<dir>"}  # /etc/systemd/system is always there; /etc/gpugate may not be


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    made = Dirs(tmp_path)
    made.systemd.mkdir()
    return made


def test_install_writes_dropin_and_config_then_reloads(dirs: Dirs) -> None:
    dirs.install(gpus=[0, 1, "GPU-12345678-aaaa"])
    assert dirs.dropin.read_text() == with_header(render_dropin(DEFAULT_GPUGATE))
    assert "ExecStartPre=+/usr/bin/gpugate pre %n" in dirs.dropin.read_text()
    config = parse_config(dirs.toml.read_text(), str(dirs.toml))
    assert config.gpus == (0, 1, "GPU-12345678-aaaa")
    assert replaced(config, gpus="auto") == parse_config("", "-"), (
        "the skeleton's uncommented lines change nothing but gpus"
    )
    assert oct(dirs.dropin.stat().st_mode & 0o777) == "0o644"
    assert dirs.reloads == 1
    assert ownership(dirs.dropin) is Ownership.OURS
    assert ownership(dirs.toml) is Ownership.OURS


def test_skeleton_without_gpus_is_all_defaults(dirs: Dirs) -> None:
    dirs.install()
    assert parse_config(dirs.toml.read_text(), "-") == parse_config("", "-")
    # written out, not commented: the unit's GPUs come from its own CUDA_VISIBLE_DEVICES
    assert '\ngpus = "auto"\n' in dirs.toml.read_text()


def test_skeleton_comments_show_the_true_defaults(dirs: Dirs) -> None:
    """Uncommenting every `# key = value` line of the skeleton changes nothing."""
    dirs.install()
    lines = dirs.toml.read_text().splitlines()
    uncommented = [line[2:] if re.match(r"# [a-z_]+ = ", line) else line for line in lines]
    assert sum(a != b for a, b in zip(lines, uncommented)) == 24
    assert parse_config("\n".join(uncommented), "-") == parse_config("", "-")


def test_reinstall_is_idempotent(dirs: Dirs) -> None:
    dirs.install(gpus=[0])
    before = dirs.files()
    again = plan_install(UNIT, systemd_dir=dirs.systemd, config_dir=dirs.config, gpus=[0])
    assert [change.action for change in again] == [Action.UNCHANGED, Action.UNCHANGED]
    dirs.install(gpus=[0])
    assert dirs.files() == before
    assert dirs.reloads == 1, "nothing changed: no reload"


def test_reinstall_replaces_unedited_files(dirs: Dirs) -> None:
    dirs.install(gpus=[0])
    dirs.install(gpus=[1, 2], gpugate_path=Path("/opt/gpugate/bin/gpugate"))
    assert parse_config(dirs.toml.read_text(), "-").gpus == (1, 2)
    assert "ExecStopPost=+/opt/gpugate/bin/gpugate post %n" in dirs.dropin.read_text()
    assert dirs.reloads == 2


def test_edited_dropin_is_refused_and_nothing_changes(dirs: Dirs) -> None:
    dirs.install(gpus=[0])
    dirs.dropin.write_text(dirs.dropin.read_text().replace("300", "900"))
    before = dirs.files()
    with pytest.raises(InstallError) as err:
        dirs.install(gpus=[1])
    assert err.value.exit_code == ExitCode.INSTALL
    assert str(dirs.dropin) in err.value.message
    assert dirs.files() == before, "the config must not be written either"
    dirs.install(gpus=[1], force=True)
    assert "900" not in dirs.dropin.read_text()
    assert ownership(dirs.dropin) is Ownership.OURS


def test_operators_own_dropin_without_header_is_refused(dirs: Dirs) -> None:
    dirs.dropin.parent.mkdir(parents=True)
    dirs.dropin.write_text("[Service]\nExecStartPre=/usr/local/bin/my-cleanup\n")
    with pytest.raises(InstallError):
        dirs.install()
    assert ownership(dirs.dropin) is Ownership.OPERATORS
    with pytest.raises(InstallError):
        dirs.uninstall()
    assert dirs.dropin.exists()


def test_edited_config_is_kept_unless_gpus_would_change_it(dirs: Dirs) -> None:
    dirs.install(gpus=[0])
    dirs.toml.write_text("free_mib = 2048\n" + dirs.toml.read_text())
    edited = dirs.toml.read_text()
    dirs.install()  # refreshing the drop-in keeps the operator's settings
    assert dirs.toml.read_text() == edited
    with pytest.raises(InstallError):
        dirs.install(gpus=[1])
    assert dirs.toml.read_text() == edited
    dirs.install(gpus=[1], force=True)
    assert parse_config(dirs.toml.read_text(), "-").gpus == (1,)


def test_dry_run_writes_nothing_and_prints_the_files(dirs: Dirs) -> None:
    out = dirs.install(dry_run=True, gpus=[3])
    assert dirs.files() == EMPTY
    assert dirs.reloads == 0
    # the plan names each file and shows what it would hold, indented under it
    assert str(dirs.dropin) in out and str(dirs.toml) in out
    shown = {line.strip() for line in out.splitlines()}
    assert set(render_dropin(DEFAULT_GPUGATE).splitlines()) - {""} <= shown
    dirs.install(gpus=[3])
    before = dirs.files()
    out = dirs.uninstall(dry_run=True)
    assert dirs.files() == before
    assert str(dirs.dropin) in out


def test_round_trip_leaves_no_file_behind(dirs: Dirs) -> None:
    dirs.install(gpus=[0, 1])
    dirs.uninstall()
    assert dirs.files() == EMPTY
    assert dirs.reloads == 2
    again = plan_uninstall(UNIT, systemd_dir=dirs.systemd, config_dir=dirs.config)
    assert [change.action for change in again] == [Action.ABSENT, Action.ABSENT]
    dirs.uninstall()
    assert dirs.reloads == 2


def test_uninstall_keeps_the_operators_other_files(dirs: Dirs) -> None:
    other = dirs.systemd / f"{UNIT}.d" / "override.conf"
    other.parent.mkdir(parents=True)
    other.write_text("[Service]\nLimitNOFILE=1024\n")
    (dirs.config).mkdir()
    (dirs.config / "default.toml").write_text("free_mib = 512\n")
    before = dirs.files()
    dirs.install()
    dirs.uninstall()
    assert dirs.files() == before


def test_uninstall_keeps_edited_config_and_force_removes_it(dirs: Dirs) -> None:
    dirs.install()
    dirs.toml.write_text("gpus = [5]\n")
    out = dirs.uninstall()
    assert not dirs.dropin.exists()
    assert dirs.toml.read_text() == "gpus = [5]\n"
    assert str(dirs.toml) in out
    dirs.uninstall(force=True)
    assert dirs.files() == EMPTY


def test_edited_dropin_blocks_uninstall_until_force(dirs: Dirs) -> None:
    dirs.install()
    dirs.dropin.write_text(dirs.dropin.read_text() + "Nice=5\n")
    with pytest.raises(InstallError):
        dirs.uninstall()
    assert dirs.toml.exists(), "nothing removed when refused"
    dirs.uninstall(force=True)
    assert dirs.files() == EMPTY


def test_header_tampering_counts_as_edited(dirs: Dirs) -> None:
    dirs.install()
    text = dirs.dropin.read_text()
    dirs.dropin.write_text(text.replace("sha256:", "sha256:0", 1))
    assert ownership(dirs.dropin) is Ownership.OPERATORS
    dirs.dropin.write_text(text.split("\n", 2)[2])  # the header deleted
    assert ownership(dirs.dropin) is Ownership.OPERATORS


def test_template_unit_installs_for_every_instance(dirs: Dirs) -> None:
    dirs.install(unit="vllm@.service")
    assert (dirs.systemd / "vllm@.service.d" / "gpugate.conf").is_file()
    assert (dirs.config / "vllm@.service.toml").is_file()
    dirs.install(unit="vllm@a.service", gpus=[0, 1])
    assert (dirs.config / "vllm@a.service.toml").is_file()


@pytest.mark.parametrize(
    "unit", ["vllm", "vllm.scope", "a b.service", "../x.service", "x@@.service", "@.service"]
)
def test_bad_units_refused(dirs: Dirs, unit: str) -> None:
    with pytest.raises(UnknownUnit):
        dirs.install(unit=unit)
    assert dirs.files() == EMPTY


@pytest.mark.parametrize("path", ["gpugate", "/usr/bin/gpu gate", "/a/%n/gpugate", "/a/../b"])
def test_unsafe_gpugate_path_refused(dirs: Dirs, path: str) -> None:
    with pytest.raises(InstallError):
        dirs.install(gpugate_path=Path(path))
    assert dirs.files() == EMPTY


def test_parse_gpus() -> None:
    assert parse_gpus("0,1, 7") == (0, 1, 7)
    assert parse_gpus("GPU-12345678-abcd,2") == ("GPU-12345678-abcd", 2)
    assert parse_gpus("all") == "all"
    for bad in ("", "0,0", "x", "-1", "all,0", "1024", "0,"):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def gpugate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpugate", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUGATE_DEBUG": "1"},
        timeout=60,
        check=False,
    )


def test_cli_round_trip_and_exit_codes(dirs: Dirs) -> None:
    where = ["--systemd-dir", str(dirs.systemd), "--config-dir", str(dirs.config), "--no-reload"]
    dry = gpugate("install", UNIT, "--gpus", "0,1", "--dry-run", *where)
    assert dry.returncode == 0, dry.stderr
    assert dirs.files() == EMPTY
    done = gpugate("install", UNIT, "--gpus", "0,1", "--gpugate-path", "/usr/bin/gpugate", *where)
    assert done.returncode == 0, done.stderr
    assert parse_config(dirs.toml.read_text(), "-").gpus == (0, 1)
    installed = {path: path.stat().st_ino for path in (dirs.dropin, dirs.toml)}
    again = gpugate("install", UNIT, "--gpus", "0,1", "--gpugate-path", "/usr/bin/gpugate", *where)
    assert again.returncode == 0, again.stderr
    assert {path: path.stat().st_ino for path in installed} == installed  # neither rewritten
    dirs.dropin.write_text("[Service]\n")
    refused = gpugate("install", UNIT, *where)
    assert refused.returncode == ExitCode.INSTALL
    assert refused.stderr.startswith("gpugate: ") and refused.stderr.count("\n") == 1
    assert gpugate("uninstall", UNIT, *where).returncode == ExitCode.INSTALL
    assert gpugate("uninstall", UNIT, "--force", *where).returncode == 0
    assert dirs.files() == EMPTY
    assert gpugate("install", UNIT, "--gpus", "zero", *where).returncode == ExitCode.USAGE
    assert gpugate("install", "vllm.timer", *where).returncode == ExitCode.UNKNOWN_UNIT
    assert gpugate("install", "vllm.service\n", *where).returncode == ExitCode.UNKNOWN_UNIT
    bare = gpugate("install", "vllm", *where)  # vllm.service, as systemctl reads it
    assert bare.returncode == 0
    assert dirs.dropin.is_file() and dirs.dropin.parent.name == "vllm.service.d"


@pytest.mark.message
def test_apply_reports_when_systemd_was_not_reloaded(dirs: Dirs) -> None:
    out = io.StringIO()
    changes = plan_install(UNIT, systemd_dir=dirs.systemd, config_dir=dirs.config)
    assert apply(changes, reload=lambda: False, out=out)
    assert "not reloaded" in out.getvalue()  # the message itself: the operator reloads
    assert {c.action for c in changes} == {Action.WRITE}


def test_ports_go_into_the_config(dirs: Dirs) -> None:
    dirs.install(gpus=[0], ports=[8000, 8001])
    config = parse_config(dirs.toml.read_text(), "-")
    assert config.ports == (8000, 8001) and config.gpus == (0,)
    dirs.toml.write_text(dirs.toml.read_text() + "# edited\n")
    with pytest.raises(InstallError):
        dirs.install(ports=[9000])  # the operator's file would change: refused
    where = ["--systemd-dir", str(dirs.systemd), "--config-dir", str(dirs.config), "--no-reload"]
    done = gpugate("install", UNIT, "--port", "8000", "--port", "9000", "--force", *where)
    assert done.returncode == 0, done.stderr
    assert parse_config(dirs.toml.read_text(), "-").ports == (8000, 9000)
    for bad in ("0", "65536", "http"):
        assert gpugate("install", UNIT, "--port", bad, *where).returncode == ExitCode.USAGE


def test_install_container_writes_containers(dirs: Dirs) -> None:
    where = ["--systemd-dir", str(dirs.systemd), "--config-dir", str(dirs.config), "--no-reload"]
    done = gpugate("install", UNIT, "--container", "vllm", "--container", "a1b2c3d4e5f6", *where)
    assert done.returncode == 0, done.stderr
    config = parse_config(dirs.toml.read_text(), "-")
    assert (config.containers, config.gpus) == (("vllm", "a1b2c3d4e5f6"), "auto")
    # the operator edits the file: a new --container is refused, none keeps it
    dirs.toml.write_text("free_mib = 10\n" + dirs.toml.read_text())
    assert gpugate("install", UNIT, "--container", "tgi", *where).returncode == ExitCode.INSTALL
    assert gpugate("install", UNIT, *where).returncode == 0
    assert parse_config(dirs.toml.read_text(), "-").containers == ("vllm", "a1b2c3d4e5f6")
    for bad in ("-x", "a b", "vllm;rm", ""):
        refused = gpugate("install", UNIT, "--container", bad, *where)
        assert refused.returncode == ExitCode.USAGE, bad
    assert parse_config(dirs.toml.read_text(), "-").containers == ("vllm", "a1b2c3d4e5f6")
