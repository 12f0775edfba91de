"""Units that share a host, on the simulated GPU host (real systemd 252, the stand-in driver,
the vLLM-like workload): the five scenarios of issue 11, and two units that share a GPU on
purpose (issue 46).

1. two units on overlapping GPUs started by one `systemctl start`: one active, the other
   refused naming it, 5 trials out of 5;
2. a unit with only `Environment=CUDA_VISIBLE_DEVICES=4,5` and no config: the orphan on GPU 4
   dies, the one on GPU 1 lives;
3. GPU 6 lost: a unit on GPUs 0-3 still starts, `status` still shows GPUs 0-5 and 7 and every
   holder, and exits 81;
4. `gpugate pre UNIT` typed in a shell while UNIT is active: nothing killed, exit 80;
5. a start that fails on leaked memory with `[pre] wait_timeout_s = 8` ends within one
   deadline plus the kill, and `systemctl status` shows pre's reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from incident import MIB_PER_GPU, Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

FAST = "[pre]\nsigterm_grace_s = 2\n[post]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"
NVML_CONF = "/etc/fake-nvml.conf"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    restore_driver(h)
    h.reset()


def restore_driver(host: Host) -> None:
    host.sh(f"sed -i '/^lost_gpus/d' {NVML_CONF}; rm -f /run/fake-nvml/leak/*", check=False)


def unit_on(name: str, gpus: tuple[int, ...], port: int, environment: str) -> str:
    """The vLLM-like unit, its GPUs named only by the environment systemd gives it."""
    return unit_text(name, gpus, port).replace(
        "[Service]\n", f"[Service]\nEnvironment={environment}\n", 1
    )


def active(host: Host, unit: str) -> str:
    return host.sim.systemctl("is-active", unit, check=False).stdout.strip()


def status_json(host: Host) -> tuple[int, dict[str, Any]]:
    result = host.sim.run(["gpugate", "status", "--json"], check=False, timeout=60)
    data: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, data


def test_overlapping_units_started_together_one_is_refused(host: Host) -> None:
    host.reset()
    units = {"vllm-a.service": (0, 1, 2, 3), "vllm-b.service": (2, 3, 4, 5)}
    for port, (unit, gpus) in enumerate(units.items(), 8001):
        env = "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, gpus))
        host.install(unit, unit_on(unit, gpus, port, env), FAST)
    outcomes = []
    for trial in range(5):
        host.sh("rm -f /run/ready-vllm-*.json")
        cursor = host.cursor()
        # One command, two start jobs: systemd runs both ExecStartPre= at the same moment.
        host.sim.run(["systemctl", "start", *units], check=False, timeout=120)
        states = {unit: active(host, unit) for unit in units}
        winners = [unit for unit, state in states.items() if state == "active"]
        assert len(winners) == 1, (trial, states)
        (winner,) = winners
        (loser,) = set(units) - {winner}
        assert states[loser] == "failed", (trial, states)
        refused = host.events_after(
            cursor, _SYSTEMD_UNIT=loser, GPUGATE_EVENT="refused", GPUGATE_PHASE="pre"
        )
        assert any(winner in e["MESSAGE"] for e in refused), (trial, refused)
        ready = host.wait_ready(f"/run/ready-{winner}.json")
        assert all(host.alive(pid) for pid in ready["workers"])
        outcomes.append(winner)
        host.sim.run(["systemctl", "stop", *units], check=False, timeout=120)
        host.sh("systemctl reset-failed 'vllm-*.service'", check=False)
        assert host.sh("ls /run/gpugate/leases/ 2>/dev/null", check=False).strip() == "", (
            "each unit's post released its lease"
        )
    assert len(outcomes) == 5


def test_gpus_from_the_units_cuda_visible_devices(host: Host) -> None:
    host.reset()
    mine, _ = host.hand_start((4,), 8010, "hand-gpu4")
    theirs, _ = host.hand_start((1,), 8011, "hand-gpu1")
    unit = "vllm-env.service"
    host.sim.run(f"rm -f /etc/gpugate/{unit}.toml /etc/gpugate/default.toml", check=False)
    host.sim.install_unit(unit, unit_on(unit, (4, 5), 8012, "CUDA_VISIBLE_DEVICES=4,5"))
    cursor = host.cursor()
    host.start(unit)
    host.wait_ready(f"/run/ready-{unit}.json")
    assert not any(host.alive(pid) for pid in mine["workers"]), "the orphan on GPU 4 dies"
    assert all(host.alive(pid) for pid in theirs["workers"]), "the one on GPU 1 lives"
    (started,) = host.events_after(
        cursor, _SYSTEMD_UNIT=unit, GPUGATE_EVENT="run_started", GPUGATE_PHASE="pre"
    )
    assert started["GPUGATE_GPU"] == "4,5"
    assert started["GPUGATE_GPU_SOURCE"] == f"CUDA_VISIBLE_DEVICES of {unit} (Environment=)"
    host.sim.run(["gpugate", "config", "check", "--unit", unit])  # exits 0: it resolves them
    host.sim.systemctl("stop", unit)


def test_a_lost_gpu_of_another_unit_stops_nothing(host: Host) -> None:
    host.reset()
    other, _ = host.hand_start((5,), 8020, "hand-gpu5")
    on_lost, _ = host.hand_start((6,), 8021, "hand-gpu6")
    unit = "vllm-lost.service"
    host.install(unit, unit_on(unit, (0, 1, 2, 3), 8022, "CUDA_VISIBLE_DEVICES=0,1,2,3"), FAST)
    host.sh(f"echo 'lost_gpus = 6' >> {NVML_CONF}")
    try:
        cursor = host.cursor()
        host.start(unit)
        ready = host.wait_ready(f"/run/ready-{unit}.json")
        assert active(host, unit) == "active"
        warned = host.events_after(cursor, _SYSTEMD_UNIT=unit, GPUGATE_EVENT="warning")
        assert [(e["GPUGATE_REASON"], e["GPUGATE_GPU"], e["PRIORITY"]) for e in warned] == [
            ("gpu-fault", "6", "4")
        ]
        assert not host.events_after(cursor, _SYSTEMD_UNIT=unit, GPUGATE_EVENT="error")

        code, data = status_json(host)
        assert code == 81
        assert [gpu["index"] for gpu in data["gpus"]] == [0, 1, 2, 3, 4, 5, 7]
        assert [(g["index"], "lost" in g["error"]) for g in data["unreadable_gpus"]] == [(6, True)]
        by_pid = {h["pid"]: h for h in data["holders"]}
        assert len(ready["workers"]) == 4
        for pid, gpu in zip(ready["workers"], (0, 1, 2, 3)):
            assert by_pid[pid]["gpus"] == [gpu] and by_pid[pid]["used_mib"] == {
                str(gpu): MIB_PER_GPU
            }
        assert by_pid[other["workers"][0]]["gpus"] == [5]
        # the lost GPU's holder, from its device file alone
        assert by_pid[on_lost["workers"][0]]["gpus"] == [6]
        assert by_pid[on_lost["workers"][0]]["sources"] == ["device-fd"]
        table = host.sim.run(["gpugate", "status"], check=False)
        assert table.returncode == 81 and "  6! " in table.stdout
    finally:
        restore_driver(host)
    host.sim.systemctl("stop", unit)


def test_two_units_that_share_gpus_restart_independently(host: Host) -> None:
    """issue 46: two units with share_gpus = true on GPU 2 each start, restart and stop beside
    the other (their post exits 0: the unit ends inactive, not failed), and a stale server
    started by hand on the shared GPU is freed by the start that finds it."""
    host.reset()
    a, b = "vllm-share-a.service", "vllm-share-b.service"
    for unit, port in ((a, 8040), (b, 8041)):
        env = "CUDA_VISIBLE_DEVICES=2"
        host.install(unit, unit_on(unit, (2,), port, env), "share_gpus = true\n" + FAST)
    host.start(a)
    first = host.wait_ready(f"/run/ready-{a}.json")
    stale, _ = host.hand_start((2,), 8042, "hand-stale2")
    cursor = host.cursor()
    host.start(b)
    second = host.wait_ready(f"/run/ready-{b}.json")
    assert all(host.alive(pid) for pid in first["workers"]), "a sharer is never killed"
    assert not any(host.alive(pid) for pid in stale["workers"]), "the orphan on GPU 2 dies"
    spared = host.events_after(cursor, _SYSTEMD_UNIT=b, GPUGATE_REASON="sharer")
    assert {e["GPUGATE_PID"] for e in spared} >= {str(first["workers"][0])}, spared

    # a restarts: its post and pre both succeed, b's server untouched.
    cursor = host.cursor()
    host.sh(f"rm -f /run/ready-{a}.json")
    host.sim.systemctl("restart", a)
    again = host.wait_ready(f"/run/ready-{a}.json")
    assert active(host, a) == active(host, b) == "active"
    assert all(host.alive(pid) for pid in second["workers"])
    finished = host.events_after(cursor, _SYSTEMD_UNIT=a, GPUGATE_EVENT="run_finished")
    assert [(e["GPUGATE_PHASE"], e["GPUGATE_RESULT"]) for e in finished] == [
        ("post", "success"),
        ("pre", "success"),
    ], finished

    # b stops: exit 0 (inactive, not failed); a runs on with its lease.
    cursor = host.cursor()
    host.sim.systemctl("stop", b)
    assert active(host, b) == "inactive"
    assert again["workers"] != first["workers"]
    assert all(host.alive(pid) for pid in again["workers"])
    spared = host.events_after(cursor, _SYSTEMD_UNIT=b, GPUGATE_REASON="sharer")
    assert {e["GPUGATE_PID"] for e in spared} >= {str(again["workers"][0])}, spared
    leases = host.sh("ls /run/gpugate/leases/").split()
    assert leases == [f"{a}.json"], leases
    host.sim.systemctl("stop", a)
    assert active(host, a) == "inactive"


def test_a_hand_typed_pre_on_an_active_unit_kills_nothing(host: Host) -> None:
    host.reset()
    unit = "vllm-manual.service"
    host.install(unit, unit_on(unit, (0, 1), 8030, "CUDA_VISIBLE_DEVICES=0,1"), FAST)
    host.start(unit)
    ready = host.wait_ready(f"/run/ready-{unit}.json")
    cursor = host.cursor()

    typed = host.sim.run(["gpugate", "pre", unit], check=False, timeout=60)

    assert typed.returncode == 80, typed.stderr
    (line,) = typed.stderr.strip().splitlines()
    assert line.startswith(f"gpugate: {unit} ")
    assert f"PID {ready['api_server']}" in line
    assert active(host, unit) == "active"
    assert all(host.alive(pid) for pid in [ready["api_server"], *ready["workers"]])
    assert not host.events_after(cursor, GPUGATE_EVENT="signal_sent")
    dry = host.sim.run(["gpugate", "pre", unit, "--dry-run"], check=False, timeout=60)
    assert dry.returncode == 0 and all(host.alive(pid) for pid in ready["workers"])
    host.sim.systemctl("stop", unit)


@pytest.mark.message
def test_a_failed_start_pays_one_deadline_and_says_why(host: Host) -> None:
    host.reset()
    unit = "vllm-leak.service"
    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")
    try:
        # post keeps its default wait_timeout_s (120 s): before, it waited that long again.
        host.install(
            unit,
            unit_on(unit, (3,), 8040, "CUDA_VISIBLE_DEVICES=3"),
            "[pre]\nwait_timeout_s = 8\nsigterm_grace_s = 2\n",
        )
        # The guard: one deadline plus the kill ends it, not 8 + post's 120 s.
        started = host.sim.run(["systemctl", "start", unit], check=False, timeout=60)
        assert started.returncode != 0
        shown = host.sim.run(["systemctl", "status", "--no-pager", "-n", "10", unit], check=False)
        assert "start failed in gpugate pre: GPU 3" in shown.stdout, shown.stdout
        assert "50000 MiB used after 8 s" in shown.stdout, shown.stdout
    finally:
        host.sh("rm -f /run/fake-nvml/leak/3")
