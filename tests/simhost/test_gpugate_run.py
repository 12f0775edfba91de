"""`gpugate run` on the simulated GPU host (issue 22): a vLLM-like server started by hand through
gpugate run, from a login's terminal (tmux on a pty inside a logind session), becomes a
transient unit with gpugate's hooks. Closing the terminal or Ctrl-C stops its whole cgroup and
post frees the GPUs; while it runs its lease refuses a unit (and another run) onto its GPUs."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

import pytest
from incident import CONFIG, PYTHON, Host, prepare, server_cmd, unit_text
from sandbox import SimHost
from test_stale_apps import Login, tree, wait_for

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

GPUS = (0, 1, 2, 3)
UNIT = "vllm.service"
RUN_CONFIG = "/etc/gpugate/run.toml"  # the hand runs' hooks: short grace, as the units'
STATUS_FILE = "/run/run-status"
READY = "/run/ready-hand-run.json"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    h.sim.write_file(RUN_CONFIG, CONFIG)
    yield h
    h.reset()


@pytest.fixture
def login(host: Host) -> Iterator[Login]:
    host.reset()
    host.sh(
        "systemctl stop 'gpugate-run-*.service' 2>/dev/null; rm -f /run/gpugate/leases/*", False
    )
    host.install(UNIT, unit_text(UNIT, GPUS, 8000), f"gpus = [0, 1, 2, 3]\n{CONFIG}")
    host.sh(f"rm -f {STATUS_FILE} {READY}")
    opened = Login(host, "run")
    yield opened
    host.sh("tmux kill-server 2>/dev/null; systemctl stop 'gpugate-run-*.service'", False)
    opened.close()


def run_in_tmux(login: Login, run_args: str, command: str) -> None:
    """`gpugate run ARGS -- COMMAND` as a tmux session's command (a terminal of its own);
    its exit status lands in STATUS_FILE."""
    line = f"gpugate run --config {RUN_CONFIG} {run_args} -- {command}; echo $? > {STATUS_FILE}"
    login.type(f"tmux -f /dev/null new-session -d -s hand {shlex.quote(line)}")


def unit_of(host: Host, pid: int) -> str:
    cgroup = host.sh(f"cat /proc/{pid}/cgroup").strip().split("::", 1)[1]
    assert cgroup.startswith("/system.slice/gpugate-run-"), cgroup
    return cgroup.rsplit("/", 1)[1]


def journal_of(host: Host, unit: str) -> list[dict[str, Any]]:
    return host.journal_json("-u", unit)


def assert_freed(host: Host, unit: str, pids: set[int]) -> None:
    """Every process of the run gone and GPUs 0-3 free within the grace plus the release,
    its lease released, and gpugate's post in the transient unit's journal."""
    wait_for(host, "the hand run's processes to end", lambda: not any(map(host.alive, pids)), 60)
    wait_for(host, "GPUs 0-3 to be free", lambda: host.free(GPUS), 60)
    wait_for(
        host,
        "the unit to go",
        lambda: host.sh(f"systemctl is-active {unit}", False).strip() in ("inactive", "failed", ""),
        60,
    )
    entries = journal_of(host, unit)
    post = [e for e in entries if e.get("GPUGATE_PHASE") == "post"]
    assert post, f"no gpugate post in journalctl -u {unit}"
    assert any(e.get("GPUGATE_PHASE") == "pre" for e in entries)
    assert not host.sh(f"ls /run/gpugate/leases/{unit}.json 2>/dev/null", False).strip(), "\n".join(
        e["MESSAGE"] for e in entries[-12:]
    )


def started_server(host: Host, login: Login) -> tuple[str, set[int]]:
    run_in_tmux(login, "--gpus 0,1,2,3", server_cmd(GPUS, 8001, READY))
    pids = host.wait_ready(READY)
    stale = tree(host, pids["api_server"])
    assert len(stale) >= 7, "API server, tracker, engine core, four workers"
    return unit_of(host, pids["api_server"]), stale


def test_closed_terminal_stops_the_run_and_frees_its_gpus(host: Host, login: Login) -> None:
    unit, pids = started_server(host, login)
    user = host.sim.systemctl("show", "-p", "User", "--value", unit).stdout.strip()
    assert user in ("", "root")

    # While it runs: a unit onto its GPUs is refused, naming it, who started it and when.
    cursor = host.cursor()
    assert host.start(UNIT, check=False) != 0
    refused = host.events_after(cursor, GPUGATE_EVENT="refused", GPUGATE_PHASE="pre")
    (leased,) = [e for e in refused if e.get("GPUGATE_REASON") == "leased"]
    assert leased["GPUGATE_GPU"] == ",".join(map(str, GPUS)), leased
    assert all(host.alive(pid) for pid in pids)
    status = host.status()
    for gpu in status["gpus"]:
        assert (unit in gpu["leased_to"]) == (gpu["index"] in GPUS), gpu
    (lease,) = [item for item in status["leases"] if item["unit"] == unit]
    assert lease["started_by"].startswith("root (uid 0") and lease["gpus"] == list(GPUS)

    host.sh("tmux kill-session -t hand")

    assert_freed(host, unit, pids)


def test_ctrl_c_ends_the_run_the_same_way(host: Host, login: Login) -> None:
    unit, pids = started_server(host, login)

    host.sh("tmux send-keys -t hand C-c")

    assert_freed(host, unit, pids)
    status = wait_for(host, "the exit status", lambda: host.sh(f"cat {STATUS_FILE}", False))
    # The API server dies of the SIGINT (Python re-raises an uncaught KeyboardInterrupt).
    assert int(status) == 130


@pytest.mark.parametrize(("command", "expected"), [("sh -c 'exit 7'", 7), ("sleep 1000", 130)])
def test_exit_status_is_the_commands_on_a_terminal(
    host: Host, login: Login, command: str, expected: int
) -> None:
    run_in_tmux(login, "--gpus 5 --name hand-status", command)
    if expected == 130:
        wait_for(
            host,
            "the run",
            lambda: host.sh("systemctl is-active hand-status", False).strip() == "active",
        )
        host.sh("tmux send-keys -t hand C-c")
    status = wait_for(host, "the exit status", lambda: host.sh(f"cat {STATUS_FILE}", False))
    assert int(status) == expected


def gpugate_run(host: Host, args: str, stdin: str | None = None) -> Any:
    return host.sim.run(
        f"gpugate run --config {RUN_CONFIG} {args}", check=False, input=stdin, timeout=120
    )


def test_pipe_mode_status_and_output(host: Host) -> None:
    host.reset()
    text = "hello through a pipe\n"
    done = gpugate_run(host, "--gpus 1 -- /bin/cat", stdin=text)
    assert done.returncode == 0, done.stderr
    assert done.stdout == text
    assert "gpugate-run-cat-" in done.stderr  # systemd-run's transient unit
    assert gpugate_run(host, "--gpus 1 -- sh -c 'exit 7'").returncode == 7
    assert gpugate_run(host, "--gpus 1 -- sh -c 'kill -TERM $$'").returncode == 143
    seen = gpugate_run(host, "--gpus 2,3 -- sh -c 'echo $CUDA_VISIBLE_DEVICES $GPUGATE_STARTED_BY'")
    assert seen.stdout.startswith("2,3 root (uid 0")
    # the caller's variables go along, gpugate's own and the loader's do not
    env = host.sim.run(
        f"gpugate run --config {RUN_CONFIG} --gpus 1 -- /usr/bin/env",
        env={"MY_SETTING": "x y", "GPUGATE_PROC_ROOT": "/tmp", "LD_PRELOAD": "/nonexistent.so"},
        check=False,
    )
    assert env.returncode == 0, env.stderr
    assert "MY_SETTING=x y" in env.stdout
    assert "GPUGATE_PROC_ROOT" not in env.stdout and "LD_PRELOAD" not in env.stdout
    assert host.free(GPUS)


def test_ctrl_c_in_pipe_mode_returns_once_the_unit_is_gone(host: Host) -> None:
    """Ctrl-C where stdin is no terminal: SIGINT reaches the whole process group, systemd-run
    included; gpugate run stops the unit and returns only after its post."""
    host.reset()
    pid = host.sh(
        f"setsid gpugate run --config {RUN_CONFIG} --gpus 2 --name pipe-int -- "
        "sleep 1000 </dev/null >/run/pipe-int.out 2>&1 & echo $!"
    ).strip()
    wait_for(
        host,
        "the run",
        lambda: host.sh("systemctl is-active pipe-int", False).strip() == "active",
    )
    sleeper = host.cgroup_pids("pipe-int.service")
    assert sleeper
    host.sh(f"kill -INT -{pid}")
    wait_for(host, "gpugate run to end", lambda: not host.alive(int(pid)), 60)
    state = host.sim.systemctl("is-active", "pipe-int", check=False).stdout.strip()
    assert state in ("inactive", "failed")
    assert not any(map(host.alive, sleeper))
    posts = [e for e in journal_of(host, "pipe-int.service") if e.get("GPUGATE_PHASE") == "post"]
    assert posts and posts[-1]["GPUGATE_EVENT"] == "run_finished", posts[-1:]


def test_bad_inputs_are_one_line_errors_and_start_nothing(host: Host) -> None:
    host.reset()
    host.install(UNIT, unit_text(UNIT, GPUS, 8000), f"gpus = [0, 1, 2, 3]\n{CONFIG}")
    cases = {
        "--gpus 9 -- true": (78, "GPU index 9 does not exist"),
        "--gpus x -- true": (64, "is not a GPU index"),
        "--gpus 0": (64, "no COMMAND given"),
        "--name vllm -- true": (64, "systemd already has vllm.service"),
        "--name 'a b' -- true": (64, "not a plain unit name"),
        # systemd-run unescapes Exec lines: the hooks would act for prod-vllm.service
        "--name 'prod\\x2dvllm' -- true": (64, "not a plain unit name"),
        "--name=-x -- true": (64, "not a plain unit name"),
        "--name x.socket -- true": (64, "makes a service"),
        "--gpus 0 -- /no/such/program": (64, "not an executable file"),
        "--gpus 0 -- no-such-program": (64, "command not found on PATH"),
        "--port 0 -- true": (64, "not a TCP port"),
        "--config '/etc/a b.toml' --gpus 0 -- true": (64, "use a path of letters"),
    }
    before = host.sim.systemctl("list-units", "--all", "--no-legend", "gpugate-run-*").stdout
    for args, (code, text) in cases.items():
        done = gpugate_run(host, args)
        assert done.returncode == code, (args, done.stderr)
        assert text in done.stderr, (args, done.stderr)
        assert done.stderr.strip().splitlines()[-1].startswith("gpugate"), done.stderr
    after = host.sim.systemctl("list-units", "--all", "--no-legend", "gpugate-run-*").stdout
    assert after == before


def test_name_clash_with_a_running_hand_run(host: Host, login: Login) -> None:
    run_in_tmux(login, "--gpus 6 --name hand-one", "sleep 1000")
    wait_for(
        host, "the run", lambda: host.sh("systemctl is-active hand-one", False).strip() == "active"
    )
    clash = gpugate_run(host, "--gpus 7 --name hand-one -- true")
    assert clash.returncode == 64, clash.stderr


def test_run_onto_leased_gpus_is_refused_unless_forced(host: Host) -> None:
    host.reset()
    host.install(UNIT, unit_text(UNIT, GPUS, 8000), f"gpus = [0, 1, 2, 3]\n{CONFIG}")
    host.start(UNIT)
    host.wait_ready(f"/run/ready-{UNIT}.json")
    refused = gpugate_run(host, "--gpus 2,5 -- true")
    assert refused.returncode == 22, refused.stderr
    assert refused.stderr.count("\n") == 1  # gpugate's refusal alone: systemd-run never ran
    # An idle unit leasing GPU 4-5 holds no process there: --force runs onto it.
    host.install(
        "idle.service",
        "[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=4,5\nExecStartPre=/usr/bin/gpugate pre %n\n"
        "ExecStopPost=/usr/bin/gpugate post %n\nExecStart=/bin/sleep 1000\n",
        CONFIG,
    )
    host.start("idle.service")
    try:
        assert gpugate_run(host, "--gpus 5 -- true").returncode == 22
        forced = gpugate_run(host, "--gpus 5 --force -- sh -c 'exit 3'")
        assert forced.returncode == 3, forced.stderr
        # the forced run's own pre said so in its journal, and took nothing from idle
        assert host.sim.systemctl("is-active", "idle.service").stdout.strip() == "active"
    finally:
        host.sh("systemctl stop idle.service vllm.service", False)


def test_a_run_with_share_gpus_runs_beside_a_sharing_unit(host: Host) -> None:
    """issue 46: `gpugate run --share-gpus` onto a GPU that a unit with share_gpus = true
    serves on starts beside it, and its post (exit 0) leaves the unit alone; without it, the
    run is refused (22) naming the option; the unit's server never touched."""
    host.reset()
    unit = "vllm-shared.service"
    host.install(unit, unit_text(unit, (2,), 8003), f"gpus = [2]\nshare_gpus = true\n{CONFIG}")
    host.start(unit)
    ready = host.wait_ready(f"/run/ready-{unit}.json")
    try:
        refused = gpugate_run(host, "--gpus 2 -- true")
        assert refused.returncode == 22, refused.stderr
        assert "gpugate run --share-gpus" in refused.stderr, refused.stderr
        assert "kill_other_units" not in refused.stderr
        beside = gpugate_run(host, "--gpus 2 --share-gpus --name share-run -- sh -c 'exit 3'")
        assert beside.returncode == 3, beside.stderr
        posts = [e for e in journal_of(host, "share-run.service") if e.get("GPUGATE_PHASE")]
        finished = [e for e in posts if e["GPUGATE_EVENT"] == "run_finished"]
        assert [(e["GPUGATE_PHASE"], e["GPUGATE_RESULT"]) for e in finished] == [
            ("pre", "success"),
            ("post", "success"),
        ], finished
        assert all(host.alive(pid) for pid in ready["workers"])
        assert host.sim.systemctl("is-active", unit).stdout.strip() == "active"
        assert not host.sh("ls /run/gpugate/run/ 2>/dev/null", False).strip()  # config removed
    finally:
        host.sh(f"systemctl stop {unit}", False)


