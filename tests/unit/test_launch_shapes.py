"""The application rule over real launches: each way a stale server is commonly started is
really started (a vLLM-shaped tree: API server, resource tracker, engine core, workers), and
`app_tree` from one worker must take exactly the server's tree plus the launchers that only
wait on it, and never the shell, tmux or screen server, or another pane's shell or job."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from gpugate.config.schema import GateConfig
from gpugate.core.discover import Discovery, self_and_ancestors
from gpugate.core.roles import app_tree
from gpugate.host.scan import ProcFs

FAKE_VLLM = Path(__file__).parents[1] / "simhost" / "workload" / "fake_vllm.py"
PY = sys.executable
START_TIMEOUT_S = 60.0


@dataclass
class Launch:
    """What one launch shape started; `cleanup` kills exactly these processes."""

    workdir: Path
    ready: Path
    launchers: list[int] = field(default_factory=list)  # must be taken with the server
    kept: list[int] = field(default_factory=list)  # must survive: shells, servers, other jobs
    pinned: list[psutil.Process] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)

    def pin(self, pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.pinned.append(psutil.Process(pid))

    def server_cmd(self) -> list[str]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return [
            PY,
            str(FAKE_VLLM),
            "--gpus",
            "0,1",
            "--port",
            str(port),
            "--mib",
            "100",
            "--state-dir",
            str(self.workdir / "state"),
            "--dev-root",
            str(self.workdir / "dev"),
            "--ready-file",
            str(self.ready),
        ]

    def shell_line(self) -> str:
        return " ".join(self.server_cmd()) + f" >{self.workdir}/server.log 2>&1"

    def wait_ready(self) -> dict[str, object]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.exists():
            if time.monotonic() > deadline:
                log = self.workdir / "server.log"
                raise TimeoutError(
                    f"server did not start: {log.read_text() if log.exists() else ''}"
                )
            time.sleep(0.05)
        pids: dict[str, object] = json.loads(self.ready.read_text())
        api = psutil.Process(int(str(pids["api_server"])))
        self.pinned.append(api)
        self.pinned.extend(api.children(recursive=True))
        return pids

    def cleanup(self) -> None:
        for undo in self.undo:
            undo()
        for process in self.pinned:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks the create time: a reused PID is not hit


def pty_shell(launch: Launch, *lines: str) -> int:
    """An interactive bash with job control on a new pty that is its controlling terminal."""
    master, slave = os.openpty()

    shell = subprocess.Popen(
        # setsid --ctty: a new session whose controlling terminal is the pty (stdin)
        ["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "PS1": "$ "},
    )
    os.close(slave)
    launch.pin(shell.pid)
    launch.undo.append(lambda: (shell.kill(), shell.wait(), os.close(master)))
    os.set_blocking(master, False)
    for line in lines:
        os.write(master, (line + "\n").encode())
    return shell.pid


# Each shape starts the server and returns the PIDs its rule concerns; the server's own tree
# (from the ready file) is always expected whole.


def shape_ssh_no_tty(launch: Launch) -> None:
    """`ssh host 'nohup vllm serve ... &'`: sshd runs the command in a session of its own
    (setsid, no tty); the command shell returns at once and the server is an orphan."""
    line = "nohup " + launch.shell_line() + " &"
    subprocess.run(["sh", "-c", line], start_new_session=True, check=True)


def shape_interactive_job(launch: Launch) -> None:
    """Typed into an interactive shell with job control, as a background job, next to another
    job."""
    launch.kept.append(pty_shell(launch, "sleep 1000 &", launch.shell_line() + " &"))
    _other_jobs(launch)


def shape_interactive_foreground(launch: Launch) -> None:
    launch.kept.append(pty_shell(launch, "sleep 1000 &", launch.shell_line()))
    _other_jobs(launch)


def _other_jobs(launch: Launch) -> None:
    shell = psutil.Process(launch.kept[-1])
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any(c.name() == "sleep" for c in shell.children()):
        if time.monotonic() > deadline:
            raise TimeoutError("the shell did not start its job")
        time.sleep(0.02)
    for child in shell.children():
        if child.name() == "sleep":
            launch.kept.append(child.pid)
            launch.pinned.append(child)


def shape_setsid(launch: Launch) -> None:
    subprocess.run(["sh", "-c", "setsid " + launch.shell_line() + " &"], check=True)


def shape_nohup_setsid_from_shell(launch: Launch) -> None:
    """`nohup setsid vllm serve &` typed into an interactive shell: setsid forks (the job leads
    its group), the server leads its own session and is orphaned."""
    launch.kept.append(
        pty_shell(launch, "sleep 1000 &", "nohup setsid " + launch.shell_line() + " &")
    )
    _other_jobs(launch)


def shape_setsid_wait(launch: Launch) -> None:
    """`setsid -w vllm serve` from a shell job: the setsid process only waits on the server."""
    launch.kept.append(pty_shell(launch, "sleep 1000 &", "setsid -w " + launch.shell_line() + " &"))
    _other_jobs(launch)
    _expect_launchers(launch, 1)


def shape_launcher_script(launch: Launch) -> None:
    """A launcher script run as a job: it starts the server and only waits on it."""
    script = launch.workdir / "launch.sh"
    script.write_text("#!/bin/bash\n" + launch.shell_line() + " &\nwait\n")
    launch.kept.append(pty_shell(launch, "sleep 1000 &", f"bash {script} &"))
    _other_jobs(launch)
    _expect_launchers(launch, 1)


def shape_popen_new_session(launch: Launch) -> None:
    """A Python launcher, run as a shell job, that starts the server with
    Popen(start_new_session=True) and waits on it."""
    code = (
        "import subprocess, sys; "
        f"sys.exit(subprocess.Popen({launch.server_cmd()!r}, start_new_session=True, "
        f"stdout=open({str(launch.workdir / 'server.log')!r}, 'w'), stderr=subprocess.STDOUT).wait())"
    )
    launch.kept.append(pty_shell(launch, "sleep 1000 &", f"{PY} -c {_quote(code)} &"))
    _other_jobs(launch)
    _expect_launchers(launch, 1)


def shape_double_fork(launch: Launch) -> None:
    code = (
        "import os, sys\n"
        "if os.fork(): sys.exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): os._exit(0)\n"
        f"fd = os.open({str(launch.workdir / 'server.log')!r}, os.O_WRONLY | os.O_CREAT)\n"
        "os.dup2(fd, 1); os.dup2(fd, 2)\n"
        f"os.execv({PY!r}, {launch.server_cmd()!r})\n"
    )
    subprocess.run([PY, "-c", code], check=True)


def shape_start_stop_daemon(launch: Launch) -> None:
    if shutil.which("start-stop-daemon") is None:
        pytest.skip("start-stop-daemon is not installed")
    cmd = launch.server_cmd()
    subprocess.run(
        [
            "start-stop-daemon",
            "--start",
            "--background",
            "--pidfile",
            str(launch.workdir / "ssd.pid"),
            "--make-pidfile",
            "--startas",
            cmd[0],
            "--",
            *cmd[1:],
        ],
        check=True,
    )


def _tmux(launch: Launch) -> list[str]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/setup installs it)")
    socket_name = f"gpugate-test-{uuid.uuid4().hex[:8]}"
    base = ["tmux", "-L", socket_name, "-f", "/dev/null"]
    launch.undo.append(lambda: subprocess.run([*base, "kill-server"], capture_output=True))
    launch.undo.append(
        lambda: Path(f"/tmp/tmux-{os.getuid()}/{socket_name}").unlink(missing_ok=True)
    )
    return base


def _tmux_kept(launch: Launch, base: list[str]) -> None:
    server = subprocess.run([*base, "display", "-p", "#{pid}"], capture_output=True, text=True)
    launch.kept.append(int(server.stdout))
    launch.pin(int(server.stdout))


def shape_tmux_command(launch: Launch) -> None:
    """`tmux new-session -d 'vllm serve ...'`, next to a window with an interactive shell."""
    base = _tmux(launch)
    env = {**os.environ, "SHELL": "/bin/bash"}
    subprocess.run(
        [*base, "new-session", "-d", "-s", "srv", "exec " + launch.shell_line()],
        env=env,
        check=True,
    )
    subprocess.run([*base, "new-window", "-t", "srv", "bash --norc -i"], env=env, check=True)
    subprocess.run([*base, "send-keys", "-t", "srv:1", "sleep 1000 &", "Enter"], check=True)
    _tmux_kept(launch, base)
    _tmux_panes(launch, base, skip_server=True)


def shape_tmux_typed(launch: Launch) -> None:
    """Typed into a tmux pane's interactive shell, in the foreground; another pane runs a job."""
    base = _tmux(launch)
    env = {**os.environ, "SHELL": "/bin/bash"}
    subprocess.run([*base, "new-session", "-d", "-s", "srv", "bash --norc -i"], env=env, check=True)
    subprocess.run([*base, "split-window", "-t", "srv", "bash --norc -i"], env=env, check=True)
    subprocess.run([*base, "send-keys", "-t", "srv:0.0", launch.shell_line(), "Enter"], check=True)
    subprocess.run([*base, "send-keys", "-t", "srv:0.1", "sleep 1000 &", "Enter"], check=True)
    _tmux_kept(launch, base)
    _tmux_panes(launch, base, skip_server=False)


