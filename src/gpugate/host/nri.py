"""NRI's wire as a plugin speaks it: containerd/nri v0.6.1 over containerd/ttrpc v1.2.5, what
containerd 1.7.24 vendors (CRI-O 1.26+ speaks the same).

One stream socket to the runtime's NRI socket (`/var/run/nri/nri.sock`), carrying two
connections by NRI's multiplexer (`pkg/net/multiplex`): each frame is a big-endian 4-byte
connection id and 4-byte payload length, then the payload. On connection 1 the runtime calls
the plugin's service (`Configure`, `Synchronize`, `CreateContainer`, `StopContainer`,
`StateChange`, `Shutdown`); on connection 2 the plugin calls the runtime's (`RegisterPlugin`).
On each, a byte stream of ttrpc messages: a 10-byte header (big-endian length of what follows,
stream id, type: 1 request, 2 response; flags) and a protobuf `ttrpc.Request` or
`ttrpc.Response` (nri_api/ttrpc.proto) whose payload is NRI's message (nri_api/api.proto).

Every wait has its deadline but one: the wait for the runtime's next call, which is the
plugin's idle state (`next_call(wait_s)` comes back empty after wait_s)."""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import NamedTuple

from google.protobuf.message import DecodeError, Message

from gpugate.errors import NriUnavailable
from gpugate.host.nri_api import api_pb2, ttrpc_pb2

MUX_HEADER = struct.Struct(">II")  # connection id, payload length
TTRPC_HEADER = struct.Struct(">IIBB")  # length, stream id, type, flags
PLUGIN_CONN = 1  # multiplex.PluginServiceConn: the runtime calls the plugin
RUNTIME_CONN = 2  # multiplex.RuntimeServiceConn: the plugin calls the runtime
MAX_FRAME = 1 << 24  # the multiplexer's maxPayloadSize in v0.6.1
MAX_MESSAGE = 4 << 20  # ttrpc's messageLengthMax
# What one frame carries at most when gpugate writes. NRI's multiplexer hands a reader a whole
# frame or ENOMEM, and ttrpc reads through a 4 KiB bufio.Reader: Go's own ttrpc flushes its
# 4 KiB writer per frame, so a frame is never bigger than that; neither is gpugate's.
WRITE_CHUNK = 4096
REQUEST, RESPONSE = 1, 2  # ttrpc message types (3, data, is for streams: no NRI call uses one)
REMOTE_CLOSED = 0x1  # a unary request's flag
PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
FRAME_DEADLINE_S = 10.0  # the rest of a frame whose first byte came
SEND_DEADLINE_S = 10.0
# gRPC's codes, as ttrpc's status carries them.
OK, UNKNOWN, FAILED_PRECONDITION, UNIMPLEMENTED, INTERNAL = 0, 2, 9, 12, 13

# The requests the runtime sends on connection 1, by method: what each payload decodes into.
PLUGIN_METHODS: dict[str, type[Message]] = {
    "Configure": api_pb2.ConfigureRequest,
    "Synchronize": api_pb2.SynchronizeRequest,
    "Shutdown": api_pb2.Empty,
    "CreateContainer": api_pb2.CreateContainerRequest,
    "UpdateContainer": api_pb2.UpdateContainerRequest,
    "StopContainer": api_pb2.StopContainerRequest,
    "StateChange": api_pb2.StateChangeEvent,
}


def event_mask(*events: int) -> int:
    """ConfigureResponse.events: bit event-1 for each `api_pb2.Event` (NRI's EventMask.Set)."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


class Call(NamedTuple):
    """One call of the runtime: its ttrpc stream, method, decoded request, and how long the
    runtime waits for the answer (ttrpc's timeout_nano: NRI's plugin_request_timeout), None
    where it set no deadline."""

    stream: int
    method: str
    request: Message
    timeout_s: float | None


class Wire:
    """The socket, NRI's frames on it, and ttrpc's messages in each connection's bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(SEND_DEADLINE_S)
        self._unread = bytearray()  # bytes of the socket not yet a whole frame
        self._streams: dict[int, bytearray] = {PLUGIN_CONN: bytearray(), RUNTIME_CONN: bytearray()}

    @classmethod
    def connect(cls, path: str, timeout_s: float) -> Wire:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise NriUnavailable(
                f"{path}: the runtime's NRI socket cannot be reached: {exc.strerror or exc}"
            ) from None
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def send(self, conn: int, stream: int, kind: int, flags: int, body: bytes) -> None:
        """One ttrpc message on connection conn, in frames of at most WRITE_CHUNK bytes."""
        if len(body) > MAX_MESSAGE:
            raise NriUnavailable(f"NRI: a message of {len(body)} bytes is over ttrpc's 4 MiB")
        data = TTRPC_HEADER.pack(len(body), stream, kind, flags) + body
        frames = b"".join(
            MUX_HEADER.pack(conn, len(data[at : at + WRITE_CHUNK])) + data[at : at + WRITE_CHUNK]
            for at in range(0, len(data), WRITE_CHUNK)
        )
        try:
            self.sock.sendall(frames)
        except OSError as exc:
            raise NriUnavailable(f"NRI: the runtime's socket took no more: {exc}") from None

    def message(self, wait_s: float | None) -> tuple[int, int, int, bytes] | None:
        """The next whole ttrpc message, (connection, stream, type, body); None where none came
        within wait_s (None: wait as long as it takes)."""
        while True:
            found = self._whole_message()
            if found is not None:
                return found
            if not self._frame(wait_s):
                return None

    def _whole_message(self) -> tuple[int, int, int, bytes] | None:
        for conn, data in self._streams.items():
            if len(data) < TTRPC_HEADER.size:
                continue
            length, stream, kind, _flags = TTRPC_HEADER.unpack_from(data)
            if length > MAX_MESSAGE:
                raise NriUnavailable(f"NRI: a ttrpc message of {length} bytes (4 MiB at most)")
            end = TTRPC_HEADER.size + length
            if len(data) >= end:
                body = bytes(data[TTRPC_HEADER.size : end])
                del data[:end]
                return conn, stream, kind, body
        return None

    def _frame(self, wait_s: float | None) -> bool:
        """Reads one frame into its connection's bytes; False where nothing came in wait_s."""
        if not self._fill(MUX_HEADER.size, wait_s, first=True):
            return False
        conn, length = MUX_HEADER.unpack_from(self._unread)
        if length > MAX_FRAME:
            raise NriUnavailable(f"NRI: a frame of {length} bytes (16 MiB at most)")
        self._fill(MUX_HEADER.size + length, FRAME_DEADLINE_S, first=False)
        payload = self._unread[MUX_HEADER.size : MUX_HEADER.size + length]
        del self._unread[: MUX_HEADER.size + length]
        if conn in self._streams:  # as NRI's own multiplexer, a frame for no open one goes
            self._streams[conn] += payload
        return True

    def _fill(self, size: int, wait_s: float | None, *, first: bool) -> bool:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while len(self._unread) < size:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                if first and not self._unread:
                    return False
                raise NriUnavailable(f"NRI: a frame did not come whole within {wait_s:g} s")
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as exc:
                raise NriUnavailable(f"NRI: the runtime's socket failed: {exc}") from None
            if not chunk:
                raise NriUnavailable("NRI: the runtime closed the connection")
            self._unread += chunk
        return True


