"""`gpugate nri` against a stand-in runtime (tests/nri_runtime.py) on a stand-in host: the
plugin, forked as its own process, registers, subscribes to its events, and gates the
containers NRI tells it of: a stale holder of a pod's GPU killed at CreateContainer, a second
pod's CreateContainer refused with gpugate's line, the pod named from NRI's pod, the post at
StopContainer in the background, a pre that outlives the runtime's bound refused for now."""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from gpugate.errors import ExitCode, NriUnavailable
from gpugate.front import nri_runs
from gpugate.front.commands.nri import EVENTS, Node, Plugin, pause
from gpugate.host.nri import PluginConnection, Wire
from gpugate.host.nri_api import api_pb2, ttrpc_pb2
from gpugate.integrations.records import read_leases
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from tests.fakes import FakeHost, alive
from tests.nri_runtime import FakeRuntime, container, pod

A_ID, B_ID, C_ID = "a" * 64, "b" * 64, "c" * 64
HANG_GUARD_S = 120.0
FAILED_PRECONDITION = 9


def scope(container_id: str) -> str:
    return f"cri-containerd-{container_id}.scope"


@pytest.fixture
def plugin(host: FakeHost) -> Iterator[Callable[[], FakeRuntime]]:
    """Starts the plugin in a child of its own (it forks its runs), connected to the runtime
    it returns; the stand-in GPU memory's claims made before are the plugin's too."""
    started: list[tuple[int, socket.socket]] = []

    def start() -> FakeRuntime:
        fake, pid = connected(host)
        started.append((pid, fake.sock))
        return fake

    yield start
    for pid, sock in started:
        sock.close()
        os.waitpid(pid, 0)


def connected(host: FakeHost) -> tuple[FakeRuntime, int]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    running = {scope(A_ID): "active", scope(B_ID): "active", scope(C_ID): "active"}

    def reporter(unit: str, phase: str, *, fields: object = None) -> Reporter:
        # Its stderr echo on: the run's lines are what the plugin answers with.
        return Reporter(unit, phase, journal=host.journal, notifier=host.notifier, fields=fields)  # type: ignore[arg-type]

    setup = nri_runs.GateSetup(
        host.roots,
        host.config(),
        lambda: host.memory,
        (ours.fileno(),),
        reporter_factory=reporter,  # type: ignore[arg-type]
        unit_state=running.get,
    )
    pid = os.fork()
    if pid == 0:
        code = int(ExitCode.INTERNAL)
        try:
            theirs.close()
            Plugin(PluginConnection(Wire(ours)), Node(setup, frozenset())).serve()
        except NriUnavailable:
            code = 0  # the runtime went away: the test's end
        finally:
            os._exit(code)
    ours.close()
    fake = FakeRuntime(theirs)
    registered = fake.serve_registration()
    assert (registered.plugin_name, registered.plugin_idx) == ("gpugate", "99")
    configured = fake.call("Configure", api_pb2.ConfigureRequest(runtime_name="containerd"))
    assert api_pb2.ConfigureResponse.FromString(configured.payload).events == EVENTS
    assert fake.call("Synchronize", api_pb2.SynchronizeRequest()).status.code == 0
    return fake, pid


def create(
    fake: FakeRuntime, made: api_pb2.Container, timeout_s: float = 60.0, pod_name: str = "vllm-0"
) -> ttrpc_pb2.Response:
    request = api_pb2.CreateContainerRequest(pod=pod(pod_name), container=made)
    return fake.call("CreateContainer", request, timeout_s)


def on_gpu(container_id: str, gpu: int) -> api_pb2.Container:
    return container(container_id, devices=[(195, gpu)])