def _tmux_panes(launch: Launch, base: list[str], *, skip_server: bool) -> None:
    launch.wait_ready()
    api = int(str(json.loads(launch.ready.read_text())["api_server"]))
    panes = subprocess.run(
        [*base, "list-panes", "-a", "-F", "#{pane_pid}"], capture_output=True, text=True
    )
    for pid in map(int, panes.stdout.split()):
        if skip_server and pid == api:
            continue
        launch.kept.append(pid)
        launch.pin(pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            jobs = [c for c in psutil.Process(pid).children() if c.name() == "sleep"]
            if jobs or not skip_server:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the pane did not start its job")
            time.sleep(0.02)
        for job in jobs:
            launch.kept.append(job.pid)
            launch.pinned.append(job)


def shape_screen_command(launch: Launch) -> None:
    if shutil.which("screen") is None:
        pytest.skip("screen is not installed (scripts/setup installs it)")
    name = f"gpugate-test-{uuid.uuid4().hex[:8]}"
    launch.undo.append(
        lambda: subprocess.run(["screen", "-S", name, "-X", "quit"], capture_output=True)
    )
    subprocess.run(["screen", "-dmS", name, "sh", "-c", "exec " + launch.shell_line()], check=True)
    pids = launch.wait_ready()
    screen = psutil.Process(int(str(pids["api_server"]))).parent()
    assert screen is not None
    launch.kept.append(screen.pid)
    launch.pinned.append(screen)


def shape_cgroup_scope(launch: Launch) -> None:
    """What `systemd-run --scope` leaves: the server in a cgroup of its own, under the shell."""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.procs").exists():
        unified = Path("/sys/fs/cgroup")
    if not (unified / "cgroup.controllers").exists() and unified.name != "unified":
        unified = None  # type: ignore[assignment]
    if unified is None or os.geteuid() != 0:
        pytest.skip("needs root and a writable cgroup v2 hierarchy")
    scope = unified / f"gpugate-test-{uuid.uuid4().hex[:8]}.scope"
    try:
        scope.mkdir()
    except OSError as err:
        pytest.skip(f"cannot make a cgroup: {err}")
    launch.undo.append(lambda: _remove_cgroup(scope))
    line = f"echo $$ > {scope}/cgroup.procs && exec " + launch.shell_line()
    launch.kept.append(pty_shell(launch, "sleep 1000 &", f"sh -c '{line}' &"))
    _other_jobs(launch)


def _remove_cgroup(path: Path) -> None:
    for _ in range(100):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.05)