def test_port_is_freed_by_the_runs_pre(host: Host) -> None:
    host.reset()
    listener = host.sim.spawn_scope(
        [
            PYTHON,
            "-c",
            "import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 8002));"
            "s.listen(); time.sleep(3600)",
        ],
        unit="hand-listener.scope",
    )
    del listener
    wait_for(host, "the port", lambda: ":1F42 " in host.sh("cat /proc/net/tcp"))
    # A caller's loader variables reach neither the unit nor its root hooks (issue 34, rule 5);
    # --port's config is written without a pydantic warning.
    done = host.sim.run(
        f"env LD_LIBRARY_PATH=/opt/caller-libs GCONV_PATH=/opt/gconv gpugate run --config "
        f"{RUN_CONFIG} --gpus 0 --port 8002 -- "
        "sh -c 'echo ran ${LD_LIBRARY_PATH-unset} ${GCONV_PATH-unset}'",
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran", "unset", "unset"], done.stdout
    assert "Warning" not in done.stderr and "Pydantic" not in done.stderr, done.stderr
    assert ":1F42 00000000:0000 0A" not in host.sh("cat /proc/net/tcp")
    assert not host.sh("ls /run/gpugate/run/ 2>/dev/null", False).strip()  # config removed


def test_not_root_without_sudo_or_polkit_is_refused_by_systemd(host: Host) -> None:
    host.reset()
    host.sh("id alice >/dev/null 2>&1 || useradd -m alice")
    done = host.sim.run(
        f"runuser -u alice -- gpugate run --config {RUN_CONFIG} --gpus 0 -- /usr/bin/id -u",
        check=False,
    )
    assert done.returncode != 0
    assert "gpugate-run-id-" not in host.sim.systemctl("list-units", "--all", "--no-legend").stdout
    # What sudo hands gpugate (root, SUDO_UID/SUDO_GID of the caller): the command runs as the
    # caller, in the caller's working directory, with the caller's HOME and USER.
    uid, gid = host.sh("id -u alice; id -g alice").split()
    as_alice = host.sim.run(
        f"cd /home/alice && gpugate run --config {RUN_CONFIG} --gpus 0 -- "
        "sh -c 'echo $(id -u) $(id -g) $PWD $HOME $USER'",
        env={"SUDO_UID": uid, "SUDO_GID": gid, "SUDO_USER": "alice", "HOME": "/root"},
        check=False,
    )
    assert as_alice.returncode == 0, as_alice.stderr
    assert as_alice.stdout.split() == [uid, gid, "/home/alice", "/home/alice", "alice"]
    if not host.sh("command -v sudo", False).strip():
        pytest.skip("sudo is not installed on this machine (nor in the simulated host)")
    host.sh(
        "echo 'alice ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/alice; chmod 440 /etc/sudoers.d/alice"
    )
    via_sudo = host.sim.run(
        f"runuser -u alice -- sudo gpugate run --config {RUN_CONFIG} --gpus 0 -- /usr/bin/id -u",
        check=False,
    )
    assert via_sudo.returncode == 0, via_sudo.stderr
    assert via_sudo.stdout.strip() == host.sh("id -u alice").strip()
