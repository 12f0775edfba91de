"""The device-file scan over real processes: fds, mappings, sockets asked for by inode, and a
thread group whose leader exited while another thread keeps the device open."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpugate.host.scan import scan_device_users
from tests.fakes import start_time_of

ZOMBIE_LEADER = textwrap.dedent(
    """
    import ctypes, os, sys, threading, time
    path, ready, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    def hold():
        if mode == "fd":
            handle = os.open(path, os.O_RDONLY)
        else:
            import mmap
            with open(path, "rb") as f:
                held = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
        leader = f"/proc/self/task/{os.getpid()}/stat"
        deadline = time.monotonic() + 10
        while open(leader).read().rsplit(")", 1)[1].split()[0] != "Z":  # the leader is gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
        open(ready, "w").write("ok")
        time.sleep(3600)
    threading.Thread(target=hold).start()
    ctypes.CDLL(None).pthread_exit(None)  # the main thread exits; the process lives on
    """
)


def state_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2 :].split()[0]


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    root = tmp_path / "dev"
    root.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl"):
        (root / name).write_bytes(b"\0" * 4096)
    return root


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["fd", "map"])
@pytest.mark.root("a thread group's fds whose leader exited are root's to read")
def test_thread_group_with_a_zombie_leader_is_found(
    mode: str, dev: Path, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_LEADER, str(dev / "nvidia2"), str(ready), mode]
    )
    started.append(proc)
    deadline = time.monotonic() + 15
    while not ready.exists():
        assert time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.02)
    assert state_of(proc.pid) == "Z", "the leader should be a zombie with a live thread"
    assert not os.listdir(f"/proc/{proc.pid}/fd")
    scan = scan_device_users(Path("/proc"), str(dev / "nvidia"))
    assert proc.pid in scan.users
    assert scan.users[proc.pid].paths == {str(dev / "nvidia2")}
    start_time_of(proc.pid)  # still the same process


def test_fds_maps_and_sockets_by_inode(dev: Path, started: list[subprocess.Popen[bytes]]) -> None:
    code = textwrap.dedent(
        """
        import mmap, os, socket, sys, time
        fd = os.open(sys.argv[1], os.O_RDONLY)
        with open(sys.argv[2], "rb") as f:
            held = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        print(os.fstat(listener.fileno()).st_ino, flush=True)
        time.sleep(3600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(dev / "nvidia0"), str(dev / "nvidia1")],
        stdout=subprocess.PIPE,
    )
    started.append(proc)
    assert proc.stdout is not None
    inode = int(proc.stdout.readline())
    with socket.socket() as other:  # a socket nobody asked about
        other.bind(("127.0.0.1", 0))
        other.listen()
        unasked = os.fstat(other.fileno()).st_ino
        scan = scan_device_users(Path("/proc"), str(dev / "nvidia"), {inode})
        mine = scan_device_users(Path("/proc"), str(dev / "nvidia"), {unasked})
    use = scan.users[proc.pid]
    assert str(dev / "nvidia0") in use.fd_paths  # (Python's mmap keeps a dup of nvidia1's fd)
    assert use.mapped_paths == {str(dev / "nvidia1")}
    assert use.sockets == {inode}
    assert mine.users[os.getpid()].sockets == {unasked}
    assert not mine.users[proc.pid].sockets