def _expect_launchers(launch: Launch, count: int) -> None:
    pids = launch.wait_ready()
    process = psutil.Process(int(str(pids["api_server"])))
    for _ in range(count):
        parent = process.parent()
        assert parent is not None
        launch.launchers.append(parent.pid)
        launch.pinned.append(parent)
        process = parent


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


SHAPES: dict[str, Callable[[Launch], None]] = {
    "ssh-no-tty-nohup": shape_ssh_no_tty,
    "interactive-job": shape_interactive_job,
    "interactive-foreground": shape_interactive_foreground,
    "setsid": shape_setsid,
    "nohup-setsid-from-shell": shape_nohup_setsid_from_shell,
    "setsid-wait": shape_setsid_wait,
    "launcher-script": shape_launcher_script,
    "popen-new-session": shape_popen_new_session,
    "double-fork": shape_double_fork,
    "start-stop-daemon": shape_start_stop_daemon,
    "tmux-command": shape_tmux_command,
    "tmux-typed": shape_tmux_typed,
    "screen-command": shape_screen_command,
    "cgroup-scope": shape_cgroup_scope,
}


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (dev / name).write_bytes(b"")
    started = Launch(tmp_path, tmp_path / "ready.json")
    try:
        yield started
    finally:
        started.cleanup()


def discovery_for(procfs: ProcFs) -> Discovery:
    return Discovery(
        unit="vllm.service",
        unit_cgroup="/system.slice/vllm.service",
        gpus=[],
        owned=[],
        usage={},
        holders={},
        self_chain=self_and_ancestors(procfs),
        unreadable=[],
    )


NEEDS_ROOT = {"cgroup-scope": "a cgroup of its own in the host's cgroup v2 tree"}


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(name, marks=[pytest.mark.root(NEEDS_ROOT[name])] if name in NEEDS_ROOT else [])
        for name in sorted(SHAPES)
    ],
)
def test_launch_shape_is_taken_whole_and_alone(shape: str, launch: Launch) -> None:
    SHAPES[shape](launch)
    pids = launch.wait_ready()
    api = psutil.Process(int(str(pids["api_server"])))
    server_tree = {api.pid} | {child.pid for child in api.children(recursive=True)}
    workers = [int(pid) for pid in pids["workers"]]  # type: ignore[attr-defined]
    assert len(server_tree) >= 5, "API server, resource tracker, engine core, two workers"
    procfs = ProcFs()
    for worker in workers:
        holder = procfs.info(worker)
        assert holder is not None
        taken = set(app_tree(holder, procfs, discovery_for(procfs), GateConfig()))
        assert not taken & set(launch.kept), f"took {sorted(taken & set(launch.kept))}"
        assert taken == server_tree | set(launch.launchers), (
            f"missing {sorted(server_tree | set(launch.launchers) - taken)}, "
            f"extra {sorted(taken - server_tree - set(launch.launchers))}"
        )
    assert all(psutil.pid_exists(pid) for pid in launch.kept)