class PluginConnection:
    """The plugin's side of one connection: its registration, then the runtime's calls and
    their answers."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self._next_stream = 1  # a ttrpc client's streams are odd, from 1
        self._early: list[tuple[int, bytes]] = []  # calls that came before an answer awaited

    def register(self, name: str, index: str, timeout_s: float) -> None:
        """RegisterPlugin (name, two-digit index: plugins are called in ascending order); the
        runtime then calls Configure and Synchronize, which next_call gives."""
        request = api_pb2.RegisterPluginRequest(plugin_name=name, plugin_idx=index)
        self.call_runtime("RegisterPlugin", request, timeout_s)

    def call_runtime(self, method: str, request: Message, timeout_s: float) -> bytes:
        """A unary call of the runtime's service; its answer's payload, or NriUnavailable."""
        stream = self._next_stream
        self._next_stream += 2
        envelope = ttrpc_pb2.Request(
            service=RUNTIME_SERVICE,
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(timeout_s * 1e9),
        )
        self.wire.send(RUNTIME_CONN, stream, REQUEST, REMOTE_CLOSED, envelope.SerializeToString())
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            found = self.wire.message(left) if left > 0 else None
            if found is None:
                raise NriUnavailable(f"NRI: {method}: no answer within {timeout_s:g} s")
            conn, got, kind, body = found
            if conn == PLUGIN_CONN and kind == REQUEST:
                self._early.append((got, body))
            elif conn == RUNTIME_CONN and kind == RESPONSE and got == stream:
                return _answer_payload(method, body)

    def next_call(self, wait_s: float | None) -> Call | None:
        """The runtime's next call; None where none came within wait_s. A call of a service or
        method NRI v0.6.1 does not define is answered Unimplemented here."""
        while True:
            if self._early:
                stream, body = self._early.pop(0)
            else:
                found = self.wire.message(wait_s)
                if found is None:
                    return None
                conn, stream, kind, body = found
                if conn != PLUGIN_CONN or kind != REQUEST:
                    continue  # an answer nobody waits for any more
            call = self._decode(stream, body)
            if call is not None:
                return call

    def _decode(self, stream: int, body: bytes) -> Call | None:
        try:
            envelope = ttrpc_pb2.Request.FromString(body)
        except DecodeError:
            raise NriUnavailable("NRI: a call that is no ttrpc request") from None
        kind = PLUGIN_METHODS.get(envelope.method)
        if envelope.service != PLUGIN_SERVICE or kind is None:
            self.refuse(stream, UNIMPLEMENTED, f"{envelope.service}/{envelope.method}")
            return None
        try:
            request = kind.FromString(envelope.payload)
        except DecodeError:
            raise NriUnavailable(f"NRI: {envelope.method}: its request does not decode") from None
        timeout = envelope.timeout_nano / 1e9 if envelope.timeout_nano > 0 else None
        return Call(stream, envelope.method, request, timeout)

    def answer(self, call: Call, reply: Message) -> None:
        response = ttrpc_pb2.Response(
            status=ttrpc_pb2.Status(code=OK), payload=reply.SerializeToString()
        )
        self.wire.send(PLUGIN_CONN, call.stream, RESPONSE, 0, response.SerializeToString())

    def refuse(self, stream: int, code: int, text: str) -> None:
        """An error answer: the runtime's caller gets `rpc error: code = ... desc = TEXT`."""
        response = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=code, message=text))
        self.wire.send(PLUGIN_CONN, stream, RESPONSE, 0, response.SerializeToString())


def _answer_payload(method: str, body: bytes) -> bytes:
    try:
        response = ttrpc_pb2.Response.FromString(body)
    except DecodeError:
        raise NriUnavailable(f"NRI: {method}: an answer that is no ttrpc response") from None
    if response.status.code != OK:
        said = response.status.message[:200]
        raise NriUnavailable(f"NRI: {method} refused (code {response.status.code}): {said}")
    return bytes(response.payload)
