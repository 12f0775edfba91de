"""Nothing in the caller's environment chooses what root's gpugate runs or looks at: programs
come from the system folders only and run with a clean environment; the host roots come from
the hidden --host-roots option, never GPUGATE_*_ROOT; an EnvironmentFile= another account may
change is named."""

from __future__ import annotations

import io
import os
import pwd
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, ProgramUnavailable
from gpugate.front import hook
from gpugate.front.cli import main
from gpugate.host import safe_files, systemd
from gpugate.host.containers import Container, container_names, stop_containers
from gpugate.host.safe_files import untrusted
from gpugate.integrations.env_files import environment_file_warnings
from tests.fakes import FakeHost, alive

PLANTED = ("systemctl", "docker", "podman", "scontrol")
STEERING = {
    "LD_PRELOAD": "/tmp/evil.so",
    "LD_LIBRARY_PATH": "/tmp/evil",
    "PYTHONPATH": "/tmp/evil",
    "PYTHONHOME": "/tmp/evil",
    "BASH_ENV": "/tmp/evil.sh",
    "DOCKER_HOST": "tcp://evil:2375",
    "GPUGATE_CGROUP_ROOT": "/tmp/evil",
}


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on PATH with a script of each program's name that leaves a marker, and
    system folders (stand-ins) that hold none of them."""
    bin_dir = tmp_path / "planted"
    bin_dir.mkdir()
    for name in PLANTED:
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran-{name}\necho '0 /x'\n")
        script.chmod(0o755)
    empty = tmp_path / "system"
    empty.mkdir()
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(empty),))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")
    monkeypatch.setattr(systemd, "systemd_running", lambda: True)
    return tmp_path


def test_no_program_on_the_callers_path_is_run(planted: Path) -> None:
    assert all(safe_files.find_program(name) is None for name in PLANTED)
    assert systemd.systemctl_show("vllm.service", "ActiveState") is None
    container = Container("docker", "a" * 64, "/system.slice/docker-x.scope")
    container_names([container, Container("podman", "b" * 64, "/m")])
    stop_containers([container], 1.0)
    hook.set_drain_reason("gpu07", "reason", io.StringIO())
    assert sorted(p.name for p in planted.glob("ran-*")) == []


def test_a_program_in_the_system_folders_gets_a_clean_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = tmp_path / "sbin"
    system.mkdir()
    (system / "printenv-all").write_text(f"#!/bin/sh\nenv > {tmp_path}/env\n")
    (system / "printenv-all").chmod(0o755)
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(system),))
    for name, value in STEERING.items():
        monkeypatch.setenv(name, value)
    found = safe_files.find_program("printenv-all")
    assert found == str(system / "printenv-all")
    assert safe_files.run_program([found], 10).returncode == 0
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    assert not set(STEERING) & set(seen), seen
    assert seen["PATH"] == safe_files.SYSTEM_PATH


@pytest.mark.root("ownership checks apply when gpugate runs as root")
@pytest.mark.parametrize(
    ("owner", "mode"), [(65534, 0o755), (0, 0o777), (0, 0o775)], ids=["nobody", "o+w", "g+w"]
)
def test_root_runs_no_program_another_account_may_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: int, mode: int
) -> None:
    program = tmp_path / "systemctl"
    program.write_text("#!/bin/sh\n")
    os.chown(program, owner, 100 if mode == 0o775 else 0)
    program.chmod(mode)
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(tmp_path),))
    assert safe_files.find_program("systemctl") is None


def test_a_program_that_does_not_answer_is_a_documented_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "systemctl").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "systemctl").chmod(0o755)
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(tmp_path),))
    monkeypatch.setattr(systemd, "systemd_running", lambda: True)
    monkeypatch.setattr(systemd, "SYSTEMCTL_TIMEOUT_S", 0.3)
    with pytest.raises(ProgramUnavailable) as raised:
        systemd.systemctl_show("vllm.service", "ActiveState")
    assert raised.value.exit_code is ExitCode.NVML_UNAVAILABLE


@pytest.mark.parametrize(
    "variable", ["GPUGATE_CGROUP_ROOT", "GPUGATE_DEV_ROOT", "GPUGATE_PROC_ROOT"]
)
def test_root_variables_in_the_environment_change_nothing(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """A fake cgroup tree naming a bystander as the unit's: the variable is not read."""
    (bystander,) = host.pool.holder([])
    fake = host.root / "fake"
    (fake / "system.slice" / "vllm.service").mkdir(parents=True)
    (fake / "system.slice" / "vllm.service" / "cgroup.procs").write_text(f"{bystander}\n")
    monkeypatch.setenv(variable, str(fake))
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root}/locks"\ngpus = [0]\n')
    code = main(
        ["pre", "vllm.service", "--config", str(config)],
        driver_factory=lambda: host.memory,
        unit_state=lambda _: "inactive",
    )
    assert code == 0
    assert alive(bystander)


