"""Tests of the vLLM-like workload (tests/simhost/workload/fake_vllm.py).

Every test kills exactly the processes it started: the API server it spawned and the
descendants collected from it (psutil, claim files, ready file) before anything was killed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

HERE = Path(__file__).resolve().parent
FAKE_VLLM = HERE / "workload" / "fake_vllm.py"
MIB = 1024 * 1024
TRACKER_CMD = "from multiprocessing.resource_tracker import main;main("


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def starttime_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def title(pid: int) -> str:
    """/proc/PID/cmdline as ps shows it.  setproctitle pads the old argv area with NULs,
    so psutil's cmdline() of a titled process is [TITLE, '', '', ...], as with real vLLM."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def settled_alive(pid: int) -> bool:
    """Alive and nothing on its way to end it: not a zombie, no signal pending. What the
    survivor tests check once the event they survive has happened (the parent reaped, the
    signal sent), not after a sleep: a signal is pending from its sending until handled, and
    nothing else ends these processes (no parent-death signal, no reads of a closed pipe)."""
    try:
        fields = status_fields(pid)
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited as we opened it
        return False
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return fields["State"][0] not in "ZX" and pending == 0


def ignores(pid: int, signum: int) -> bool:
    """The kernel drops a signal the process ignores when it is sent (nothing to wait for)."""
    return bool(int(status_fields(pid)["SigIgn"], 16) >> (signum - 1) & 1)


def fd_targets(pid: int) -> set[str]:
    return {str(fd.readlink()) for fd in Path(f"/proc/{pid}/fd").iterdir()}


