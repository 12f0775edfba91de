"""The incident's pieces, shared by the scenario tests and the demo (`scripts/demo`): a
vLLM-like unit, a server started by hand from a login session, and views of the simulated
host's GPUs, processes and journal."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sandbox import SimHost

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "simhost" / "workload" / "fake_vllm.py"
TERMINAL_SOURCE = REPO / "tests" / "simhost" / "workload" / "terminal.py"
TERMINAL = "/opt/fakevllm/terminal.py"
# The workload's interpreter inside the host: Debian's python3 in a venv of its own, with the
# tests' setproctitle copied in (stage_python). A fixed path inside, because the checkout's
# own .venv may not be visible there (a checkout under /tmp is not: the host's /tmp is its own).
PYTHON = "/opt/fakevllm/venv/bin/python"
WORKLOAD_PACKAGES = ("setproctitle",)
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
        self.busy_ok: set[int] = set()  # GPUs a bystander holds on purpose

    def free(self, gpus: tuple[int, ...]) -> bool:
        used = self.used()
        return all(used[i] == 0 for i in gpus)

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
        """A server started by hand from a login: typed into an interactive shell with job
        control on a pty (as an ssh login gives), the terminal in a user scope. Returns the
        server's pids and the shell's pid."""
        ready = f"/run/ready-{name}.json"
        self.sh(f"rm -f {ready} /run/term-{name}.json")
        self.sim.spawn_scope([PYTHON, TERMINAL, name], unit=f"{name}.scope")
        shell = self.terminal_shell(name)
        self.type(name, f"{server_cmd(gpus, port, ready, *extra)} &")
        pids = self.wait_ready(ready)
        return pids, shell

    def terminal_shell(self, name: str) -> int:
        """The interactive shell of terminal NAME (workload/terminal.py), once it runs."""
        return int(self.wait_ready(f"/run/term-{name}.json")["shell"])

    def type(self, name: str, line: str) -> None:
        """Type a line into terminal NAME's shell."""
        self.sh(f"printf '%s\\n' {shlex.quote(line)} > /run/term-{name}.in")

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

    def events_after(self, cursor: str, **fields: str) -> list[dict[str, Any]]:
        """Entries after the cursor that carry these fields. Filtered here: journalctl 252 given
        --after-cursor and a field match skips the first matching entry."""
        return [
            entry
            for entry in self.journal_json(f"--after-cursor={cursor}")
            if all(entry.get(key) == value for key, value in fields.items())
        ]

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
        while time.monotonic() < deadline and any(
            used for i, used in self.used().items() if i not in self.busy_ok
        ):
            time.sleep(0.2)


CONFIG = "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n[post]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"


def prepare(sim: SimHost) -> Host:
    """gpugate installed from source as the README says, then `stage_incident`."""
    if sim.run(
        ["test", "-e", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"], check=False
    ).returncode:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    sim.install_gpugate(REPO)
    return stage_incident(sim)


def stage_python(sim: SimHost) -> None:
    """PYTHON inside: a venv of the host's /usr/bin/python3 (the one the tests' .venv is made
    from, so compiled modules fit) with the workload's packages copied from the tests' own."""
    if sim.exists(PYTHON):
        return
    sim.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(Path(PYTHON).parents[1])])
    inside = sim.run(
        [
            PYTHON,
            "-c",
            "import sys, sysconfig; print(sys.version_info[1], sysconfig.get_paths()['purelib'])",
        ]
    )
    minor, site = inside.stdout.split()
    if int(minor) != sys.version_info[1]:
        return  # another release's Python (tests/simhost/roots.py): the workload does without
    for name in WORKLOAD_PACKAGES:
        module = importlib.import_module(name)
        package = Path(str(module.__file__)).parent
        for path in sorted(package.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                relative = path.relative_to(package.parent)
                sim.write_file(f"{site}/{relative}", path.read_bytes(), mode=0o644)


def stage_incident(sim: SimHost) -> Host:
    """The workload, the driver settings, and the bystanders every scenario must leave alive:
    nvidia-persistenced holding every device file, a python process holding no GPU."""
    stage_python(sim)
    sim.write_file("/opt/fakevllm/fake_vllm.py", WORKLOAD.read_text())
    sim.write_file(TERMINAL, TERMINAL_SOURCE.read_text())
    sim.write_file("/etc/fake-nvml.conf", "gpu_count = 8\nrelease_delay_ms = 0\n")
    devices = [f"nvidia{i}" for i in ALL] + ["nvidiactl", "nvidia-uvm"]
    redirects = " ".join(f"{3 + i}</dev/{name}" for i, name in enumerate(devices))
    sim.install_unit(
        "nvidia-persistenced.service",
        f"[Service]\nExecStart=/bin/bash -c 'exec {redirects} sleep infinity'\n",
    )
    sim.systemctl("start", "nvidia-persistenced.service")
    sim.spawn_scope([PYTHON, "-c", "import time; time.sleep(36000)"], unit="python-bystander.scope")
    return Host(sim)
