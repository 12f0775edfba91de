"""`gpugate run`'s transient unit as data: the name it derives, the environment it passes, the
systemd-run command line it builds, and COMMAND's status read back from systemd-run."""

from __future__ import annotations

import os
import pwd
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gpugate.config.schema import GateConfig
from gpugate.errors import BadInput, ConfigError, ExitCode, GateError, StateUnwritable
from gpugate.front.cli import build_parser, main
from gpugate.front.commands.run import (
    Caller,
    LaunchPlan,
    caller_environment,
    command_status,
    derive_unit_name,
    hook_config,
    invoking_user,
    passed_environment,
    refuse_leased,
    resolve_gpus,
    supervise,
    systemd_run_argv,
    wait_until_gone,
)
from gpugate.host.systemd import validate_unit_name
from gpugate.integrations.config_files import load_config
from gpugate.integrations.records import new_lease, write_lease
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
        "--property=ExecStartPre=+/usr/bin/gpugate pre gpugate-run-vllm-0a1b2c.service "
        "--for-uid 1000",
        "--property=ExecStopPost=+/usr/bin/gpugate post gpugate-run-vllm-0a1b2c.service "
        "--for-uid 1000",
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
            caller=Caller(0, 0, "root"),
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
    assert re.fullmatch(r"gpugate-run-[A-Za-z0-9_.-]+-ffffff\.service", name)


@pytest.mark.parametrize(
    ("given_name", "expected"),
    [("myserver", "myserver.service"), ("my-server.service", "my-server.service")],
)
def test_a_given_name_is_a_service(given_name: str, expected: str) -> None:
    assert derive_unit_name(["x"], given_name, "000000") == expected


@pytest.mark.parametrize(
    "given_name",
    [
        pytest.param("a b", id="not a plain unit name"),
        pytest.param("x.socket", id="a socket"),
        pytest.param("x.scope", id="a scope"),
        pytest.param("tmpl@.service", id="a template"),
        pytest.param("tmpl@a.service", id="a template instance"),
        pytest.param("n\n", id="a newline"),
    ],
)
def test_a_bad_name_is_a_usage_error(given_name: str) -> None:
    with pytest.raises(BadInput) as raised:
        derive_unit_name(["x"], given_name, "000000")
    assert raised.value.exit_code is ExitCode.USAGE
    assert "\n" not in raised.value.message


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
        "VLLM_LOGGING_LEVEL": "DEBUG",
    }


# glibc's own list of what it drops for a setuid program (sysdeps/generic/unsecvars.h), every
# LD_* the loader reads, and interpreters' start-up variables: none reaches root's `+` hooks.
LOADER_VARIABLES = [
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "LD_DEBUG",
    "LD_DEBUG_OUTPUT",
    "LD_DYNAMIC_WEAK",
    "LD_HWCAP_MASK",
    "LD_ORIGIN_PATH",
    "LD_PROFILE",
    "LD_SHOW_AUXV",
    "LD_USE_LOAD_BIAS",
    "LD_BIND_NOW",
    "LD_BIND_NOT",
    "LD_ASSUME_KERNEL",
    "LD_POINTER_GUARD",
    "LD_SOMETHING_A_LATER_GLIBC_READS",
    "GCONV_PATH",
    "GETCONF_DIR",
    "GLIBC_TUNABLES",
    "HOSTALIASES",
    "LOCALDOMAIN",
    "LOCPATH",
    "MALLOC_TRACE",
    "MALLOC_CHECK_",
    "MALLOC_ARENA_MAX",
    "NIS_PATH",
    "NLSPATH",
    "RESOLV_HOST_CONF",
    "RES_OPTIONS",
    "TMPDIR",
    "TZDIR",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONINSPECT",
    "PYTHONSAFEPATH",
    "PYTHONWARNINGS",
    "PYTHONPLATLIBDIR",
    "BASH_ENV",
    "ENV",
    "PERL5LIB",
    "PERL5OPT",
    "PERLLIB",
    "RUBYOPT",
    "RUBYLIB",
    "NODE_OPTIONS",
    "NODE_PATH",
]


@pytest.mark.parametrize("name", LOADER_VARIABLES)
def test_no_loader_or_interpreter_variable_reaches_the_unit(name: str) -> None:
    environ = {name: "/home/alice/evil", "PATH": "/usr/bin", "HF_HOME": "/data/hf"}
    kept = dict(caller_environment(environ, ALICE, under_sudo=True))
    assert name not in kept
    assert kept["HF_HOME"] == "/data/hf"
    argv = systemd_run_argv(plan(environment=tuple(sorted(kept.items()))), SYSTEMD_RUN)
    assert not [arg for arg in argv if arg.startswith(f"--setenv={name}=")]


@pytest.mark.parametrize("name", ["LDAP_URI", "LD", "CUDA_HOME", "ENVIRONMENT", "TZ", "LANG"])
def test_names_that_only_look_like_loader_variables_pass(name: str) -> None:
    assert dict(passed_environment({name: "x"})) == {name: "x"}