def wait_for(what: str, check: object) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.message
def test_a_pod_s_stale_holder_goes_and_a_second_pod_is_refused_with_gpugate_s_line(
    host: FakeHost, plugin: Callable[[], FakeRuntime]
) -> None:
    (stale,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(stale, {1}, 4000)
    runtime = plugin()
    answer = create(runtime, on_gpu(A_ID, 1))
    assert answer.status.code == 0, answer.status.message
    assert not alive(stale)
    (lease,) = read_leases(host.root / "locks").leases
    assert lease.unit == scope(A_ID) and list(lease.gpus) == [1]
    assert "ml/vllm-0/server" in lease.container  # named from NRI's pod and container

    refused = create(runtime, on_gpu(B_ID, 1), pod_name="vllm-1")
    assert refused.status.code == FAILED_PRECONDITION
    assert f"exit status {int(ExitCode.HELD_BY_OTHERS)}" in refused.status.message
    # The refusal itself, naming both pods (not the run's summary).
    assert "ml/vllm-1/server" in refused.status.message
    assert "ml/vllm-0/server" in refused.status.message
    assert "\n" not in refused.status.message, refused.status.message
    assert [x.unit for x in read_leases(host.root / "locks").leases] == [scope(A_ID)]

    # The runtime's undo of the refused creation (StopContainer, RemoveContainer): nothing.
    stopped = api_pb2.StopContainerRequest(pod=pod(), container=on_gpu(B_ID, 1))
    assert runtime.call("StopContainer", stopped).status.code == 0
    # The first pod's stop: answered at once, its post in the background gives the lease up.
    stopped = api_pb2.StopContainerRequest(pod=pod(), container=on_gpu(A_ID, 1))
    assert runtime.call("StopContainer", stopped).status.code == 0
    wait_for("the lease given up", lambda: not read_leases(host.root / "locks").leases)


def test_containers_without_gpus_and_the_pod_s_own_are_answered_at_once(
    host: FakeHost, plugin: Callable[[], FakeRuntime]
) -> None:
    (stale,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(stale, {2}, 4000)
    runtime = plugin()
    assert create(runtime, container(C_ID)).status.code == 0
    sandbox = container("f" * 64, devices=[(195, 2)])  # the pod's id: its pause container
    assert create(runtime, sandbox).status.code == 0
    assert alive(stale) and not read_leases(host.root / "locks").leases


def test_a_request_gpugate_cannot_resolve_is_refused_bad_input(
    host: FakeHost, plugin: Callable[[], FakeRuntime]
) -> None:
    runtime = plugin()
    odd = container(C_ID, devices=[(195, 200)])  # no GPU NVML knows
    refused = create(runtime, odd)
    assert refused.status.code == FAILED_PRECONDITION
    assert f"exit status {int(ExitCode.USAGE)}" in refused.status.message
    assert not read_leases(host.root / "locks").leases


def test_a_pre_that_outlives_the_runtime_s_bound_is_refused_for_now(
    host: FakeHost, plugin: Callable[[], FakeRuntime]
) -> None:
    """The holder ignores SIGTERM: the pre needs its sigterm_grace_s (1 s here) at least, and
    the runtime waits 0.5 s. The plugin answers before the runtime's bound, refusing, and ends
    the run; the runtime's next call is answered as ever."""
    (stale,) = host.pool.holder(host.gpu_files(3), ignore_term=True)
    host.memory.claim(stale, {3}, 4000)
    runtime = plugin()
    refused = create(runtime, on_gpu(C_ID, 3), timeout_s=0.5)
    assert refused.status.code == FAILED_PRECONDITION
    assert f"exit status {int(ExitCode.INTERRUPTED)}" in refused.status.message
    assert runtime.call("Synchronize", api_pb2.SynchronizeRequest()).status.code == 0
    # The ended run gave its locks back: the kubelet's next try, given the time, goes through.
    answer = create(runtime, on_gpu(C_ID, 3))
    assert answer.status.code == 0, answer.status.message
    assert not alive(stale)


def test_runs_left_by_a_broken_connection_are_killed_past_their_grace_and_reaped() -> None:
    """A pre ended at the bound (or a post) outlives its connection: between connections the
    plugin still kills it once its grace is over, and reaps it."""
    read, write = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # a run deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(write, b"r")
        signal.pause()
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"r"  # it ignores SIGTERM from here
    run = nri_runs.GateRun(pid, os.pidfd_open(pid), read, A_ID, Phase.PRE)
    background = [nri_runs.end(run)]
    background[0] = background[0]._replace(kill_at=0.0)  # its grace over
    plugin = Plugin(None, None, background)  # type: ignore[arg-type]
    assert plugin.background is background  # the connection's runs are the plugin's
    pause(background, 0.0)  # SIGKILL
    assert select.select([run.pidfd], [], [], HANG_GUARD_S)[0], "SIGKILL was not sent"
    pause(background, 0.0)
    assert background == []
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
