"""`gpugate nri`: the NRI plugin (containerd 1.7+, CRI-O 1.26+) that gates a Kubernetes node's
containers without a runtime handler: connected to the runtime's NRI socket, it runs a
container's pre at CreateContainer (a refusal fails the creation with gpugate's one line) and
its post at StopContainer / RemoveContainer, from what NRI gives of the pod and container
(docs/containers.md, "NRI"). A lost connection is made again."""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from gpugate.errors import BadInput, ExitCode, InstallError, NriUnavailable
from gpugate.front import nri_runs
from gpugate.front.install_containers import (
    CONTAINERD_CONFIG,
    CRI,
    parse,
    read_containerd_config,
    table_at,
)
from gpugate.host.nri import (
    FAILED_PRECONDITION,
    Call,
    PluginConnection,
    Wire,
    event_mask,
)
from gpugate.host.nri_api import api_pb2
from gpugate.host.nvml import GpuDriver, NvmlDriver, import_pynvml
from gpugate.host.oci import ContainerSpec, ContainerState
from gpugate.host.systemd import HostRoots, on_units_tree
from gpugate.integrations.config_files import load_config
from gpugate.integrations.container import container_config
from gpugate.integrations.nri_container import is_pod_sandbox, oci_view
from gpugate.phase import Phase
from gpugate.untrusted import for_error, safe_line

SOCKET = Path("/var/run/nri/nri.sock")  # NRI's DefaultSocketPath
NAME = "gpugate"
# Plugins are called in ascending index order, each seeing the container as those before it
# left it: gpugate goes last, so that the GPUs another plugin adds (a CDI injector) are gated.
INDEX = "99"
EVENTS = event_mask(
    api_pb2.CREATE_CONTAINER,
    api_pb2.STOP_CONTAINER,
    api_pb2.REMOVE_CONTAINER,
    api_pb2.REMOVE_POD_SANDBOX,
)
REGISTER_TIMEOUT_S = 5.0  # NRI's default plugin_registration_timeout
DEFAULT_BOUND_S = 2.0  # NRI's default plugin_request_timeout, where a call names none
# Of the runtime's bound, what the answer needs to reach it: a pre still running when only
# this is left is ended and the creation refused for now (the kubelet tries again).
ANSWER_MARGIN_S = 0.3
TICK_S = 1.0  # between looks at finished posts while no call comes
RETRY_S = 5.0  # between tries to connect
RECONNECT_S = 1.0  # after a connection ended: containers are ungated until the next one
MAX_REMEMBERED = 4096  # containers whose post ran, kept to run it once


class Node(NamedTuple):
    """What a call's answer depends on besides the call."""

    setup: nri_runs.GateSetup
    nvidia_handlers: frozenset[str]  # runtime handlers whose runtime is NVIDIA's ("": default)


def nri(
    *,
    socket: Path = SOCKET,
    config: Path | None = None,
    roots: HostRoots | None = None,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
) -> int:
    """Serves the runtime until SIGTERM (or a config error at the start: its exit code)."""
    loaded = load_config(None, config) if config is not None else container_config()
    roots = roots or on_units_tree(HostRoots())
    handlers = nvidia_handlers(CONTAINERD_CONFIG)
    import_pynvml()  # once here: every run is forked from this process
    background: list[nri_runs.Ending] = []  # runs outlive a connection: reaped across them
    while True:
        try:
            wire = Wire.connect(str(socket), REGISTER_TIMEOUT_S)
        except NriUnavailable as exc:
            say(f"{exc.message}; trying again in {RETRY_S:g} s")
            pause(background, RETRY_S)
            continue
        setup = nri_runs.GateSetup(roots, loaded, driver_factory, (wire.sock.fileno(),))
        try:
            Plugin(PluginConnection(wire), Node(setup, handlers), background).serve()
        except NriUnavailable as exc:
            say(f"{exc.message}; connecting again")
        finally:
            wire.close()
        pause(background, RECONNECT_S)  # a runtime that refuses at once is not asked in a loop