@pytest.mark.parametrize("argv0", [None, "/usr/bin/gpugate"])
def test_the_hooks_it_writes_run_python_isolated(argv0: str | None) -> None:
    """-I: a PYTHON* variable that got through anyway (systemd's own DefaultEnvironment=, a
    unit's file) changes nothing in root's hooks; /usr/bin/gpugate's shebang says -I itself."""
    from gpugate.front.install import gpugate_command, isolates

    command = gpugate_command(argv0=argv0 or "/nonexistent/gpugate", executable="/usr/bin/python3")
    argv = systemd_run_argv(plan(gpugate=command), SYSTEMD_RUN)
    hooks = [
        a for a in argv if a.startswith(("--property=ExecStartPre=+", "--property=ExecStopPost=+"))
    ]
    gpugate_hooks = [h for h in hooks if " pre " in h or " post " in h]
    assert len(gpugate_hooks) == 2
    for hook in gpugate_hooks:
        program = hook.split("=+", 1)[1].split()
        assert "-I" in program[1:3] or isolates(program[0]), hook


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
    assert args.gpus == (0, 1) and args.ports == [8000, 8001]
    assert args.command[-3:] == ["vllm", "--gpus", "x"]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["run", "--gpus", "x", "--", "true"], "--gpus"),
        (["run", "--port", "70000", "--", "true"], "--port"),
    ],
)
def test_bad_options_exit_64(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == int(ExitCode.USAGE)
    assert option in capsys.readouterr().err  # the option refused is named


def test_no_command_is_one_line_and_64(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--gpus", "0"]) == int(ExitCode.USAGE)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpugate: ")


# --- the I/O around it (commands/run.py), with stand-ins ---------------------------------


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
    with raises_error(BadInput):
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
    with pytest.raises(BadInput):
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


def test_after_stopping_it_waits_until_the_unit_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpugate.front.commands import run

    states = iter(["active", "deactivating", "deactivating", "inactive"])
    asked: list[str] = []

    def state(unit: str) -> str | None:
        asked.append(unit)
        return next(states)

    now = [0.0]
    paused = SimpleNamespace(monotonic=lambda: now[0], sleep=lambda _: None)
    monkeypatch.setattr(run, "time", paused)
    monkeypatch.setattr(run, "active_state", state)
    assert wait_until_gone("u.service", 10.0)
    assert asked == ["u.service"] * 4

    def tick(seconds: float) -> None:
        now[0] += seconds

    now[0] = 0.0
    monkeypatch.setattr(run, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=tick))
    monkeypatch.setattr(run, "active_state", lambda _: "deactivating")
    stuck = wait_until_gone("u.service", 1.0)
    assert not stuck and now[0] >= 1.0


@pytest.mark.parametrize(
    ("holder", "started_by"),
    [
        ("gpugate-run-bob-1.service", "bob (uid 1001, /dev/pts/4)"),  # another account's run
        ("gpugate-run-alice-2.service", "alice (uid 1000, /dev/pts/3)"),  # says it is hers
        ("vllm.service", None),  # a unit systemd starts
        ("libpod-3f2a.scope", None),  # a container's lease
    ],
)
def test_force_over_a_lease_is_roots_alone(
    host: FakeHost, capsys: pytest.CaptureFixture[str], holder: str, started_by: str | None
) -> None:
    """A caller that is not root (under sudo: SUDO_UID's) never overrides a running lease:
    exit 77, one line; whose the lease says it is changes nothing (GPUGATE_STARTED_BY is
    the unit's environment). Root still may."""
    gpus = host.memory.gpus()
    loaded = host.config()
    write_lease(
        loaded.config.lock_dir, new_lease(holder, gpus[3:4], share=False, started_by=started_by)
    )
    with pytest.raises(GateError) as refused:
        refuse_leased(
            loaded,
            "gpugate-run-x-1.service",
            gpus[3:5],
            force=True,
            caller_is_root=False,
            unit_state=lambda _: "active",
        )
    assert refused.value.exit_code is ExitCode.PERMISSION
    assert "\n" not in refused.value.message and holder in refused.value.message
    assert capsys.readouterr().err == ""  # refused: no warning of a forced start
    refuse_leased(
        loaded,
        "gpugate-run-x-1.service",
        gpus[3:5],
        force=True,
        caller_is_root=True,
        unit_state=lambda _: "active",
    )
    assert capsys.readouterr().err.count("\n") == 1  # root: forced, with one warning
    # No running lease on the GPUs: --force changes nothing, for anyone.
    refuse_leased(
        loaded,
        "gpugate-run-x-1.service",
        gpus[4:5],
        force=True,
        caller_is_root=False,
        unit_state=lambda _: "active",
    )


