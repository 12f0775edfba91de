"""A stand-in for the runtime's side of NRI, as containerd 1.7.24's NRI (containerd/nri v0.6.1,
pkg/adaptation) drives an external plugin over ttrpc v1.2.5: it serves the Runtime service on
connection 2 (RegisterPlugin) and calls the Plugin service on connection 1 (Configure,
Synchronize, CreateContainer, StopContainer, StateChange), each call with its deadline in
ttrpc's timeout_nano. Its framing is written here from the Go sources, apart from gpugate's
(host/nri.py), and checks what Go's reader needs: a frame of at most 4096 bytes (ttrpc reads
through a 4 KiB bufio.Reader, and NRI's multiplexer fails a read shorter than its frame).

frame_size: how the runtime cuts what it writes into frames (Go's: 4096); a small one makes
every message arrive in many pieces. Every wait is a hang guard, never a timing assertion."""

from __future__ import annotations

import select
import socket
import struct
import time

from google.protobuf.message import Message

from gpugate.host.nri_api import api_pb2, ttrpc_pb2

HANG_GUARD_S = 120.0
GO_READ = 4096


class FakeRuntime:
    def __init__(self, sock: socket.socket, *, frame_size: int = GO_READ) -> None:
        self.sock = sock
        self.frame_size = frame_size
        self.unread = b""
        self.streams: dict[int, bytes] = {1: b"", 2: b""}
        self.next_stream = 1
        self.frames_seen: list[tuple[int, int]] = []  # (connection, payload length) received

    def write(self, conn: int, stream: int, kind: int, flags: int, body: bytes) -> None:
        data = struct.pack(">IIBB", len(body), stream, kind, flags) + body
        pieces = [data[at : at + self.frame_size] for at in range(0, len(data), self.frame_size)]
        # One send: a unix socket counts each send's overhead, and nobody reads meanwhile.
        self.sock.sendall(b"".join(struct.pack(">II", conn, len(p)) + p for p in pieces))

    def _recv(self, size: int, deadline: float) -> bytes:
        while len(self.unread) < size:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.sock], [], [], left)[0], "no frame came"
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("the plugin closed the connection")
            self.unread += chunk
        taken, self.unread = self.unread[:size], self.unread[size:]
        return taken

    def message(self, conn: int, timeout_s: float = HANG_GUARD_S) -> tuple[int, int, int, bytes]:
        """The next ttrpc message on conn: (stream, type, flags, body)."""
        deadline = time.monotonic() + timeout_s
        while True:
            data = self.streams[conn]
            if len(data) >= 10:
                length, stream, kind, flags = struct.unpack(">IIBB", data[:10])
                if len(data) >= 10 + length:
                    self.streams[conn] = data[10 + length :]
                    return stream, kind, flags, data[10 : 10 + length]
            got, length = struct.unpack(">II", self._recv(8, deadline))
            assert length <= GO_READ, f"a frame of {length} bytes: Go's reader fails it"
            self.frames_seen.append((got, length))
            self.streams[got] = self.streams.get(got, b"") + self._recv(length, deadline)

    def serve_registration(self) -> api_pb2.RegisterPluginRequest:
        """Answers the plugin's RegisterPlugin, as the adaptation's runtime service does."""
        stream, kind, flags, body = self.message(2)
        assert (stream % 2, kind, flags) == (1, 1, 1), (stream, kind, flags)
        request = ttrpc_pb2.Request.FromString(body)
        assert (request.service, request.method) == (
            "nri.pkg.api.v1alpha1.Runtime",
            "RegisterPlugin",
        ), request
        assert request.timeout_nano > 0  # the plugin bounds its own call
        registered = api_pb2.RegisterPluginRequest.FromString(request.payload)
        answer = ttrpc_pb2.Response(
            status=ttrpc_pb2.Status(code=0), payload=api_pb2.Empty().SerializeToString()
        )
        self.write(2, stream, 2, 0, answer.SerializeToString())
        return registered

    def send_call(self, method: str, request: Message, timeout_s: float = 2.0) -> int:
        stream = self.next_stream
        self.next_stream += 2
        envelope = ttrpc_pb2.Request(
            service="nri.pkg.api.v1alpha1.Plugin",
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(timeout_s * 1e9),
        )
        self.write(1, stream, 1, 1, envelope.SerializeToString())
        return stream

    def answer_to(self, stream: int) -> ttrpc_pb2.Response:
        got, kind, flags, body = self.message(1)
        assert (got, kind, flags) == (stream, 2, 0), (got, kind, flags)
        return ttrpc_pb2.Response.FromString(body)

    def call(self, method: str, request: Message, timeout_s: float = 2.0) -> ttrpc_pb2.Response:
        return self.answer_to(self.send_call(method, request, timeout_s))


def pod(name: str = "vllm-0", namespace: str = "ml", uid: str = "u-1") -> api_pb2.PodSandbox:
    return api_pb2.PodSandbox(
        id="f" * 64, name=name, namespace=namespace, uid=uid, runtime_handler=""
    )


def container(
    container_id: str,
    *,
    name: str = "server",
    env: list[str] | None = None,
    devices: list[tuple[int, int]] = (),  # type: ignore[assignment]
    mounts: list[tuple[str, str]] = (),  # type: ignore[assignment]
    annotations: dict[str, str] | None = None,
    pod_id: str = "f" * 64,
    cgroups_path: str | None = None,
) -> api_pb2.Container:
    """A container as containerd 1.7's CRI hands it to NRI at CreateContainer: its spec's env,
    mounts, devices, annotations and systemd cgroups path (kubelet's systemd driver)."""
    made = api_pb2.Container(
        id=container_id,
        pod_sandbox_id=pod_id,
        name=name,
        env=env or [],
        annotations=annotations or {},
        mounts=[
            api_pb2.Mount(source=src, destination=dst, type="bind", options=["rbind", "rw"])
            for src, dst in mounts
        ],
    )
    made.linux.cgroups_path = (
        cgroups_path
        if cgroups_path is not None
        else f"kubepods-besteffort-podu_1.slice:cri-containerd:{container_id}"
    )
    for major, minor in devices:
        made.linux.devices.append(
            api_pb2.LinuxDevice(path=f"/dev/nvidia{minor}", type="c", major=major, minor=minor)
        )
    return made
