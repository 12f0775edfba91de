"""Whole pre runs over real processes for the rest of issue 10: watchers (spared where NVML's
lists are complete, today's behaviour where they are not), the unit's ports (IPv4 and IPv6
listeners are holders; pre returns once the port is free) and respawners (a loop the
application rule may take is taken; one it may not is named, with its own exit code)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpugate.core.outcome import RunSummary
from gpugate.errors import ExitCode
from gpugate.front.commands.status import as_dict, render_table
from gpugate.front.hook import collect
from tests.fakes import FakeHost, alive

LISTENER = textwrap.dedent(
    """
    import socket, sys, time
    family = socket.AF_INET6 if sys.argv[2] == "6" else socket.AF_INET
    server = socket.socket(family)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", int(sys.argv[1])))
    server.listen()
    open(sys.argv[3], "w").close()
    time.sleep(3600)
    """
)

# A GPU user that NVML lists: it holds nvidia0 and claims memory for itself (FakeGpuMemory's
# claim_dir), as a CUDA process has a context.
GPU_USER = textwrap.dedent(
    """
    import os, sys, time
    pid = os.getpid()
    with open(f"/proc/{pid}/stat") as stat:  # registered for the test's cleanup
        start = stat.read().rsplit(")", 1)[1].split()[19]
    with open(os.path.join(sys.argv[2], "..", "started", str(pid)), "w") as f:
        f.write(start)
    handle = open(sys.argv[1], "rb")
    with open(os.path.join(sys.argv[2], str(pid)), "w") as f:
        f.write("0 5000")
    time.sleep(3600)
    """
)


def run(host: FakeHost, **config: object) -> RunSummary:
    return host.run_phase(
        "pre", host.config(**config), host.reporter("pre"), driver_factory=lambda: host.memory
    )


def free_port(family: socket.AddressFamily = socket.AF_INET) -> int:
    with socket.socket(family) as probe:
        probe.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listen(host: FakeHost, port: int, family: str = "4") -> int:
    ready = host.root / f"listening-{port}"
    proc = host.pool.command([sys.executable, "-c", LISTENER, str(port), family, str(ready)])
    deadline = time.monotonic() + 15
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the listener did not start"
        time.sleep(0.02)
    return proc.pid


def port_free(port: int, family: socket.AddressFamily = socket.AF_INET) -> bool:
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
        except OSError:
            return False
        return True


# Watchers


def test_watcher_on_every_gpu_is_spared_next_to_a_stale_server(host: FakeHost) -> None:
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))  # nvidia-smi -l, nvtop
    server, *workers = host.pool.holder(host.gpu_files(0, 1, 2, 3), children=2)
    for pid in workers:
        host.memory.claim(pid, {0, 1, 2, 3}, 20000)
    summary = run(host, gpus=[0, 1, 2, 3])
    assert summary.exit_code is ExitCode.OK
    assert alive(watcher)
    assert not any(alive(pid) for pid in (server, *workers))
    spared = {e["GPUGATE_PID"]: e for e in host.journal.events("process_spared")}
    assert spared[str(watcher)]["GPUGATE_ROLE"] == "watcher"
    (started,) = host.journal.events("run_started")
    assert started["GPUGATE_EVIDENCE"] == "nvml"


@pytest.mark.parametrize("gpus", ["all", [0, 1, 2, 3]])
def test_watchers_of_any_kind_are_never_killed_nor_block(host: FakeHost, gpus: object) -> None:
    watchers = [
        *host.pool.holder(host.gpu_files(*range(8))),  # fd on every GPU
        *host.pool.holder([host.dev / "nvidia2"]),  # fd on one owned GPU
        *host.pool.holder(host.gpu_files(5, 6, 7)),  # only GPUs the unit does not own
        *host.pool.holder([host.dev / "nvidiactl"], children=2),  # a watcher that forks
    ]
    summary = run(host, gpus=gpus)
    assert summary.exit_code is ExitCode.OK
    assert all(alive(pid) for pid in watchers)
    assert not host.journal.events("signal_sent")


def test_without_process_lists_device_files_stay_the_evidence(host: FakeHost) -> None:
    host.memory.lists_processes = False
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))
    summary = run(host, gpus=[0, 1, 2, 3])
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS  # today's behaviour: it straddles
    assert alive(watcher)
    (started,) = host.journal.events("run_started")
    assert started["GPUGATE_EVIDENCE"] == "device-files"
    summary = run(host, gpus="all")
    assert summary.exit_code is ExitCode.OK
    assert not alive(watcher)


def test_unlisted_holder_of_unaccounted_memory_is_no_watcher(host: FakeHost) -> None:
    # A forked child that kept a dead parent's context: NVML lists nobody, memory is used.
    (child,) = host.pool.holder([host.dev / "nvidia1"])
    host.memory.leaked_mib[1] = 30000
    summary = run(host, gpus=[1], pre={"wait_timeout_s": 1.0})
    assert not alive(child)
    assert summary.exit_code is ExitCode.MEMORY_TIMEOUT  # the leak stays: nobody holds it


def test_gpu_user_starting_next_to_a_dying_server_is_killed(host: FakeHost, claims: Path) -> None:
    # First seen while starting up (device open, no context yet): a watcher. Once the server
    # is killed, the memory NVML still shows is nobody's it lists: no longer a watcher; and
    # once it creates its context, NVML lists it. Either way it is killed.
    (stale,) = host.pool.holder([host.dev / "nvidia0"])
    host.memory.claim(stale, {0}, 30000)
    host.memory.release_lag_s = 1.5
    (starting,) = host.pool.holder([host.dev / "nvidia0"])
    timer = threading.Timer(0.5, lambda: (claims / str(starting)).write_text("0 20000"))
    timer.start()
    try:
        summary = run(host, gpus=[0])
    finally:
        timer.cancel()
    assert summary.exit_code is ExitCode.OK
    assert not alive(stale) and not alive(starting)


# Ports


@pytest.mark.parametrize("family", ["4", "6"])
def test_stale_listener_on_the_units_port_is_killed(host: FakeHost, family: str) -> None:
    inet = socket.AF_INET6 if family == "6" else socket.AF_INET
    if inet == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    port = free_port(inet)
    listener = listen(host, port, family)
    other = listen(host, free_port())  # a port the unit does not own
    summary = run(host, ports=[port])
    assert summary.exit_code is ExitCode.OK
    assert not alive(listener) and alive(other)
    assert port_free(port, inet)
    (found,) = host.journal.events("holder_found")
    assert found["GPUGATE_PID"] == str(listener)  # found by the port alone: it held no GPU


def test_port_holder_follows_the_roles(host: FakeHost) -> None:
    port = free_port()
    listener = listen(host, port)
    refused = run(host, ports=[port], pre={"kill_orphans": False})
    assert refused.exit_code is ExitCode.HELD_BY_OTHERS and alive(listener)
    host.put_in_unit(listener)
    assert run(host, ports=[port], pre={"kill_orphans": False}).exit_code is ExitCode.OK
    assert not alive(listener)


def test_port_is_only_the_concern_of_pre(host: FakeHost) -> None:
    port = free_port()
    listener = listen(host, port)
    summary = host.run_phase(
        "post", host.config(ports=[port]), host.reporter("post"), driver_factory=lambda: host.memory
    )
    assert summary.exit_code is ExitCode.OK and alive(listener)


def test_port_server_whole_app_is_taken(host: FakeHost, claims: Path) -> None:
    # The API server listens, its worker holds GPU 0: one application, both found.
    port = free_port()
    script = host.root / "server.sh"
    script.write_text(
        f"{sys.executable} -c {_q(LISTENER)} {port} 4 {host.root}/ready &\n"
        f"{sys.executable} -c {_q(GPU_USER)} {host.dev / 'nvidia0'} {host.root}/claims &\n"
        "wait\n"
    )
    launcher = host.pool.command(["setsid", "bash", str(script)])
    deadline = time.monotonic() + 15
    while not (host.root / "ready").exists() or not list((host.root / "claims").iterdir()):
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    summary = run(host, ports=[port], gpus=[0])
    assert summary.exit_code is ExitCode.OK
    assert launcher.wait(timeout=10) is not None
    assert port_free(port)


# Respawners


@pytest.fixture
def claims(host: FakeHost) -> Iterator[Path]:
    directory = host.root / "claims"
    directory.mkdir(exist_ok=True)
    (host.root / "started").mkdir(exist_ok=True)
    host.memory.claim_dir = directory
    yield directory
    # A loop may have started one more just as gpugate killed it (then orphaned): each GPU
    # user registered itself with its start time; take what still lives.
    for path in (host.root / "started").iterdir():
        pid = int(path.name)
        if alive(pid, int(path.read_text())):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def terminal(host: FakeHost) -> Iterator[tuple[int, int]]:
    """An interactive bash with job control on its own pty: (shell PID, pty master)."""
    master, slave = os.openpty()
    shell = host.pool.command(
        ["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    yield shell.pid, master
    # Stop the shell first so that its loop starts nothing new, then take its children.
    os.kill(shell.pid, signal.SIGSTOP)
    _kill_children(shell.pid)
    os.kill(shell.pid, signal.SIGKILL)
    os.close(master)


def gpu_user_line(host: FakeHost, claims: Path) -> str:
    code = host.root / "gpu_user.py"
    code.write_text(GPU_USER)
    return f"{sys.executable} {code} {host.dev / 'nvidia0'} {claims}"


def wait_for_claims(claims: Path, count: int = 1) -> None:
    deadline = time.monotonic() + 15
    while len(list(claims.iterdir())) < count:
        assert time.monotonic() < deadline, "the loop did not start its server"
        time.sleep(0.02)


def test_loop_in_a_login_shell_is_named_with_its_own_exit_code(
    host: FakeHost, claims: Path, terminal: tuple[int, int]
) -> None:
    shell, master = terminal
    os.write(master, f"while true; do {gpu_user_line(host, claims)}; done\n".encode())
    wait_for_claims(claims)
    summary = run(host, gpus=[0], pre={"wait_timeout_s": 4.0})
    assert summary.exit_code is ExitCode.RESPAWNING
    assert alive(shell), "the login shell is never taken"
    (named,) = [e for e in host.journal.events("timeout") if e["GPUGATE_REASON"] == "respawning"]
    assert named["GPUGATE_PID"] == str(shell)
    assert int(named["GPUGATE_RESPAWNS"]) >= 1
    assert "bash" in named["GPUGATE_COMMAND"]


def test_loop_in_a_launcher_job_is_taken_and_the_run_succeeds(
    host: FakeHost, claims: Path, terminal: tuple[int, int]
) -> None:
    shell, master = terminal
    loop = host.root / "loop.sh"
    loop.write_text(f"while true; do {gpu_user_line(host, claims)}; done\n")
    os.write(master, f"bash {loop} &\n".encode())
    wait_for_claims(claims)
    summary = run(host, gpus=[0], pre={"wait_timeout_s": 4.0})
    assert summary.exit_code is ExitCode.OK
    assert alive(shell)
    assert not host.journal.events("timeout")


def test_a_respawn_during_the_wait_is_killed_within_the_deadline(
    host: FakeHost, claims: Path, terminal: tuple[int, int]
) -> None:
    # The loop gives up after two respawns: each is found during the wait and killed, the
    # parent is named in the journal, and the run ends free.
    shell, master = terminal
    line = gpu_user_line(host, claims)
    os.write(master, f"for i in 1 2 3; do {line}; done\n".encode())
    wait_for_claims(claims)
    summary = run(host, gpus=[0], pre={"wait_timeout_s": 20.0})
    assert summary.exit_code is ExitCode.OK
    assert len(summary.killed) == 3
    (named,) = [
        e for e in host.journal.events("holder_found") if e["GPUGATE_REASON"] == "respawned"
    ]
    assert named["GPUGATE_PID"] == str(shell) and named["GPUGATE_RESPAWNS"] == "2"


def _kill_children(pid: int) -> None:
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)  # our stopped shell's child: it cannot be reused


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_status_shows_watchers_and_the_units_ports(host: FakeHost) -> None:
    (watcher,) = host.pool.holder(host.gpu_files(*range(8)))
    (user,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(user, {0}, 5000)
    port = free_port()
    listener = listen(host, port)
    loaded = host.config(ports=[port], gpus=[0, 1])
    data = as_dict(collect("vllm.service", loaded, host.memory, host.roots), loaded)
    holders = {h["pid"]: h for h in data["holders"]}
    assert holders[watcher]["role"] == "watcher" and not holders[watcher]["orphan"]
    assert holders[user]["role"] == "orphan"
    assert holders[listener]["ports"] == [port] and "port" in holders[listener]["sources"]
    table = render_table(data)
    (line,) = [row for row in table.splitlines() if row.lstrip().startswith(str(listener))]
    assert f" {port} " in line
    row = next(r for r in table.splitlines() if r.lstrip().startswith(str(watcher)))
    assert row.split()[2] == "watcher"  # the ROLE column