class Workload:
    """One fake_vllm.py run under tmp_path, and every process it started."""

    def __init__(self, tmp_path: Path, gpus: list[int], *extra: str) -> None:
        self.dev = tmp_path / "dev"
        self.state = tmp_path / "state"
        self.ready_file = tmp_path / "ready.json"
        self.dev.mkdir(exist_ok=True)
        for name in [f"nvidia{n}" for n in range(8)] + ["nvidiactl", "nvidia-uvm"]:
            (self.dev / name).touch()
        self.gpus = gpus
        self.port = free_port()
        self.mib = 1234
        self.cmd = [
            sys.executable, str(FAKE_VLLM), "--gpus", ",".join(map(str, gpus)),
            "--port", str(self.port), "--host", "127.0.0.1", "--mib", str(self.mib),
            "--state-dir", str(self.state), "--dev-root", str(self.dev),
            "--ready-file", str(self.ready_file), *extra,
        ]  # fmt: skip
        self.api = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        self.tree: list[psutil.Process] = []

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            assert self.api.poll() is None, f"fake_vllm exited with {self.api.returncode}"
            assert time.monotonic() < deadline, "fake_vllm did not get ready"
            time.sleep(0.05)
        assert self.api.stdout is not None
        assert self.api.stdout.readline() == "READY\n"
        self.collect()
        return json.loads(self.ready_file.read_text())  # type: ignore[no-any-return]

    def collect(self) -> None:
        """Remembers every descendant of the API server and every claimant (call before killing)."""
        known = {p.pid for p in self.tree}
        found = psutil.Process(self.api.pid).children(recursive=True)
        for pid in self.claim_pids():
            with contextlib.suppress(psutil.NoSuchProcess):
                found.append(psutil.Process(pid))
        for proc in found:
            if proc.pid not in known:
                self.tree.append(proc)
                known.add(proc.pid)

    def claim_pids(self) -> list[int]:
        claims = self.state / "claims"
        return (
            sorted(int(p.name) for p in claims.iterdir() if p.name.isdigit())
            if claims.exists()
            else []
        )

    def until_dead(self, pids: list[int], timeout_s: float = 10) -> None:
        """A poll with a deadline on the condition: a process not ours to wait for (the engine
        core's parent is gone) has no exit to block on."""
        deadline = time.monotonic() + timeout_s
        while any(self.alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still alive: {pids}"
            time.sleep(0.02)

    def alive(self, pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def cleanup(self) -> None:
        if self.api.poll() is None:
            self.collect()
            self.api.kill()
        self.api.wait()
        for proc in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()  # psutil checks the create time: never a recycled pid
        psutil.wait_procs(self.tree, timeout=10)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[Workload] = []

    def _start(gpus: list[int], *extra: str, subdir: str = "run") -> Workload:
        root = tmp_path / f"{subdir}{len(started)}"
        root.mkdir()
        w = Workload(root, gpus, *extra)
        started.append(w)
        return w

    yield _start
    for w in started:
        w.cleanup()


def test_looks_like_vllm(start: Any) -> None:
    w = start([0, 1])
    pids = w.wait_ready()
    api = psutil.Process(w.api.pid)
    assert pids["api_server"] == w.api.pid

    # the API server keeps its python command line
    assert api.cmdline()[:2] == [sys.executable, str(FAKE_VLLM)]

    children = api.children()
    engine = psutil.Process(pids["engine_core"])
    assert engine in children
    assert title(engine.pid) == "VLLM::EngineCore"
    assert engine.cmdline()[0] == "VLLM::EngineCore"
    assert not any(engine.cmdline()[1:])
    assert comm(engine.pid) == "VLLM::EngineCor"  # the kernel cuts comm to 15 characters

    trackers = [
        c for c in children if len(c.cmdline()) >= 3 and c.cmdline()[-1].startswith(TRACKER_CMD)
    ]
    assert len(trackers) == 1, [c.cmdline() for c in children]
    assert trackers[0].cmdline()[-2] == "-c"
    assert trackers[0].cmdline()[-1].endswith(")")

    workers = engine.children()
    assert sorted(p.pid for p in workers) == sorted(pids["workers"]) == w.claim_pids()
    assert len(w.gpus) == len(pids["workers"])
    for rank, (gpu, pid) in enumerate(zip(w.gpus, pids["workers"])):
        worker = psutil.Process(pid)
        assert title(pid) == f"VLLM::Worker_TP{rank}"
        assert comm(pid) == "VLLM::Worker_TP"
        assert worker.ppid() == engine.pid
        # the claim: "MIB STARTTIME N", and the device files really held
        claim = (w.state / "claims" / str(pid)).read_text()
        assert claim == f"{w.mib} {starttime_of(pid)} {gpu}\n"
        held = fd_targets(pid)
        for name in ("nvidiactl", "nvidia-uvm", f"nvidia{gpu}"):
            assert str(w.dev / name) in held
        others = {str(w.dev / f"nvidia{n}") for n in range(8) if n != gpu}
        assert not held & others
    # nobody but the workers holds a GPU device file
    for proc in [api, engine, *trackers]:
        assert not {t for t in fd_targets(proc.pid) if t.startswith(str(w.dev))}

    # the port is bound and answers
    listening = {c.laddr.port for c in api.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert w.port in listening
    with urllib.request.urlopen(f"http://127.0.0.1:{w.port}/health", timeout=10) as resp:
        assert resp.status == 200


def test_sigkilled_api_server_leaves_engine_and_workers_running(start: Any) -> None:
    w = start([0, 1])
    pids = w.wait_ready()
    w.api.kill()
    assert w.api.wait(timeout=10) == -signal.SIGKILL  # reaped: its children are reparented
    survivors = [pids["engine_core"], *pids["workers"]]
    assert all(settled_alive(pid) for pid in survivors), survivors
    assert psutil.Process(pids["engine_core"]).ppid() != w.api.pid
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{w.port}/health", timeout=2)
    # nor does killing the engine core take the workers down
    psutil.Process(pids["engine_core"]).kill()
    w.until_dead([pids["engine_core"]])  # dead (a zombie at least): its children reparented
    assert all(settled_alive(pid) for pid in pids["workers"])


def test_sigterm_api_server_exits_without_killing_children(start: Any) -> None:
    w = start([3])
    pids = w.wait_ready()
    w.api.terminate()
    w.api.wait(timeout=10)
    assert all(settled_alive(pid) for pid in [pids["engine_core"], *pids["workers"]])


@pytest.mark.parametrize("ignore", [False, True])
def test_worker_sigterm(start: Any, ignore: bool) -> None:
    w = start([0, 5], *(["--ignore-sigterm-workers"] if ignore else []))
    pids = w.wait_ready()
    workers = [psutil.Process(pid) for pid in pids["workers"]]
    assert [ignores(p.pid, signal.SIGTERM) for p in workers] == [ignore, ignore]
    for worker in workers:
        worker.terminate()
    if not ignore:
        w.until_dead(pids["workers"])
    assert [settled_alive(p.pid) for p in workers] == [ignore, ignore]


def test_title_prefix(start: Any) -> None:
    w = start([2], "--title-prefix", "MYLLM")
    pids = w.wait_ready()
    assert title(pids["engine_core"]) == "MYLLM::EngineCore"
    assert title(pids["workers"][0]) == "MYLLM::Worker_TP0"


def test_port_in_use_fails_fast(start: Any, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "dev").mkdir()
        proc = subprocess.run(
            [sys.executable, str(FAKE_VLLM), "--gpus", "0", "--port", str(port),
             "--state-dir", str(tmp_path / "state"), "--dev-root", str(tmp_path / "dev")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert proc.returncode != 0
    assert "READY" not in proc.stdout
    assert not (tmp_path / "state" / "claims").exists()  # no worker was started


def test_missing_device_file_fails(start: Any) -> None:
    w = start([0])
    (w.dev / "nvidia0").unlink()
    w.api.wait(timeout=60)
    assert w.api.returncode != 0
    assert not w.ready_file.exists()


def test_workers_show_up_in_the_stand_in_nvml(start: Any, tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing: cannot build the stand-in libnvidia-ml.so.1")
    spec = importlib.util.spec_from_file_location(
        "fake_nvml_build", HERE.parent / "fake_nvml" / "build.py"
    )
    assert spec and spec.loader
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    lib_dir = build.build_fake_nvml(tmp_path / "lib")

    w = start([1, 4])
    pids = w.wait_ready()
    conf = tmp_path / "fake-nvml.conf"
    conf.write_text(f"dev_root = {w.dev}\nstate_dir = {w.state}\nrelease_delay_ms = 300\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir.parent), FAKE_NVML_CONFIG=str(conf))
    code = """
import json, pynvml as n
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    out.append([[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)])
print(json.dumps(out))
"""

    def query() -> Any:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    listed = query()
    assert listed[1] == [[pids["workers"][0], w.mib * MIB]]
    assert listed[4] == [[pids["workers"][1], w.mib * MIB]]
    assert sum(map(len, listed)) == 2  # not the API server, engine core or tracker
