"""What `gpugate nri` costs a node (issue 49): its memory and CPU while idle, connected to a
runtime, and per container that asks for no GPU (answered in the plugin, no run forked).

The runtime's side is played here over a Unix socket with gpugate's own framing
(host/nri.py's Wire, which carries either side's messages): RegisterPlugin answered,
Configure and Synchronize called, then nothing for --idle-s seconds, then --calls
CreateContainer calls of a GPU-less container, one after another, then --gpu-calls pods with a
GPU each (a container given GPU n % 8 by its spec's device 195:n, as the device plugin's CDI
mode leaves it): CreateContainer (the plugin forks the container's pre) and StopContainer (its
post, in the background), the next only once the post has given the lease back. The host is
bench/stage.py's stand-in (device files, cgroup tree, the stand-in libnvidia-ml), passed by
gpugate's hidden --host-roots and --nvml-library.

    python3 -m bench.nri_cost --idle-s 30 --calls 500 --gpu-calls 40

Prints a markdown table: the plugin's resident memory (VmRSS) after connecting and after the
calls, its CPU while idle (utime + stime over the idle time), each GPU-less call's round trip
(median, 95th percentile) and CPU, and per GPU pod the CreateContainer round trip and the CPU
of the plugin with its reaped runs (cutime + cstime: the pre and the post)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from google.protobuf.message import Message

from bench.stage import Stage
from gpugate.host.nri import PLUGIN_CONN, REMOTE_CLOSED, REQUEST, RESPONSE, RUNTIME_CONN, Wire
from gpugate.host.nri_api import api_pb2, ttrpc_pb2
from gpugate.integrations.records import read_leases

TICKS = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int, *, children: bool = False) -> float:
    """utime + stime, and with children the reaped children's (cutime + cstime)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = [int(x) for x in text[text.rfind(")") + 2 :].split()[11:15]]
    return sum(fields if children else fields[:2]) / TICKS


def leased(locks: Path) -> bool:
    return bool(read_leases(locks).leases)


class Runtime:
    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.stream = 1

    def registration(self) -> None:
        found = self.wire.message(60.0)
        assert found is not None and found[0] == RUNTIME_CONN, found
        answer = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=0))
        self.wire.send(RUNTIME_CONN, found[1], RESPONSE, 0, answer.SerializeToString())

    def call(self, method: str, request: Message, timeout_s: float = 2.0) -> None:
        stream, self.stream = self.stream, self.stream + 2
        envelope = ttrpc_pb2.Request(
            service="nri.pkg.api.v1alpha1.Plugin",
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(timeout_s * 1e9),
        )
        self.wire.send(PLUGIN_CONN, stream, REQUEST, REMOTE_CLOSED, envelope.SerializeToString())
        found = self.wire.message(60.0)
        assert found is not None and found[:3] == (PLUGIN_CONN, stream, RESPONSE), found
        answer = ttrpc_pb2.Response.FromString(found[3])
        assert answer.status.code == 0, answer.status


class Figures(NamedTuple):
    connected_kib: int
    after_kib: int  # after the GPU-less calls
    after_gpu_kib: int  # after the pods with a GPU
    idle_cpu_s: float
    trips: list[float]  # GPU-less CreateContainer round trips, sorted
    per_call_s: float
    gpu_trips: list[float]  # CreateContainer round trips of pods with a GPU, sorted
    per_gpu_pod_s: float  # CPU of the plugin and its runs, per pod with a GPU


def measure(idle_s: float, calls: int, gpu_calls: int) -> Figures:
    """The plugin's figures; raises where a GPU pod's pre took no lease or its post kept it."""
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/nri.sock"
        stage = Stage(Path(folder) / "host")
        config = Path(folder) / "containers.toml"
        config.write_text(f'lock_dir = "{stage.locks}"\n')
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        argv = [sys.executable, "-m", "gpugate", *stage.roots_args()]
        argv += ["nri", "--socket", path, "--config", str(config)]
        plugin = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env=stage.env())
        try:
            listener.settimeout(60.0)
            conn, _ = listener.accept()
            runtime = Runtime(Wire(conn))
            runtime.registration()
            runtime.call("Configure", api_pb2.ConfigureRequest(runtime_name="bench"))
            runtime.call("Synchronize", api_pb2.SynchronizeRequest())
            connected_kib, before = rss_kib(plugin.pid), cpu_s(plugin.pid)
            time.sleep(idle_s)  # the idle time being measured
            idle = cpu_s(plugin.pid) - before
            before = cpu_s(plugin.pid)
            trips = [gpu_less(runtime, n) for n in range(calls)]
            per_call = (cpu_s(plugin.pid) - before) / max(calls, 1)
            after_kib = rss_kib(plugin.pid)
            before = cpu_s(plugin.pid, children=True)
            gpu_trips = [gpu_pod(runtime, n, stage.locks) for n in range(gpu_calls)]
            time.sleep(2.5)  # the plugin reaps finished posts once a second
            per_gpu_pod = (cpu_s(plugin.pid, children=True) - before) / max(gpu_calls, 1)
            after_gpu_kib = rss_kib(plugin.pid)
        finally:
            plugin.terminate()
            plugin.wait(30)
    return Figures(
        connected_kib,
        after_kib,
        after_gpu_kib,
        idle,
        sorted(trips),
        per_call,
        sorted(gpu_trips),
        per_gpu_pod,
    )


