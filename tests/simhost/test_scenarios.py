"""The incident, end to end, on the simulated GPU host: real systemd, the stand-in driver, a
vLLM-like workload, and gpugate installed as an operator installs it.

Each scenario asserts on NVML memory per GPU (through `gpugate status --json`, which reads the
stand-in driver exactly as production reads NVIDIA's), on which processes live afterwards, on
`systemctl` results and on the journal. Each would fail with the gpugate lines removed from the
unit: set GPUGATE_SCENARIO_WITHOUT_GPUGATE=1 to run them that way (they then fail).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "simhost" / "workload" / "fake_vllm.py"
PYTHON = str(Path(sys.executable).resolve())
MIB_PER_GPU = 90000
WITHOUT_GPUGATE = os.environ.get("GPUGATE_SCENARIO_WITHOUT_GPUGATE") == "1"
SIGNAL_SENT_ID = "9b4c2d7e1f3a4b8c9d0e5f6a1b2c3d56"
ALL = tuple(range(8))


def gpu_arg(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus))


def server_cmd(gpus: tuple[int, ...], port: int, ready: str, *extra: str) -> str:
    return shlex.join(
        [
            PYTHON,
            "/opt/fakevllm/fake_vllm.py",
            "--gpus",
            gpu_arg(gpus),
            "--port",
            str(port),
            "--mib",
            str(MIB_PER_GPU),
            "--ready-file",
            ready,
            *extra,
        ]
    )


def unit_text(
    name: str,
    gpus: tuple[int, ...],
    port: int,
    *extra: str,
    kill_mode: str = "",
    start_timeout: int = 60,
) -> str:
    hooks = (
        ""
        if WITHOUT_GPUGATE
        else ("ExecStartPre=/usr/bin/gpugate pre %n\nExecStopPost=/usr/bin/gpugate post %n\n")
    )
    return (
        f"[Unit]\nDescription=vLLM-like server {name}\n[Service]\nType=simple\n{hooks}"
        f"ExecStart={server_cmd(gpus, port, f'/run/ready-{name}.json', *extra)}\n"
        f"NotifyAccess=exec\nTimeoutStartSec={start_timeout}\nTimeoutStopSec=60\n"
        + (f"KillMode={kill_mode}\n" if kill_mode else "")
    )


class Host:
    """Scenario helpers over one booted SimHost."""

    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def sh(self, cmd: str, check: bool = True) -> str:
        return self.sim.run(cmd, check=check, timeout=180).stdout

    def status(self) -> dict[str, Any]:
        result = self.sim.run(["gpugate", "status", "--json"], timeout=60)
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    def used(self) -> dict[int, int]:
        return {gpu["index"]: gpu["used_mib"] for gpu in self.status()["gpus"]}

    def alive(self, pid: int) -> bool:
        state = self.sh(f"cat /proc/{pid}/stat 2>/dev/null | sed 's/.*) //' | cut -c1", False)
        return state.strip() not in ("", "Z", "X")

    def wait_ready(self, path: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.sh(f"cat {path} 2>/dev/null", check=False)
            if text.strip():
                data: dict[str, Any] = json.loads(text)
                return data
            time.sleep(0.2)
        raise AssertionError(f"{path} never appeared")

    def hand_start(
        self, gpus: tuple[int, ...], port: int, name: str, *extra: str
    ) -> tuple[dict[str, Any], int]:
        """A server started by hand from a login session: a session-leading shell in a user
        scope, like sshd's. Returns the server's pids and the shell's pid."""
        ready = f"/run/ready-{name}.json"
        self.sh(f"rm -f {ready} /run/shell-{name}.pid")
        script = f"echo $$ > /run/shell-{name}.pid; {server_cmd(gpus, port, ready)} & wait; exec sleep 3600"
        self.sim.spawn_scope(["setsid", "-w", "/bin/bash", "-c", script], unit=f"{name}.scope")
        pids = self.wait_ready(ready)
        shell = int(self.sh(f"cat /run/shell-{name}.pid").strip())
        return pids, shell

    def install(self, name: str, text: str, config: str = "") -> None:
        self.sim.install_unit(name, text)
        self.sim.write_file(f"/etc/gpugate/{name}.toml", config)

    def start(self, name: str, check: bool = True) -> int:
        self.sh(f"rm -f /run/ready-{name}.json")
        return self.sim.systemctl("start", name, check=check).returncode

    def cgroup_pids(self, name: str) -> list[int]:
        text = self.sh(f"cat /sys/fs/cgroup/system.slice/{name}/cgroup.procs 2>/dev/null", False)
        return [int(p) for p in text.split()]

    def cursor(self) -> str:
        return self.sh(
            "journalctl -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'"
        ).strip()

    def journal_json(self, *args: str) -> list[dict[str, Any]]:
        out = self.sh(shlex.join(["journalctl", "--no-pager", "-o", "json", *args]), check=False)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def reset(self) -> None:
        """Between scenarios: stop every test unit and scope, clear leaks, restore the driver."""
        self.sh(
            "systemctl stop 'vllm*.service' 'job-*.service' 'hand-*.scope' 2>/dev/null; "
            "systemctl reset-failed 2>/dev/null; rm -f /run/fake-nvml/leak/*; "
            "sed -i 's/^release_delay_ms.*/release_delay_ms = 0/' /etc/fake-nvml.conf",
            check=False,
        )
        # Anything a scenario left holding a GPU is a bug of that scenario: kill it by cgroup.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(self.used().values()):
            time.sleep(0.2)


