"""Stale applications of other shapes on the simulated GPU host (issue 10), each left by a real
login session (`su -l`: pam_systemd puts it in a logind session scope) whose terminal is an
interactive bash with job control on a pty: a server in a tmux window, one started with
`nohup setsid`, a listener holding the unit's port, a respawning loop, and a GPU watcher.
Each scenario then starts the unit (gpugate on ExecStartPre=) and asserts on what lives, on
systemd's answer, on NVML's memory and on the journal."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator
from typing import Any

import pytest
from incident import (
    CONFIG,
    MIB_PER_GPU,
    PYTHON,
    TERMINAL,
    Host,
    prepare,
    server_cmd,
    unit_text,
)
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

GPUS = (0, 1, 2, 3)
PORT = 8000
UNIT = "vllm.service"
UNIT_CONFIG = f"gpus = [0, 1, 2, 3]\nports = [{PORT}]\n" + CONFIG
# Without the port: the application rule alone must find the API server and its tracker.
RULE_ONLY_CONFIG = "gpus = [0, 1, 2, 3]\n" + CONFIG
LISTENER = (
    "import socket, time; s = socket.socket(socket.AF_INET6); "
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    f"s.bind(('::', {PORT})); s.listen(); time.sleep(36000)"
)


class Login:
    """`su -l root` running the terminal: a logind session, a shell on a pty inside it."""

    def __init__(self, host: Host, name: str) -> None:
        self.host, self.name = host, name
        host.sh(f"rm -f /run/term-{name}.json")
        inner = shlex.join([PYTHON, TERMINAL, name])
        host.sh(f"setsid su -l root -c {shlex.quote('exec ' + inner)} </dev/null >/dev/null 2>&1 &")
        self.shell = host.terminal_shell(name)
        cgroup = host.sh(f"cat /proc/{self.shell}/cgroup")
        assert "/session-" in cgroup, f"not a logind session: {cgroup}"
        self.session = cgroup.rsplit("/session-", 1)[1].split(".scope")[0]

    def type(self, line: str) -> None:
        self.host.type(self.name, line)

    def close(self) -> None:
        self.host.sh(f"loginctl terminate-session {self.session}", check=False)


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    h.reset()


@pytest.fixture
def login(host: Host) -> Iterator[Login]:
    host.reset()
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), UNIT_CONFIG)
    opened = Login(host, "stale")
    yield opened
    host.sh(f"systemctl stop {UNIT} web-8000.service 2>/dev/null", check=False)
    opened.close()
    deadline = time.monotonic() + 30
    while host.sh(f"loginctl show-session {opened.session} 2>/dev/null", False).strip():
        assert time.monotonic() < deadline, "the login session did not end"
        time.sleep(0.2)


def tree(host: Host, pid: int) -> set[int]:
    """pid and every descendant (children of every thread)."""
    found, queue = {pid}, [pid]
    while queue:
        text = host.sh(f"cat /proc/{queue.pop()}/task/*/children 2>/dev/null", False)
        for child in map(int, text.split()):
            if child not in found:
                found.add(child)
                queue.append(child)
    return found


def children(host: Host, pid: int) -> list[int]:
    return [int(p) for p in host.sh(f"cat /proc/{pid}/task/*/children", False).split()]


def wait_for(host: Host, what: str, test: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := test()):
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.2)
    return value


def health(host: Host) -> str:
    return host.sh(
        f'{PYTHON} -c "import urllib.request;'
        f"print(urllib.request.urlopen('http://127.0.0.1:{PORT}/health').status)\"",
        False,
    )


def assert_unit_took_over(host: Host, cursor: str, old: set[int]) -> None:
    host.wait_ready(f"/run/ready-{UNIT}.json")
    assert host.sim.systemctl("is-active", UNIT, check=False).stdout.strip() == "active"
    assert "200" in health(host)
    for pid in old:
        assert not host.alive(pid), f"old process {pid} survived"
    signalled = host.events_after(cursor, GPUGATE_EVENT="signal_sent", GPUGATE_PHASE="pre")
    assert {int(e["GPUGATE_PID"]) for e in signalled} == old
    used = host.used()
    assert all(used[i] == MIB_PER_GPU for i in GPUS), used


def test_tmux_window_server_is_taken_whole_and_tmux_survives(host: Host, login: Login) -> None:
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), RULE_ONLY_CONFIG)
    ready = "/run/ready-stale-tmux.json"
    host.sh(f"rm -f {ready}")
    command = "exec " + server_cmd(GPUS, PORT, ready)
    login.type(f"tmux -f /dev/null new-session -d -s srv {shlex.quote(command)}")
    login.type("tmux new-window -t srv 'bash --norc -i'")
    login.type("tmux send-keys -t srv:1 'sleep 1001 &' Enter")
    old = host.wait_ready(ready)
    tmux = int(host.sh("tmux display -p -t srv '#{pid}'").strip())
    panes = [int(p) for p in host.sh("tmux list-panes -a -F '#{pane_pid}'").split()]
    other_shell = next(p for p in panes if p != old["api_server"])
    job = wait_for(host, "the other pane's job", lambda: children(host, other_shell))
    stale = tree(host, old["api_server"])
    assert len(stale) >= 7, "API server, tracker, engine core, four workers"
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert_unit_took_over(host, cursor, stale)
    for pid in (tmux, other_shell, *job, login.shell):
        assert host.alive(pid), f"{pid} (tmux server, a pane's shell or job, the login) died"


def test_nohup_setsid_server_is_taken_whole(host: Host, login: Login) -> None:
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), RULE_ONLY_CONFIG)
    ready = "/run/ready-stale-setsid.json"
    host.sh(f"rm -f {ready}")
    login.type("sleep 1002 &")
    login.type(f"nohup setsid {server_cmd(GPUS, PORT, ready)} >/dev/null 2>&1 &")
    old = host.wait_ready(ready)
    stale = tree(host, old["api_server"])
    assert host.sh(f"cut -d' ' -f6 /proc/{old['api_server']}/stat").strip() == str(
        old["api_server"]
    ), "the server should lead its own session"
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert_unit_took_over(host, cursor, stale)
    assert host.alive(login.shell)
    assert all(host.alive(pid) for pid in children(host, login.shell))


def test_stale_listener_on_the_port_is_killed_and_the_unit_binds_it(
    host: Host, login: Login
) -> None:
    login.type(f"{PYTHON} -c {shlex.quote(LISTENER)} &")
    listener = wait_for(host, "the listener", lambda: children(host, login.shell))[0]
    wait_for(host, "the port", lambda: f":{PORT:04X} " in host.sh("cat /proc/net/tcp6"))
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert_unit_took_over(host, cursor, {listener})
    (found,) = host.events_after(cursor, GPUGATE_EVENT="holder_found", GPUGATE_PHASE="pre")
    assert found["GPUGATE_PID"] == str(listener)


def test_port_held_by_another_unit_is_refused_and_nothing_killed(host: Host, login: Login) -> None:
    host.sim.install_unit(
        "web-8000.service", f"[Service]\nExecStart={PYTHON} -c {shlex.quote(LISTENER)}\n"
    )
    host.sim.systemctl("start", "web-8000.service")
    wait_for(host, "the port", lambda: f":{PORT:04X} " in host.sh("cat /proc/net/tcp6"))
    listener = host.cgroup_pids("web-8000.service")
    cursor = host.cursor()

    assert host.start(UNIT, check=False) != 0

    assert all(host.alive(pid) for pid in listener)
    assert not host.events_after(cursor, GPUGATE_EVENT="signal_sent")
    (refused,) = host.events_after(cursor, GPUGATE_EVENT="refused", GPUGATE_PHASE="pre")
    assert int(refused["GPUGATE_PID"]) in listener
    (finished,) = host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE="pre")
    assert finished["GPUGATE_RESULT"] == "held_by_others"


def test_respawning_loop_in_a_login_is_named_within_the_deadline(host: Host, login: Login) -> None:
    short = UNIT_CONFIG.replace(
        "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30",
        "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 8",
    )
    assert short != UNIT_CONFIG
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), short)
    ready = "/run/ready-stale-loop.json"
    login.type(f"while true; do {server_cmd(GPUS, PORT, ready)}; done")
    host.wait_ready(ready)
    cursor = host.cursor()
    host.sh(f"rm -f /run/ready-{UNIT}.json")
    # pre must end (else the guard's TimeoutExpired): its deadline, not the loop, decides.
    assert host.sim.run(["systemctl", "start", UNIT], check=False, timeout=60).returncode != 0
    assert host.alive(login.shell), "the login shell is never taken"
    (named,) = [
        e
        for e in host.events_after(cursor, GPUGATE_EVENT="timeout", GPUGATE_PHASE="pre")
        if "respawn" in e["MESSAGE"]
    ]
    assert named["GPUGATE_PID"] == str(login.shell)
    assert int(named["GPUGATE_RESPAWNS"]) >= 1
    (finished,) = host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE="pre")
    assert finished["GPUGATE_RESULT"] == "respawning"


def test_watcher_on_every_device_lives_and_the_stale_server_dies(host: Host, login: Login) -> None:
    devices = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
    redirects = " ".join(f"{3 + i}</dev/{name}" for i, name in enumerate(devices))
    login.type(f"bash -c {shlex.quote(f'exec {redirects} sleep 36001')} &")
    watcher = wait_for(host, "the watcher", lambda: children(host, login.shell))[0]
    ready = "/run/ready-stale-watched.json"
    host.sh(f"rm -f {ready}")
    login.type(f"nohup setsid {server_cmd(GPUS, PORT, ready)} >/dev/null 2>&1 &")
    old = host.wait_ready(ready)
    stale = tree(host, old["api_server"])
    status = host.status()
    roles = {h["pid"]: h for h in status["holders"]}
    assert set(roles[watcher]["gpus"]) == set(range(8))
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert_unit_took_over(host, cursor, stale)
    assert host.alive(watcher)
    spared = host.events_after(cursor, GPUGATE_EVENT="process_spared", GPUGATE_PHASE="pre")
    assert any(e["GPUGATE_PID"] == str(watcher) and e["GPUGATE_ROLE"] == "watcher" for e in spared)
    unit_status = json.loads(host.sim.run(["gpugate", "status", UNIT, "--json"], timeout=60).stdout)
    (shown,) = [h for h in unit_status["holders"] if h["pid"] == watcher]
    assert shown["role"] == "watcher"