def pause(background: list[nri_runs.Ending], seconds: float) -> None:
    """Sleeps between connections, still reaping the runs started before (and killing those
    past their grace)."""
    end = time.monotonic() + seconds
    while True:
        nri_runs.tend(background)
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, TICK_S))


def say(text: str) -> None:
    print(f"gpugate: nri: {safe_line(text)}", file=sys.stderr, flush=True)


def nvidia_handlers(path: Path) -> frozenset[str]:
    """The CRI runtime handlers whose binary is NVIDIA's runtime in containerd's config (read,
    never written), "" for pods without one where it is the default: NVIDIA's runtime adds its
    hook at `create`, after NRI, and its lists (NVIDIA_VISIBLE_DEVICES, the volume-mounts)
    count for those pods' containers."""
    try:
        text = read_containerd_config(path)
    except InstallError as exc:
        say(f"{exc.message}: no runtime handler is taken for NVIDIA's")
        return frozenset()
    if text is None:
        return frozenset()
    try:
        data = parse(text, path)
    except InstallError as exc:
        say(f"{exc.message}: no runtime handler is taken for NVIDIA's")
        return frozenset()
    found: set[str] = set()
    for cri in CRI.values():
        runtimes = table_at(data, (*cri, "runtimes"))
        for name, runtime in runtimes.items():
            options = runtime.get("options") if isinstance(runtime, dict) else None
            binary = options.get("BinaryName") if isinstance(options, dict) else None
            if isinstance(binary, str) and Path(binary).name == "nvidia-container-runtime":
                found.add(name)
        if table_at(data, cri).get("default_runtime_name") in found:
            found.add("")
    return frozenset(found)


