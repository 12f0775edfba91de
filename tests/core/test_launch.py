"""`gpugate run`'s transient unit as data: the name it derives, the environment it passes, the
systemd-run command line it builds, and COMMAND's status read back from systemd-run."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpugate.errors import ConfigError, ExitCode, GateError
from gpugate.front.cli import build_parser, main
from gpugate.front.launch import (
    invoking_user,
    refuse_leased,
    resolve_gpus,
    supervise,
    wait_until_gone,
)
from gpugate.front.launch_unit import (
    Caller,
    LaunchError,
    LaunchPlan,
    caller_environment,
    command_status,
    derive_unit_name,
    passed_environment,
    sanitise,
    systemd_run_argv,
)
from gpugate.host.systemd import validate_unit_name
from gpugate.integrations.unit.leases import new_lease, write_lease
from tests.fakes import FakeHost, raises_error

SYSTEMD_RUN = Path("/usr/bin/systemd-run")
ALICE = Caller(1000, 1000, "alice", "/home/alice", "/bin/bash")


def plan(**changes: object) -> LaunchPlan:
    fields: dict[str, object] = {
        "unit": "gpugate-run-vllm-0a1b2c.service",
        "command": ("/opt/venv/bin/vllm", "serve", "m", "--port", "8000"),
        "caller": ALICE,
        "gpus_env": "0,1,2,3",
        "environment": (("HF_HOME", "/data/hf"), ("PATH", "/opt/venv/bin:/usr/bin")),
        "pty": True,
        "gpugate": ("/usr/bin/gpugate",),
        "started_by": "alice (uid 1000, /dev/pts/3)",
    }
    fields.update(changes)
    return LaunchPlan(**fields)  # type: ignore[arg-type]


def test_the_whole_command_line_for_a_terminal() -> None:
    assert systemd_run_argv(plan(), SYSTEMD_RUN) == [
        "/usr/bin/systemd-run",
        "--unit=gpugate-run-vllm-0a1b2c.service",
        "--pty",
        "--same-dir",
        "--wait",
        "--collect",
        "--service-type=exec",
        "--description=gpugate run by alice (uid 1000, /dev/pts/3): "
        "/opt/venv/bin/vllm serve m --port 8000",
        "--uid=1000",
        "--gid=1000",
        "--property=ExecStartPre=+/usr/bin/gpugate pre gpugate-run-vllm-0a1b2c.service",
        "--property=ExecStopPost=+/usr/bin/gpugate post gpugate-run-vllm-0a1b2c.service",
        "--property=NotifyAccess=exec",
        "--property=TimeoutStartSec=300",
        "--property=TimeoutStopSec=300",
        "--property=KillMode=control-group",
        "--property=TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=50%",
        "--setenv=HF_HOME=/data/hf",
        "--setenv=PATH=/opt/venv/bin:/usr/bin",
        "--setenv=CUDA_VISIBLE_DEVICES=0,1,2,3",
        "--setenv=GPUGATE_STARTED_BY=alice (uid 1000, /dev/pts/3)",
        "--",
        "/opt/venv/bin/vllm",
        "serve",
        "m",
        "--port",
        "8000",
    ]


def test_pipe_root_config_cleanup_force_and_dollars() -> None:
    config = Path("/run/gpugate/run/x.service.toml")
    argv = systemd_run_argv(
        plan(
            pty=False,
            as_root_caller=True,
            config=config,
            cleanup=(config,),
            force=True,
            command=("/bin/sh", "-c", "echo $HOME ${X}"),
        ),
        SYSTEMD_RUN,
    )
    assert "--pipe" in argv and "--pty" not in argv
    assert not [a for a in argv if a.startswith(("--uid", "--gid"))]
    hooks = [a for a in argv if "Exec" in a]
    assert hooks == [
        f"--property=ExecStartPre=+/usr/bin/gpugate pre gpugate-run-vllm-0a1b2c.service "
        f"--config {config} --ignore-leases",  # force: pre warns about leases, on its line
        f"--property=ExecStopPost=+/usr/bin/gpugate post gpugate-run-vllm-0a1b2c.service "
        f"--config {config}",
        f"--property=ExecStopPost=+/bin/rm -f -- {config}",  # after post: it reads the file
    ]
    assert not any("GPUGATE_RUN_FORCE" in a for a in argv)  # never through the environment
    assert argv[-3:] == ["/bin/sh", "-c", "echo $$HOME $${X}"]  # systemd's $ made literal


@pytest.mark.parametrize(
    ("private_shm", "expected"),
    [
        ("off", []),
        ("64g", ["--property=TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=64g"]),
        ("25%", ["--property=TemporaryFileSystem=/dev/shm:mode=1777,nosuid,nodev,size=25%"]),
    ],
)
def test_the_units_own_dev_shm_follows_private_shm(private_shm: str, expected: list[str]) -> None:
    argv = systemd_run_argv(plan(private_shm=private_shm), SYSTEMD_RUN)
    assert [a for a in argv if "TemporaryFileSystem" in a] == expected


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("/opt/venv/bin/vllm", "vllm"),
        ("python3", "python3"),
        ("./run server.sh", "run_server.sh"),
        ("/usr/bin/.hidden", "hidden"),
        ("...", "command"),
        ("é", "command"),
        ("a" * 300, "a" * 40),
    ],
)
def test_derived_names_are_valid_unique_units(command: str, expected: str) -> None:
    name = derive_unit_name([command, "x"], None, "0a1b2c")
    assert name == f"gpugate-run-{expected}-0a1b2c.service"
    assert validate_unit_name(name) == name


@given(st.text(min_size=1, max_size=300))
def test_any_command_gives_a_valid_unit_name(command: str) -> None:
    name = derive_unit_name([command], None, "ffffff")
    assert validate_unit_name(name) == name and len(name) < 100
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", sanitise(command))


@pytest.mark.parametrize(
    ("given_name", "expected"),
    [("myserver", "myserver.service"), ("my-server.service", "my-server.service")],
)
def test_a_given_name_is_a_service(given_name: str, expected: str) -> None:
    assert derive_unit_name(["x"], given_name, "000000") == expected


@pytest.mark.parametrize(
    ("given_name", "text"),
    [
        ("a b", "not a plain unit name"),
        ("x.socket", "makes a service"),
        ("x.scope", "makes a service"),
        ("tmpl@.service", "template"),
        ("tmpl@a.service", "template instance"),
        ("n\n", "not a plain unit name"),
    ],
)
def test_a_bad_name_is_a_usage_error(given_name: str, text: str) -> None:
    with pytest.raises(LaunchError) as raised:
        derive_unit_name(["x"], given_name, "000000")
    assert text in raised.value.message and raised.value.exit_code is ExitCode.USAGE


def test_which_variables_are_passed() -> None:
    environ = {
        "PATH": "/usr/bin",
        "HF_TOKEN": "t",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "INVOCATION_ID": "x",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "TERM": "xterm",
        "TMUX": "/tmp/tmux",
        "GPUGATE_PROC_ROOT": "/tmp/fake",
        "GPUGATE_RUN_FORCE": "1",
        "LD_PRELOAD": "/x.so",
        "PYTHONPATH": "/x",
        "CUDA_VISIBLE_DEVICES": "7",
        "SUDO_UID": "1000",
        "BASH_FUNC_f%%": "() { :; }",
        "MULTI": "a\nb",
        "1BAD": "x",
    }
    assert dict(passed_environment(environ)) == {
        "PATH": "/usr/bin",
        "HF_TOKEN": "t",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "VLLM_LOGGING_LEVEL": "DEBUG",
    }


def test_under_sudo_home_and_user_are_the_callers() -> None:
    environ = {"HOME": "/root", "USER": "root", "LOGNAME": "root", "PATH": "/usr/bin"}
    kept = dict(caller_environment(environ, ALICE, under_sudo=True))
    assert (kept["HOME"], kept["USER"], kept["LOGNAME"], kept["SHELL"]) == (
        "/home/alice",
        "alice",
        "alice",
        "/bin/bash",
    )
    assert dict(caller_environment(environ, ALICE, under_sudo=False))["HOME"] == "/root"


@pytest.mark.parametrize(
    ("code", "messages", "expected"),
    [
        (
            7,
            "Finished with result: exit-code\nMain processes terminated with: "
            "code=exited/status=7\n",
            7,
        ),
        (0, "Main processes terminated with: code=killed/status=INT\n", 130),
        (0, "Main processes terminated with: code=killed/status=TERM\n", 143),
        (255, "Main processes terminated with: code=dumped/status=SEGV\n", 139),
        (255, "Main processes terminated with: code=killed/status=RTMIN+3\n", 255),
        (1, "Main processes terminated with: code=exited/status=FAILURE\n", 1),
        (1, "Failed to start transient service unit: Access denied\n", 1),
        (0, "", 0),
    ],
)
def test_the_commands_status_as_a_shell_reports_it(code: int, messages: str, expected: int) -> None:
    assert command_status(code, messages) == expected


def test_the_parser_takes_the_command_after_double_dash() -> None:
    args = build_parser().parse_args(
        ["run", "--gpus", "0,1", "--port", "8000", "--port", "8001", "--", "vllm", "--gpus", "x"]
    )
    assert args.gpus == [0, 1] and args.ports == [8000, 8001]
    assert args.command[-3:] == ["vllm", "--gpus", "x"]


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["run", "--gpus", "x", "--", "true"], "is not a GPU index"),
        (["run", "--port", "70000", "--", "true"], "not a TCP port"),
    ],
)
def test_bad_options_exit_64(
    argv: list[str], text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == int(ExitCode.USAGE)
    assert text in capsys.readouterr().err


def test_no_command_is_one_line_and_64(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--gpus", "0"]) == int(ExitCode.USAGE)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpugate: ")


# --- the I/O around it (launch.py), with stand-ins ---------------------------------


def test_gpus_from_the_option_the_callers_environment_or_all(host: FakeHost) -> None:
    def indices(wanted: object, environ: dict[str, str]) -> list[int]:
        return [gpu.index for gpu in resolve_gpus(wanted, environ, lambda: host.memory)]

    assert indices([1, 3], {"CUDA_VISIBLE_DEVICES": "5"}) == [1, 3]
    assert indices(None, {"CUDA_VISIBLE_DEVICES": "5,6"}) == [5, 6]
    assert indices(None, {}) == list(range(8))
    assert indices("all", {"CUDA_VISIBLE_DEVICES": "5"}) == list(range(8))
    uuid = host.memory.gpus()[2].uuid
    assert indices([uuid], {}) == [2]
    with pytest.raises(ConfigError) as unknown:
        indices([9], {})
    assert unknown.value.exit_code is ExitCode.CONFIG and unknown.value.field == "gpus"
    with raises_error(LaunchError):
        indices(None, {"CUDA_VISIBLE_DEVICES": ""})


def test_the_invoking_user_is_sudos_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 0)
    caller, under_sudo = invoking_user({"SUDO_UID": "0", "SUDO_GID": "0"})
    assert (caller.uid, caller.user, under_sudo) == (0, "root", True)
    nobody = pwd.getpwnam("nobody")
    caller, under_sudo = invoking_user({"SUDO_UID": str(nobody.pw_uid), "SUDO_GID": "4242"})
    assert (caller.uid, caller.gid, caller.user, under_sudo) == (
        nobody.pw_uid,
        4242,
        "nobody",
        True,
    )
    # Not sudo's own digits: refused, never read as root (issue 26, rule 5; more members in
    # test_run_accounts.py).
    with pytest.raises(LaunchError):
        invoking_user({"SUDO_UID": "x"})


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("echo 'Main processes terminated with: code=killed/status=INT' >&2; exit 0", 130),
        ("echo 'Main processes terminated with: code=exited/status=7' >&2; exit 7", 7),
        ("echo 'Failed to start transient service unit: Access denied' >&2; exit 1", 1),
    ],
)
def test_supervise_relays_systemd_runs_lines_and_returns_the_status(
    script: str, expected: int, capfd: pytest.CaptureFixture[str]
) -> None:
    assert supervise(["/bin/sh", "-c", script], "x.service") == expected
    assert capfd.readouterr().err.splitlines()[0].startswith(("Main", "Failed"))


def test_a_leased_gpu_refuses_unless_forced(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = host.memory.gpus()
    loaded = host.config()
    lease = new_lease("vllm.service", gpus[0:4], share=False)
    write_lease(loaded.config.lock_dir, lease)
    with pytest.raises(GateError) as refused:
        refuse_leased(
            loaded, "gpugate-run-x-1.service", gpus[3:5], force=False, unit_state=lambda _: "active"
        )
    assert refused.value.exit_code is ExitCode.HELD_BY_OTHERS
    refuse_leased(
        loaded, "gpugate-run-x-1.service", gpus[3:5], force=True, unit_state=lambda _: "active"
    )
    assert capsys.readouterr().err.count("\n") == 1  # one warning: forced onto the lease
    # not running any more: stale, no refusal
    refuse_leased(
        loaded, "gpugate-run-x-1.service", gpus[3:5], force=False, unit_state=lambda _: "failed"
    )


def test_after_stopping_it_waits_until_the_unit_is_gone() -> None:
    states = iter(["active", "deactivating", "deactivating", "inactive"])
    asked: list[str] = []

    def state(unit: str) -> str | None:
        asked.append(unit)
        return next(states)

    now = [0.0]
    assert wait_until_gone("u.service", 10.0, state, clock=lambda: now[0], pause=lambda _: None)
    assert asked == ["u.service"] * 4

    def tick(seconds: float) -> None:
        now[0] += seconds

    now[0] = 0.0
    stuck = wait_until_gone("u.service", 1.0, lambda _: "deactivating", lambda: now[0], tick)
    assert not stuck and now[0] >= 1.0