CONFIG = "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n[post]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    if simhost.run(
        ["test", "-e", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"], check=False
    ).returncode:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    simhost.install_gpugate(REPO)
    simhost.write_file("/opt/fakevllm/fake_vllm.py", WORKLOAD.read_text())
    simhost.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
    # Bystanders that must survive every scenario: nvidia-persistenced holding every device
    # file (protected by its unit), and a python process in a login session holding no GPU.
    redirects = " ".join(
        f"{3 + i}</dev/{n}"
        for i, n in enumerate([f"nvidia{i}" for i in ALL] + ["nvidiactl", "nvidia-uvm"])
    )
    simhost.install_unit(
        "nvidia-persistenced.service",
        f"[Service]\nExecStart=/bin/bash -c 'exec {redirects} sleep infinity'\n",
    )
    simhost.systemctl("start", "nvidia-persistenced.service")
    simhost.spawn_scope(
        [PYTHON, "-c", "import time; time.sleep(36000)"], unit="python-bystander.scope"
    )
    h = Host(simhost)
    yield h
    h.reset()


def bystanders_alive(host: Host) -> None:
    assert (
        host.sim.systemctl("is-active", "nvidia-persistenced.service", check=False).stdout.strip()
        == "active"
    )
    assert (
        host.sim.systemctl("is-active", "python-bystander.scope", check=False).stdout.strip()
        == "active"
    )


def test_hand_started_server_is_replaced_by_the_unit(host: Host) -> None:
    host.reset()
    old, shell = host.hand_start(ALL, 8000, "hand-vllm")
    assert all(used == MIB_PER_GPU for used in host.used().values())
    host.install("vllm.service", unit_text("vllm.service", ALL, 8000), CONFIG)

    assert host.start("vllm.service", check=False) == 0
    new = host.wait_ready("/run/ready-vllm.service.json")

    assert host.sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() == "active"
    for pid in [old["api_server"], old["engine_core"], *old["workers"]]:
        assert not host.alive(pid), f"old server process {pid} survived"
    assert host.alive(shell), "the login session's shell was killed"
    assert "200" in host.sh(
        f"{PYTHON} -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8000/health').status)\""
    )
    assert "/system.slice/vllm.service" in host.sh(f"cat /proc/{new['api_server']}/cgroup")
    status = host.status()
    for gpu in status["gpus"]:
        assert gpu["used_mib"] == MIB_PER_GPU, gpu
    gpu_holders = [h for h in status["holders"] if h["used_mib"]]
    assert {h["unit"] for h in gpu_holders} == {"vllm.service"}
    bystanders_alive(host)
    host.sim.systemctl("stop", "vllm.service")


def test_killed_api_server_workers_reaped_and_memory_freed_by_post(host: Host) -> None:
    host.reset()
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 3000/' /etc/fake-nvml.conf")
    host.install("vllm.service", unit_text("vllm.service", ALL, 8000), CONFIG)
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    host.sh(f"kill -9 {pids['api_server']}")  # what `pkill -9 -f vllm.entrypoints` does
    deadline = time.monotonic() + 60
    while host.sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() not in (
        "inactive",
        "failed",
    ):
        assert time.monotonic() < deadline, "unit never stopped"
        time.sleep(0.1)
    # The unit is down only after ExecStopPost finished: the GPUs must be free now.
    assert all(used == 0 for used in host.used().values()), host.used()
    for pid in pids["workers"]:
        assert not host.alive(pid)
    bystanders_alive(host)


def test_killmode_process_leftovers_reaped_and_cgroup_empty(host: Host) -> None:
    host.reset()
    host.install("vllm.service", unit_text("vllm.service", ALL, 8000, kill_mode="process"), CONFIG)
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    tracker = [
        p
        for p in host.cgroup_pids("vllm.service")
        if "resource_tracker" in host.sh(f"tr '\\0' ' ' < /proc/{p}/cmdline", False)
    ]
    assert tracker, "the workload has no resource tracker"
    host.sim.systemctl("stop", "vllm.service")
    assert host.cgroup_pids("vllm.service") == []
    for pid in [pids["engine_core"], *pids["workers"], *tracker]:
        assert not host.alive(pid)
    assert all(used == 0 for used in host.used().values())


