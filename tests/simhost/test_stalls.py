"""A root hook that cannot be stalled or fooled (issue 18, scenarios b, c and d), on the
simulated GPU host: real systemd 252, the stand-in driver, the vLLM-like workload.

(b) NVML blocks on every query (the stand-in driver's `hang = 1`): a start with `[pre]
    wait_timeout_s = 15` fails at that deadline (exit 26), the journal names NVML, `gpugate
    status` returns, and once NVML answers again the next start succeeds;
(c) `systemctl stop` while a start waits on leaked memory returns promptly (pre exits 27,
    that start's post does not wait again), and the next start (leak gone) succeeds;
(d) a watcher holding every device file next to a stale server, the driver freeing memory
    1.5 s late: with `gpus = [0, 1, 2, 3]` and with all GPUs the stale server dies, the
    watcher lives, the unit starts.

The time limits asserted here are generous upper bounds that prove "no hang" (without the
fixes each of these waits out a whole TimeoutStartSec= or post's 120 s), not speed targets.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterator

import pytest
from incident import CONFIG, MIB_PER_GPU, PYTHON, TERMINAL, Host, prepare, server_cmd, unit_text
from sandbox import SimHost

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

NVML_CONF = "/etc/fake-nvml.conf"
GPUS = (0, 1, 2, 3)
PORT = 8000
UNIT = "vllm.service"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    answer_again(h)
    h.reset()


def answer_again(host: Host) -> None:
    host.sh(f"sed -i '/^hang/d' {NVML_CONF}; rm -f /run/fake-nvml/leak/*", check=False)


def finished(host: Host, cursor: str, phase: str) -> list[str]:
    return [
        e["GPUGATE_RESULT"]
        for e in host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE=phase)
    ]


def errors(host: Host, cursor: str, phase: str) -> list[dict[str, str]]:
    return host.events_after(cursor, GPUGATE_EVENT="error", GPUGATE_PHASE=phase)


def test_b_nvml_that_never_answers_fails_the_start_at_its_deadline(host: Host) -> None:
    host.reset()
    host.install(
        UNIT,
        unit_text(UNIT, GPUS, PORT),
        "gpus = [0, 1, 2, 3]\n[pre]\nwait_timeout_s = 15\nsigterm_grace_s = 2\n",
    )
    host.sh(f"echo 'hang = 1' >> {NVML_CONF}")
    try:
        cursor = host.cursor()
        # No hang: the deadline plus the kill grace end it (the guard would raise TimeoutExpired).
        started = host.sim.run(["systemctl", "start", UNIT], check=False, timeout=15 + 2 + 20)
        assert started.returncode != 0
        (said,) = [e for e in errors(host, cursor, "pre") if e.get("GPUGATE_EXIT_CODE")]
        assert said["GPUGATE_EXIT_CODE"] == str(int(ExitCode.NVML_NOT_ANSWERING))
        assert "nvmlInit" in said["MESSAGE"]  # names the call that hung
        warned = host.events_after(cursor, GPUGATE_EVENT="warning", GPUGATE_PHASE="post")
        assert [e.get("GPUGATE_REASON") for e in warned] == ["nvml-not-answering"], warned
        shown = host.sim.run(["systemctl", "status", "--no-pager", UNIT], check=False).stdout
        assert "nvmlInit" in shown, shown

        status = host.sim.run(["gpugate", "status"], check=False, timeout=10)  # NVML gets 5 s
        assert status.returncode == ExitCode.NVML_NOT_ANSWERING, status.stderr
        assert "  0! " in status.stdout and "nvidia-persistenced" not in status.stderr
    finally:
        answer_again(host)
    cursor = host.cursor()
    assert host.start(UNIT, check=False) == 0
    host.wait_ready(f"/run/ready-{UNIT}.json")
    assert finished(host, cursor, "pre") == ["success"]
    host.sim.systemctl("stop", UNIT)


def test_c_systemctl_stop_during_a_waiting_start_returns_promptly(host: Host) -> None:
    host.reset()
    host.install(
        UNIT,
        unit_text(UNIT, (3,), PORT, start_timeout=300),
        "gpus = [3]\n[pre]\nsigterm_grace_s = 2\n",  # wait_timeout_s: 120 s, post's too
    )
    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")
    try:
        cursor = host.cursor()
        host.sim.systemctl("start", "--no-block", UNIT)
        deadline = time.monotonic() + 60
        while not [
            e
            for e in host.events_after(cursor, GPUGATE_EVENT="waiting", GPUGATE_PHASE="pre")
            if e.get("GPUGATE_WAITING_FOR") == "memory"
        ]:
            assert time.monotonic() < deadline, "pre never waited for the leaked memory"
            time.sleep(0.2)
        # No hang: stop returns within the kill grace plus a few seconds (else TimeoutExpired).
        host.sim.run(["systemctl", "stop", UNIT], check=False, timeout=20)
        (stopped,) = [e for e in errors(host, cursor, "pre") if e.get("GPUGATE_EXIT_CODE")]
        assert stopped["GPUGATE_EXIT_CODE"] == str(int(ExitCode.INTERRUPTED))
        posts = host.events_after(cursor, GPUGATE_EVENT="timeout", GPUGATE_PHASE="post")
        assert any(e.get("GPUGATE_REASON") == "failed-start" for e in posts), posts
        assert host.sh("ls /run/gpugate/leases/ 2>/dev/null", check=False).strip() == ""
    finally:
        host.sh("rm -f /run/fake-nvml/leak/3")
    host.sh(f"systemctl reset-failed {UNIT}", check=False)
    cursor = host.cursor()
    assert host.start(UNIT, check=False) == 0
    host.wait_ready(f"/run/ready-{UNIT}.json")
    assert finished(host, cursor, "pre") == ["success"]
    host.sim.systemctl("stop", UNIT)


def children(host: Host, pid: int) -> list[int]:
    return [int(p) for p in host.sh(f"cat /proc/{pid}/task/*/children", False).split()]


def descendants(host: Host, pid: int) -> set[int]:
    found, queue = {pid}, [pid]
    while queue:
        for child in children(host, queue.pop()):
            if child not in found:
                found.add(child)
                queue.append(child)
    return found


@pytest.mark.parametrize("gpus", ["[0, 1, 2, 3]", '"all"'])
def test_d_watcher_lives_while_the_driver_frees_a_stale_servers_memory_late(
    host: Host, gpus: str
) -> None:
    host.reset()
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), f"gpus = {gpus}\n" + CONFIG)
    host.sh(f"sed -i 's/^release_delay_ms.*/release_delay_ms = 1500/' {NVML_CONF}")
    name = "watched"
    host.sh(f"rm -f /run/term-{name}.json")
    host.sim.spawn_scope([PYTHON, TERMINAL, name], unit=f"{name}.scope")
    shell = host.terminal_shell(name)
    devices = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
    redirects = " ".join(f"{3 + i}</dev/{device}" for i, device in enumerate(devices))
    host.type(name, f"bash -c {shlex.quote(f'exec {redirects} sleep 36001')} &")
    deadline = time.monotonic() + 30
    while not children(host, shell):
        assert time.monotonic() < deadline, "the watcher did not start"
        time.sleep(0.2)
    (watcher,) = children(host, shell)
    ready = "/run/ready-stale-watched.json"
    host.sh(f"rm -f {ready}")
    host.type(name, f"nohup setsid {server_cmd(GPUS, PORT, ready)} >/dev/null 2>&1 &")
    stale = descendants(host, host.wait_ready(ready)["api_server"])
    cursor = host.cursor()
    try:
        assert host.start(UNIT, check=False) == 0
        host.wait_ready(f"/run/ready-{UNIT}.json")
        assert host.alive(watcher), "the watcher is never killed"
        assert not any(host.alive(pid) for pid in stale), "the stale server dies"
        signalled = host.events_after(cursor, GPUGATE_EVENT="signal_sent", GPUGATE_PHASE="pre")
        assert str(watcher) not in {e["GPUGATE_PID"] for e in signalled}
        spared = host.events_after(cursor, GPUGATE_EVENT="process_spared", GPUGATE_PHASE="pre")
        assert {e["GPUGATE_REASON"] for e in spared if e["GPUGATE_PID"] == str(watcher)} == {
            "watcher"
        }
        waited = host.events_after(cursor, GPUGATE_EVENT="memory_freed", GPUGATE_PHASE="pre")
        assert waited, "the driver's late release was waited for"
        used = host.used()
        assert all(used[i] == MIB_PER_GPU for i in GPUS), used
    finally:
        host.sim.systemctl("stop", UNIT, f"{name}.scope", check=False)