@pytest.mark.parametrize(("uid", "ignores"), [(0, True), (1000, False)])
def test_the_pre_line_ignores_leases_only_for_root(uid: int, ignores: bool) -> None:
    """A plan for a caller that is not root (its hooks act --for-uid) never carries
    --ignore-leases, whatever its force says: a lease taken after gpugate run looked is
    refused by the unit's pre."""
    argv = systemd_run_argv(plan(force=True, caller=Caller(uid, uid, "x")), SYSTEMD_RUN)
    pre = next(a for a in argv if a.startswith("--property=ExecStartPre="))
    post = next(a for a in argv if a.startswith("--property=ExecStopPost="))
    assert ("--ignore-leases" in pre) is ignores
    assert "--ignore-leases" not in post


def test_port_writes_the_hooks_config_without_a_warning(host: FakeHost) -> None:
    """--port: the effective config with the ports, as a validated copy (a tuple, sorted, no
    repeats), dumped with no pydantic serializer warning (warnings are errors here)."""
    loaded = host.config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path, cleanup = hook_config(loaded, "gpugate-run-x-1.service", None, [8000, 22, 8000])
        assert path is not None and cleanup == (path,)
        reread = load_config(None, path)
    assert reread.config.ports == (22, 8000)
    assert reread.config.lock_dir == loaded.config.lock_dir


def test_a_changed_config_is_validated() -> None:
    """GateConfig.changed validates as a file's values are: a list for a tuple field becomes
    the tuple the field holds, a bad value is refused, and the copy dumps without a warning."""
    config = GateConfig()
    with pytest.raises(ValidationError):
        config.changed(ports=(0,))
    with pytest.raises(ValidationError):
        config.changed(ports=("8000",))
    changed = config.changed(ports=[8000], gpus=(0, 1))
    assert changed.ports == (8000,) and isinstance(changed.ports, tuple)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert changed.model_dump()["ports"] == [8000]
    assert config.ports == ()


def test_port_with_a_lock_dir_it_cannot_write_is_one_line_before_anything_starts(
    host: FakeHost,
) -> None:
    """--port's config cannot be written (a file where lock_dir/run should be): exit 73 and
    one line naming the path, not an internal error."""
    loaded = host.config()
    loaded.config.lock_dir.mkdir(parents=True, exist_ok=True)
    (loaded.config.lock_dir / "run").write_text("")
    with pytest.raises(StateUnwritable) as raised:
        hook_config(loaded, "gpugate-run-x-1.service", None, [8000])
    assert raised.value.exit_code is ExitCode.STATE_UNWRITABLE
    assert Path(str(raised.value.path)).parent == loaded.config.lock_dir / "run"
    assert "\n" not in raised.value.message


@pytest.mark.message
@pytest.mark.parametrize(("ours", "theirs"), [(True, True), (True, False), (False, True)])
def test_share_gpus_lets_a_run_start_beside_a_sharing_lease_only(
    host: FakeHost, *, ours: bool, theirs: bool
) -> None:
    """`gpugate run --share-gpus` beside a unit or run that shares: no refusal. One side not
    sharing: exit 22, the line naming the setting that would let it share, never
    kill_other_units."""
    gpus = host.memory.gpus()
    loaded = host.config(share_gpus=ours)
    write_lease(loaded.config.lock_dir, new_lease("vllm.service", gpus[0:1], share=theirs))
    if ours and theirs:
        refuse_leased(
            loaded, "gpugate-run-x-1.service", gpus[0:1], force=False, unit_state=lambda _: "active"
        )
        return
    with pytest.raises(GateError) as refused:
        refuse_leased(
            loaded, "gpugate-run-x-1.service", gpus[0:1], force=False, unit_state=lambda _: "active"
        )
    assert refused.value.exit_code is ExitCode.HELD_BY_OTHERS
    message = refused.value.message
    assert "kill_other_units" not in message
    if theirs:
        assert "to run beside it, start it with gpugate run --share-gpus" in message
    else:
        assert "does not share them" in message and "its gpugate config too" in message


def test_share_gpus_is_written_into_the_hooks_config(host: FakeHost) -> None:
    """--share-gpus: the hooks' config says share_gpus = true (both hooks read it), with the
    ports where --port is given too; without either, no file."""
    loaded = host.config()
    assert hook_config(loaded, "gpugate-run-x-1.service", None, None) == (None, ())
    path, cleanup = hook_config(loaded, "gpugate-run-x-1.service", None, None, share=True)
    assert path is not None and cleanup == (path,)
    assert load_config(None, path).config.share_gpus
    path, _ = hook_config(loaded, "gpugate-run-x-1.service", None, [8000], share=True)
    assert path is not None
    reread = load_config(None, path).config
    assert reread.share_gpus and reread.ports == (8000,)


def test_share_gpus_is_an_option_of_run() -> None:
    args = build_parser().parse_args(["run", "--share-gpus", "--", "true"])
    assert args.share_gpus
    assert not build_parser().parse_args(["run", "--", "true"]).share_gpus