def test_workers_ignoring_sigterm_are_sigkilled(host: Host) -> None:
    host.reset()
    host.install(
        "vllm.service",
        unit_text("vllm.service", ALL, 8000, "--ignore-sigterm-workers", kill_mode="process"),
        CONFIG,
    )
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    cursor = host.cursor()
    host.sim.systemctl("stop", "vllm.service")
    for pid in pids["workers"]:
        assert not host.alive(pid)
    kills = host.journal_json(
        f"--after-cursor={cursor}", f"MESSAGE_ID={SIGNAL_SENT_ID}", "GPUGATE_SIGNAL=SIGKILL"
    )
    assert {int(e["GPUGATE_PID"]) for e in kills} >= set(pids["workers"])


def test_late_release_waits_extends_timeout_and_shows_status(host: Host) -> None:
    host.reset()
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 8000/' /etc/fake-nvml.conf")
    host.hand_start(ALL, 8000, "hand-late")
    # A start timeout shorter than the driver's delay: only EXTEND_TIMEOUT_USEC saves it.
    host.install("vllm.service", unit_text("vllm.service", ALL, 8000, start_timeout=5), CONFIG)
    host.sh("rm -f /run/ready-vllm.service.json")
    host.sim.systemctl("start", "--no-block", "vllm.service")
    seen_status = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = host.sim.systemctl("status", "--no-pager", "vllm.service", check=False).stdout
        if "waiting for" in shown:
            seen_status = shown
            break
        time.sleep(0.2)
    assert "gpugate pre: waiting for" in seen_status
    host.wait_ready("/run/ready-vllm.service.json", timeout=60)
    assert host.sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() == "active"
    host.sim.systemctl("stop", "vllm.service")


def test_leaked_memory_fails_start_within_timeout(host: Host) -> None:
    host.reset()
    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")
    host.install(
        "vllm.service", unit_text("vllm.service", ALL, 8000), "[pre]\nwait_timeout_s = 3\n[post]\nwait_timeout_s = 3\n"
    )
    cursor = host.cursor()
    started = time.monotonic()
    assert host.start("vllm.service", check=False) != 0
    assert time.monotonic() - started < 20
    entries = host.journal_json(
        f"--after-cursor={cursor}", "-u", "vllm.service", "GPUGATE_EVENT=timeout"
    )
    assert (
        entries and entries[0]["GPUGATE_GPU"] == "3" and entries[0]["GPUGATE_USED_MIB"] == "50000"
    )
    host.sh("rm -f /run/fake-nvml/leak/3")


def test_disjoint_units_independent_and_overlap_refused(host: Host) -> None:
    host.reset()
    host.install(
        "vllm-a.service",
        unit_text("vllm-a.service", (0, 1, 2, 3), 8001),
        "gpus = [0, 1, 2, 3]\n" + CONFIG,
    )
    host.install(
        "vllm-b.service",
        unit_text("vllm-b.service", (4, 5, 6, 7), 8002),
        "gpus = [4, 5, 6, 7]\n" + CONFIG,
    )
    host.start("vllm-a.service")
    a = host.wait_ready("/run/ready-vllm-a.service.json")
    host.start("vllm-b.service")
    b = host.wait_ready("/run/ready-vllm-b.service.json")
    host.sim.systemctl("stop", "vllm-b.service")
    assert all(host.alive(p) for p in a["workers"])
    assert not any(host.alive(p) for p in b["workers"])
    # A unit that wants GPU 2, which vllm-a holds: refused, nothing killed.
    host.install("vllm-c.service", unit_text("vllm-c.service", (2,), 8003), "gpus = [2]\n" + CONFIG)
    cursor = host.cursor()
    assert host.start("vllm-c.service", check=False) != 0
    assert all(host.alive(p) for p in a["workers"])
    refused = host.journal_json(f"--after-cursor={cursor}", "GPUGATE_EVENT=refused")
    assert refused and "vllm-a.service" in refused[0]["MESSAGE"]
    host.sim.systemctl("stop", "vllm-a.service")
    bystanders_alive(host)


def test_cleanup_history_is_queryable(host: Host) -> None:
    host.reset()
    old, _ = host.hand_start(ALL, 8000, "hand-history")
    host.install("vllm.service", unit_text("vllm.service", ALL, 8000), CONFIG)
    host.start("vllm.service")
    host.wait_ready("/run/ready-vllm.service.json")
    by_unit = host.journal_json("-u", "vllm.service", "GPUGATE_EVENT=signal_sent")
    assert {int(e["GPUGATE_PID"]) for e in by_unit} >= set(old["workers"])
    by_id = host.journal_json(f"MESSAGE_ID={SIGNAL_SENT_ID}")
    worker_entries = [e for e in by_id if int(e["GPUGATE_PID"]) in old["workers"]]
    # The process titles vLLM sets (the kernel's comm is cut to 15 characters).
    assert {e["GPUGATE_COMMAND"] for e in worker_entries} == {f"VLLM::Worker_TP{i}" for i in ALL}
    assert {e["GPUGATE_GPU"] for e in worker_entries} == {str(i) for i in ALL}
    host.sim.systemctl("stop", "vllm.service")
