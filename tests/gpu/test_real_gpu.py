"""The hand-started-server and killed-parent scenarios with real CUDA allocations.

Runs only where an NVIDIA GPU, its driver and libcuda are present (`pytest -m gpu`); skipped
with the reason elsewhere. It plans with --dry-run first and skips rather than kill anything
it did not start, so it is safe on a GPU that other people use.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
MIB = 2048


def _gpu_reason() -> str | None:
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU here (/dev/nvidiactl missing)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "libcuda.so.1 not found (no NVIDIA driver)"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - any NVML failure means: no usable GPU
        return f"NVML unusable: {exc}"
    return None


REASON = _gpu_reason()
if REASON:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=REASON)]


def used_mib(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) >> 20


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    (tmp_path / "cgroup" / "system.slice" / "gpu-test.service").mkdir(parents=True)
    (tmp_path / "cgroup" / "system.slice" / "gpu-test.service" / "cgroup.procs").write_text("")
    path = tmp_path / "gpugate.toml"
    path.write_text(
        "gpus = [0]\nfree_mib = 1024\n"
        f'[paths]\ncgroup_root = "{tmp_path / "cgroup"}"\nlock_dir = "{tmp_path / "locks"}"\n'
        "[pre]\nsigterm_grace_s = 3\nwait_timeout_s = 60\n"
        "[post]\nkill_orphans = true\nsigterm_grace_s = 3\nwait_timeout_s = 60\n"
    )
    return path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, int | list[int]]]:
    ready = tmp_path / "ready.json"
    # A "login shell" (session leader) that starts the server, as from ssh.
    shell = subprocess.Popen(
        [
            "/bin/bash",
            "-c",
            f"{sys.executable} {HERE / 'cuda_worker.py'} 0 {MIB} {ready} --children 2 & wait; exec sleep 3600",
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline, "CUDA workers did not start"
        time.sleep(0.2)
    pids = json.loads(ready.read_text())
    info: dict[str, int | list[int]] = {
        "shell": shell.pid,
        "parent": pids["parent"],
        "children": pids["children"],
    }
    yield info
    for pid in [pids["parent"], *pids["children"], shell.pid]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    shell.wait(10)


def gpugate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpugate", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def planned_only_ours(config: Path, phase: str, ours: set[int]) -> None:
    plan = gpugate(phase, "gpu-test.service", "--dry-run", "--config", str(config))
    planned = {
        int(line.split("PID ")[1].split()[0])
        for line in plan.stderr.splitlines()
        if "would kill PID" in line
    }
    if not planned <= ours:
        pytest.skip(
            f"GPU 0 is also held by processes this test did not start: {sorted(planned - ours)}"
        )


def test_hand_started_cuda_server_is_killed_and_memory_freed(
    config: Path, server: dict[str, int | list[int]]
) -> None:
    children = server["children"]
    assert isinstance(children, list)
    ours = {int(server["parent"]), *children}  # type: ignore[arg-type]
    before = used_mib(0)
    assert before >= 3 * MIB
    planned_only_ours(config, "pre", ours)
    result = gpugate("pre", "gpu-test.service", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert not any(alive(pid) for pid in ours)
    assert alive(int(server["shell"]))  # type: ignore[arg-type]
    assert used_mib(0) <= before - 3 * MIB + 256


def test_killed_parent_workers_reaped_by_post(
    config: Path, server: dict[str, int | list[int]]
) -> None:
    children = server["children"]
    assert isinstance(children, list)
    parent = int(server["parent"])  # type: ignore[arg-type]
    os.kill(parent, signal.SIGKILL)
    deadline = time.monotonic() + 30  # not our child: a poll with a deadline on its death
    while alive(parent):
        assert time.monotonic() < deadline, "the parent survived SIGKILL"
        time.sleep(0.05)
    assert all(alive(pid) for pid in children)
    planned_only_ours(config, "post", set(children))
    result = gpugate("post", "gpu-test.service", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert not any(alive(pid) for pid in children)
    assert used_mib(0) <= 1024 + 512