def test_host_roots_option_is_hidden_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "host-roots" not in capsys.readouterr().out
    code = main(["--host-roots", "cgroup=/no/such/folder", "status"])
    assert code == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "--host-roots" in err and "cgroup" in err and err.count("\n") == 1  # option, field
    assert main(["--host-roots", "bin=/usr", "status"]) == ExitCode.CONFIG


# --- EnvironmentFile= another account may change ----------------------------------------------


def env_file_show(*paths: str) -> object:
    text = "".join(f"EnvironmentFiles={p} (ignore_errors=no)\n" for p in paths)
    return lambda _: text


@pytest.mark.message
@pytest.mark.root("give files to other accounts")
@pytest.mark.parametrize(
    "layout",
    ["file-owner", "folder-owner", "world-writable", "group-writable", "missing-in-their-folder"],
)
def test_an_environment_file_others_may_change_is_named(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / "etc-vllm"
    folder.mkdir(mode=0o755)
    path = folder / "vllm.env"
    path.write_text("CUDA_VISIBLE_DEVICES=0\n")
    os.chmod(tmp_path, 0o755)
    nobody = pwd.getpwnam("nobody").pw_uid
    if layout == "file-owner":
        os.chown(path, nobody, 0)
    elif layout == "folder-owner":
        os.chown(folder, nobody, 0)
    elif layout == "world-writable":
        path.chmod(0o666)
    elif layout == "group-writable":
        os.chown(path, 0, 100)
        path.chmod(0o664)
    else:
        path.unlink()
        os.chown(folder, nobody, 0)
    (line,) = environment_file_warnings("vllm.service", env_file_show(str(path)))  # type: ignore[arg-type]
    assert f"EnvironmentFile={path}" in line and "\n" not in line


@pytest.mark.root("root-owned files")
def test_a_root_only_environment_file_is_not_named(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "vllm.env"
    path.write_text("X=1\n")
    path.chmod(0o644)
    chain = [p for p in [tmp_path, *tmp_path.parents] if p.stat().st_uid != 0]
    if chain or untrusted(tmp_path, (0,)) is not None:
        pytest.skip(f"{tmp_path} lies below a folder not root's alone")
    assert environment_file_warnings("vllm.service", env_file_show(str(path))) == []  # type: ignore[arg-type]


@pytest.mark.message
def test_a_hook_whose_systemctl_hangs_says_so_in_the_journal(
    host: FakeHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an internal error (70): exit 69 and one journal entry naming systemctl."""
    from gpugate.core.outcome import PlainWorkload
    from gpugate.core.run import RunScope
    from gpugate.front.hook import Hook, run_hook
    from gpugate.phase import Phase

    system = tmp_path / "sbin"
    system.mkdir()
    (system / "systemctl").write_text("#!/bin/sh\nexec sleep 30\n")
    (system / "systemctl").chmod(0o755)
    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(system),))
    monkeypatch.setattr(systemd, "systemd_running", lambda: True)
    monkeypatch.setattr(systemd, "SYSTEMCTL_TIMEOUT_S", 0.3)
    (orphan,) = host.pool.holder(host.gpu_files(0))
    scope = RunScope(
        Phase.PRE,
        "vllm.service",
        lambda: systemd.resolve_unit_cgroup("vllm.service", host.cgroup_root),
        roots=host.roots,
        driver_factory=lambda: host.memory,
    )
    hook = Hook(
        scope,
        lambda scope, loaded, reporter: PlainWorkload(loaded),
        host.reporter("pre"),
        metrics_unit="vllm.service",
        stream=io.StringIO(),
    )
    outcome = run_hook(hook, host.config(gpus=[0]))
    assert outcome.exit_code is ExitCode.NVML_UNAVAILABLE
    (entry,) = host.journal.events("error")
    assert entry["GPUGATE_EXIT_CODE"] == str(int(ExitCode.NVML_UNAVAILABLE))
    assert "systemctl" in entry["MESSAGE"]
    assert alive(orphan)