class Plugin:
    """One connection's life: registered, configured, then each call answered."""

    def __init__(
        self,
        connection: PluginConnection,
        node: Node,
        background: list[nri_runs.Ending] | None = None,
    ) -> None:
        self.connection = connection
        self.node = node
        # posts, and pres ended at the bound: the plugin's, kept across connections
        self.background = [] if background is None else background
        self.posted: OrderedDict[str, None] = OrderedDict()  # runs once per container
        self.refused: OrderedDict[str, None] = OrderedDict()  # its post has nothing to do
        self.admitted: dict[str, tuple[api_pb2.PodSandbox, api_pb2.Container]] = {}
        self.bound_s = DEFAULT_BOUND_S

    def serve(self) -> None:
        self.connection.register(NAME, INDEX, REGISTER_TIMEOUT_S)
        while True:
            call = self.connection.next_call(TICK_S)
            nri_runs.tend(self.background)
            if call is None:
                continue
            if call.method == "Shutdown":
                self.connection.answer(call, api_pb2.Empty())
                raise NriUnavailable("NRI: the runtime is shutting down")
            self.dispatch(call)

    def dispatch(self, call: Call) -> None:
        request = call.request
        if isinstance(request, api_pb2.ConfigureRequest):
            self.configure(call)
        elif isinstance(request, api_pb2.CreateContainerRequest):
            self.create(call, request)
        elif isinstance(request, api_pb2.StopContainerRequest):
            self.connection.answer(call, api_pb2.StopContainerResponse())
            self.post(request.pod, request.container)
        elif isinstance(request, api_pb2.StateChangeEvent):
            self.connection.answer(call, api_pb2.Empty())
            self.state_change(request)
        elif isinstance(request, api_pb2.SynchronizeRequest):
            self.connection.answer(call, api_pb2.SynchronizeResponse())
        elif isinstance(request, api_pb2.UpdateContainerRequest):
            self.connection.answer(call, api_pb2.UpdateContainerResponse())

    def configure(self, call: Call) -> None:
        """The events gpugate acts on; the runtime's bound on each answer, from the call's own
        deadline (NRI v0.6.1's ConfigureRequest does not say it)."""
        self.bound_s = call.timeout_s or DEFAULT_BOUND_S
        self.connection.answer(call, api_pb2.ConfigureResponse(events=EVENTS))
        loaded = self.node.setup.loaded
        wait_s = loaded.config.pre.wait_timeout_s if loaded is not None else None
        if wait_s is not None and wait_s + ANSWER_MARGIN_S >= self.bound_s:
            say(
                f"the runtime waits {self.bound_s:g} s for an answer (plugin_request_timeout) "
                f"and a pre may take {wait_s:g} s ([pre].wait_timeout_s): a container whose pre "
                "has not finished by then is refused, and created at the kubelet's next try "
                "(docs/containers.md, NRI)"
            )

    def create(self, call: Call, request: api_pb2.CreateContainerRequest) -> None:
        pod, container = request.pod, request.container
        if is_pod_sandbox(pod, container):
            self.connection.answer(call, api_pb2.CreateContainerResponse())
            return
        try:
            state, spec = self.view(pod, container, lenient=False)
        except BadInput as exc:
            remember(self.refused, container.id)
            self.refuse(call, exc.message, int(exc.exit_code))
            return
        if not spec.gpus:
            self.connection.answer(call, api_pb2.CreateContainerResponse())
            return
        deadline = time.monotonic() + (call.timeout_s or self.bound_s) - ANSWER_MARGIN_S
        try:
            run = nri_runs.start(self.node.setup, Phase.PRE, state, spec)
        except OSError as exc:  # no fork, no pipe: the plugin goes on, this one is refused
            remember(self.refused, container.id)
            self.refuse(call, f"its pre did not start: {exc}", int(ExitCode.INTERNAL))
            return
        result = nri_runs.wait(run, deadline)
        if result is None or result.code != ExitCode.OK:
            remember(self.refused, container.id)
        if result is None:
            self.refuse(
                call,
                f"container {container.id[:12]}: its pre did not finish within NRI's "
                f"plugin_request_timeout ({self.bound_s:g} s): not created now, the kubelet "
                "tries again (docs/containers.md, NRI)",
                int(ExitCode.INTERRUPTED),
            )
            self.background.append(nri_runs.end(run))
        elif result.code != ExitCode.OK:
            self.refuse(call, result.line or "the container's pre failed", result.code)
        else:
            self.connection.answer(call, api_pb2.CreateContainerResponse())
            self.admitted[container.id] = (pod, container)

    def refuse(self, call: Call, line: str, code: int) -> None:
        """The runtime fails CreateContainer with this (the kubelet shows it)."""
        text = line if line.startswith("gpugate") else f"gpugate: nri: {line}"
        self.connection.refuse(call.stream, FAILED_PRECONDITION, f"{text} (exit status {code})")

    def view(
        self, pod: api_pb2.PodSandbox, container: api_pb2.Container, *, lenient: bool
    ) -> tuple[ContainerState, ContainerSpec]:
        nvidia = pod.runtime_handler in self.node.nvidia_handlers
        return oci_view(pod, container, nvidia_runtime=nvidia, lenient=lenient)

    def state_change(self, event: api_pb2.StateChangeEvent) -> None:
        if event.event == api_pb2.REMOVE_CONTAINER:
            self.post(event.pod, event.container)
        elif event.event == api_pb2.REMOVE_POD_SANDBOX:
            for pod, container in list(self.admitted.values()):
                if pod.id == event.pod.id:  # a container whose stop NRI did not tell
                    self.post(pod, container)

    def post(self, pod: api_pb2.PodSandbox, container: api_pb2.Container) -> None:
        """The container's post, once, in the background: the runtime does not wait for it."""
        self.admitted.pop(container.id, None)
        if container.id in self.refused:  # NRI's undo of a creation gpugate failed: no lease
            del self.refused[container.id]
            return
        if container.id in self.posted or is_pod_sandbox(pod, container):
            return
        try:
            state, spec = self.view(pod, container, lenient=True)
        except BadInput as exc:
            say(exc.message)
            return
        if not spec.gpus:
            return
        remember(self.posted, container.id)
        try:
            run = nri_runs.start(self.node.setup, Phase.POST, state, spec)
        except OSError as exc:
            say(f"container {for_error(container.id[:12])}: its post did not start: {exc}")
            return
        self.background.append(nri_runs.Ending(run, None))


def remember(ids: OrderedDict[str, None], container_id: str) -> None:
    ids[container_id] = None
    while len(ids) > MAX_REMEMBERED:
        ids.popitem(last=False)
