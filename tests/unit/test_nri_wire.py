"""NRI's wire (host/nri.py) against a stand-in runtime that frames as containerd's Go code does
(tests/nri_runtime.py): registration on connection 2, the runtime's calls on connection 1,
messages in pieces, frames Go's reader can take, and each way a connection breaks."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from gpugate.errors import NriUnavailable
from gpugate.front.commands.nri import EVENTS
from gpugate.host.nri import PluginConnection, Wire, event_mask
from gpugate.host.nri_api import api_pb2, ttrpc_pb2
from tests.nri_runtime import FakeRuntime

JOIN_S = 120.0  # a hang guard for the plugin's thread


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def registered(
    pair: tuple[socket.socket, socket.socket], frame_size: int = 4096
) -> tuple[PluginConnection, FakeRuntime, api_pb2.RegisterPluginRequest]:
    ours, theirs = pair
    connection = PluginConnection(Wire(ours))
    runtime = FakeRuntime(theirs, frame_size=frame_size)
    failed: list[Exception] = []

    def register() -> None:
        try:
            connection.register("gpugate", "99", 30.0)
        except Exception as exc:  # noqa: BLE001  # handed to the test's thread
            failed.append(exc)

    thread = threading.Thread(target=register)
    thread.start()
    request = runtime.serve_registration()
    thread.join(JOIN_S)
    assert not thread.is_alive() and not failed, failed
    return connection, runtime, request


def test_the_plugin_registers_with_its_name_and_index_then_gets_the_runtime_s_calls(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    connection, runtime, request = registered(pair)
    assert (request.plugin_name, request.plugin_idx) == ("gpugate", "99")
    stream = runtime.send_call(
        "Configure",
        api_pb2.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"),
        timeout_s=2.0,
    )
    call = connection.next_call(None)
    assert call is not None and call.method == "Configure" and call.stream == stream
    assert isinstance(call.request, api_pb2.ConfigureRequest)
    assert call.request.runtime_version == "1.7.24"
    assert call.timeout_s == 2.0  # the runtime's plugin_request_timeout, from timeout_nano
    connection.answer(call, api_pb2.ConfigureResponse(events=EVENTS))
    answer = runtime.answer_to(stream)
    assert answer.status.code == 0
    assert api_pb2.ConfigureResponse.FromString(answer.payload).events == EVENTS


@pytest.mark.parametrize("frame_size", [1, 7, 4096])
def test_messages_cut_into_frames_of_any_size_are_put_back_together(
    pair: tuple[socket.socket, socket.socket], frame_size: int
) -> None:
    connection, runtime, _ = registered(pair, frame_size)
    # Over 4 KiB, yet small enough in 1-byte frames for the socket to hold: one thread.
    big = api_pb2.Container(id="c" * 64, env=[f"V{i}={'x' * 100}" for i in range(40)])
    stream = runtime.send_call(
        "CreateContainer", api_pb2.CreateContainerRequest(container=big), timeout_s=5.0
    )
    call = connection.next_call(None)
    assert call is not None and call.request == api_pb2.CreateContainerRequest(container=big)
    assert call.timeout_s == 5.0
    connection.answer(call, api_pb2.CreateContainerResponse())
    assert runtime.answer_to(stream).status.code == 0


def test_an_answer_over_4_kib_goes_in_frames_go_s_reader_takes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    connection, runtime, _ = registered(pair)
    stream = runtime.send_call("CreateContainer", api_pb2.CreateContainerRequest())
    call = connection.next_call(None)
    assert call is not None
    connection.refuse(call.stream, 9, "x" * 20000)
    answer = runtime.answer_to(stream)  # FakeRuntime asserts each frame is at most 4096
    assert (answer.status.code, answer.status.message) == (9, "x" * 20000)
    assert max(length for _, length in runtime.frames_seen) == 4096


def test_a_call_that_comes_before_the_registration_s_answer_is_kept(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    connection = PluginConnection(Wire(ours))
    runtime = FakeRuntime(theirs)
    early = runtime.send_call("Synchronize", api_pb2.SynchronizeRequest())
    thread = threading.Thread(target=connection.register, args=("gpugate", "99", 30.0))
    thread.start()
    runtime.serve_registration()
    thread.join(JOIN_S)
    assert not thread.is_alive()
    call = connection.next_call(None)
    assert call is not None and (call.method, call.stream) == ("Synchronize", early)


def test_a_call_of_a_method_nri_does_not_define_is_answered_unimplemented(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    connection, runtime, _ = registered(pair)
    odd = ttrpc_pb2.Request(service="nri.pkg.api.v1alpha1.Plugin", method="Frobnicate")
    runtime.write(1, 101, 1, 1, odd.SerializeToString())
    stream = runtime.send_call("Synchronize", api_pb2.SynchronizeRequest())
    call = connection.next_call(None)  # the odd call was answered on the way
    assert call is not None and call.method == "Synchronize"
    assert runtime.answer_to(101).status.code == 12  # Unimplemented
    connection.answer(call, api_pb2.SynchronizeResponse())
    assert runtime.answer_to(stream).status.code == 0


def test_a_frame_for_a_connection_nobody_opened_is_dropped(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    connection, runtime, _ = registered(pair)
    runtime.sock.sendall(struct.pack(">II", 7, 5) + b"hello")
    stream = runtime.send_call("Synchronize", api_pb2.SynchronizeRequest())
    call = connection.next_call(None)
    assert call is not None and call.stream == stream


def test_no_call_within_the_wait_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    connection, _, _ = registered(pair)
    assert connection.next_call(0.0) is None


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # the runtime closed the connection
        struct.pack(">II", 1, (1 << 24) + 1),  # a frame over the multiplexer's 16 MiB
        struct.pack(">II", 1, 10) + struct.pack(">IIBB", (4 << 20) + 1, 1, 1, 1),  # over 4 MiB
        struct.pack(">II", 1, 13) + struct.pack(">IIBB", 3, 1, 1, 1) + b"\xff\xff\xff",
    ],
    ids=["closed", "frame-too-big", "message-too-big", "not-a-request"],
)
def test_a_broken_connection_is_nri_unavailable(
    pair: tuple[socket.socket, socket.socket], sent: bytes
) -> None:
    connection, runtime, _ = registered(pair)
    if sent:
        runtime.sock.sendall(sent)
    else:
        runtime.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(NriUnavailable):
        connection.next_call(30.0)


def test_a_refused_registration_is_nri_unavailable(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    connection = PluginConnection(Wire(ours))
    runtime = FakeRuntime(theirs)
    failed: list[Exception] = []

    def register() -> None:
        try:
            connection.register("", "99", 30.0)
        except Exception as exc:  # noqa: BLE001  # handed to the test's thread
            failed.append(exc)

    thread = threading.Thread(target=register)
    thread.start()
    stream, _, _, _ = runtime.message(2)
    refusal = ttrpc_pb2.Response(
        status=ttrpc_pb2.Status(code=2, message="invalid (empty) plugin name")
    )
    runtime.write(2, stream, 2, 0, refusal.SerializeToString())
    thread.join(JOIN_S)
    assert len(failed) == 1 and isinstance(failed[0], NriUnavailable)


def test_nothing_listening_is_nri_unavailable(tmp_path: object) -> None:
    with pytest.raises(NriUnavailable):
        Wire.connect(f"{tmp_path}/nri.sock", 5.0)


def test_the_event_mask_is_nri_s() -> None:
    """NRI's EventMask.Set: bit (event - 1); gpugate's four events, as ParseEventMask makes
    "createcontainer,stopcontainer,removecontainer,removepodsandbox"."""
    assert event_mask(api_pb2.RUN_POD_SANDBOX) == 1
    assert event_mask(api_pb2.REMOVE_CONTAINER) == 1 << 10
    assert EVENTS == (1 << 3) | (1 << 9) | (1 << 10) | (1 << 2)
    assert EVENTS & ~((1 << (api_pb2.LAST - 1)) - 1) == 0  # within NRI's ValidEvents