POD = api_pb2.PodSandbox(id="f" * 64, name="p", namespace="bench")


def gpu_less(runtime: Runtime, n: int) -> float:
    """One CreateContainer of a container without GPUs: its round trip."""
    made = api_pb2.Container(id=f"{n:064x}", pod_sandbox_id=POD.id, name="c")
    made.linux.cgroups_path = f"kubepods.slice:cri-containerd:{made.id}"
    started = time.perf_counter()
    runtime.call("CreateContainer", api_pb2.CreateContainerRequest(pod=POD, container=made))
    return time.perf_counter() - started


def gpu_pod(runtime: Runtime, n: int, locks: Path) -> float:
    """A pod given GPU n % 8: CreateContainer (its pre: the round trip returned), then
    StopContainer (its post), waited for until its lease is back."""
    made = api_pb2.Container(id=f"{n + 1:x}".rjust(64, "e"), pod_sandbox_id=POD.id, name="gpu")
    made.linux.cgroups_path = f"kubepods.slice:cri-containerd:{made.id}"
    device = api_pb2.LinuxDevice(path=f"/dev/nvidia{n % 8}", type="c", major=195, minor=n % 8)
    made.linux.devices.append(device)
    request = api_pb2.CreateContainerRequest(pod=POD, container=made)
    started = time.perf_counter()
    runtime.call("CreateContainer", request, timeout_s=30.0)
    trip = time.perf_counter() - started
    if not leased(locks):
        raise RuntimeError(f"GPU pod {n}: its pre took no lease")
    runtime.call("StopContainer", api_pb2.StopContainerRequest(pod=POD, container=made))
    waited = time.monotonic() + 60
    while leased(locks):  # the post, in the background: its lease back
        if time.monotonic() > waited:
            raise RuntimeError(f"GPU pod {n}: its post kept the lease past 60 s")
        time.sleep(0.01)
    return trip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--gpu-calls", type=int, default=40)
    args = parser.parse_args()
    got = measure(args.idle_s, args.calls, args.gpu_calls)
    print("| figure | value |\n| --- | --- |")
    print(f"| resident memory, connected and idle | {got.connected_kib / 1024:.1f} MiB |")
    after, after_gpu = got.after_kib / 1024, got.after_gpu_kib / 1024
    print(f"| resident memory after {args.calls} CreateContainer calls | {after:.1f} MiB |")
    print(f"| resident memory after {args.gpu_calls} pods with a GPU | {after_gpu:.1f} MiB |")
    share = 100 * got.idle_cpu_s / args.idle_s if args.idle_s else 0.0
    print(
        f"| CPU while idle ({args.idle_s:g} s) | {got.idle_cpu_s * 1000:.0f} ms ({share:.3f} %) |"
    )
    if got.trips:
        median, p95 = statistics.median(got.trips), got.trips[int(len(got.trips) * 0.95)]
        print(f"| CreateContainer, no GPU: round trip median | {median * 1e3:.2f} ms |")
        print(f"| CreateContainer, no GPU: round trip p95 | {p95 * 1e3:.2f} ms |")
        print(f"| CreateContainer, no GPU: plugin CPU per call | {got.per_call_s * 1e3:.2f} ms |")
    if got.gpu_trips:
        median = statistics.median(got.gpu_trips) * 1e3
        print(f"| pod with a GPU: CreateContainer round trip (its pre), median | {median:.1f} ms |")
        cpu = got.per_gpu_pod_s * 1e3
        print(f"| pod with a GPU: CPU, plugin and its runs (pre + post) | {cpu:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
