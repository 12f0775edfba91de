"""The incident, end to end, on the simulated GPU host: real systemd, the stand-in driver, a
vLLM-like workload, and gpugate installed as an operator installs it.

Each scenario asserts on NVML memory per GPU (through `gpugate status --json`, which reads the
stand-in driver exactly as production reads NVIDIA's), on which processes live afterwards, on
`systemctl` results and on the journal. Each would fail with the gpugate lines removed from the
unit: set GPUGATE_SCENARIO_WITHOUT_GPUGATE=1 to run them that way (they then fail).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from incident import (
    CONFIG,
    MIB_PER_GPU,
    PYTHON,
    SIGNAL_SENT_ID,
    Host,
    prepare,
    unit_text,
)
from sandbox import SimHost

from gpugate.errors import ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

GPUS = (0, 1, 2, 3, 4, 5)  # the vllm units' GPUs
BYSTANDER_GPUS = (6, 7)
UNIT_CONFIG = "gpus = [0, 1, 2, 3, 4, 5]\n" + CONFIG


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    # A bystander that must survive every scenario: another unit's job on GPUs 6 and 7.
    simhost.install_unit(
        "bystander-job.service", unit_text("bystander-job.service", BYSTANDER_GPUS, 8100)
    )
    simhost.systemctl("start", "bystander-job.service")
    h.wait_ready("/run/ready-bystander-job.service.json")
    h.busy_ok = set(BYSTANDER_GPUS)
    yield h
    # The session's host goes on to other modules: leave GPUs 6-7 free for them.
    simhost.systemctl("stop", "bystander-job.service", check=False)
    h.busy_ok = set()
    h.reset()


def bystanders_alive(host: Host) -> None:
    assert (
        host.sim.systemctl("is-active", "bystander-job.service", check=False).stdout.strip()
        == "active"
    )
    used = host.used()
    assert all(used[i] == MIB_PER_GPU for i in BYSTANDER_GPUS), used
    assert (
        host.sim.systemctl("is-active", "nvidia-persistenced.service", check=False).stdout.strip()
        == "active"
    )
    assert (
        host.sim.systemctl("is-active", "python-bystander.scope", check=False).stdout.strip()
        == "active"
    )


@pytest.fixture(autouse=True)
def _bystanders_survive_every_scenario(host: Host) -> Iterator[None]:
    yield
    bystanders_alive(host)


def test_hand_started_server_is_replaced_by_the_unit(host: Host) -> None:
    host.reset()
    old, shell = host.hand_start(GPUS, 8000, "hand-vllm")
    assert all(host.used()[i] == MIB_PER_GPU for i in GPUS)
    old_tracker = [
        int(p)
        for p in host.sh(f"cat /proc/{old['api_server']}/task/*/children").split()
        if "resource_tracker" in host.sh(f"tr '\\0' ' ' < /proc/{p}/cmdline", False)
    ]
    assert old_tracker, "the hand-started server has no resource tracker"
    host.install("vllm.service", unit_text("vllm.service", GPUS, 8000), UNIT_CONFIG)
    cursor = host.cursor()

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
    on_unit_gpus = [h for h in status["holders"] if h["used_mib"] and set(h["gpus"]) <= set(GPUS)]
    assert {h["unit"] for h in on_unit_gpus} == {"vllm.service"}
    signalled = host.events_after(cursor, GPUGATE_EVENT="signal_sent", GPUGATE_PHASE="pre")
    assert {int(e["GPUGATE_PID"]) for e in signalled} == {
        old["api_server"],
        old["engine_core"],
        *old["workers"],
        *old_tracker,
    }
    bystanders_alive(host)
    host.sim.systemctl("stop", "vllm.service")


def test_killed_api_server_workers_reaped_and_memory_freed_by_post(host: Host) -> None:
    host.reset()
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 3000/' /etc/fake-nvml.conf")
    host.install("vllm.service", unit_text("vllm.service", GPUS, 8000), UNIT_CONFIG)
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    cursor = host.cursor()
    host.sh(f"kill -9 {pids['api_server']}")  # what `pkill -9 -f vllm.entrypoints` does
    deadline = time.monotonic() + 60
    while host.sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() not in (
        "inactive",
        "failed",
    ):
        assert time.monotonic() < deadline, "unit never stopped"
        time.sleep(0.1)
    # The unit is down only after ExecStopPost finished: the GPUs must be free now.
    assert host.free(GPUS), host.used()
    for pid in pids["workers"]:
        assert not host.alive(pid)
    (finished,) = host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE="post")
    assert finished["GPUGATE_RESULT"] == "success"
    assert float(finished["GPUGATE_SECONDS_WAIT"]) > 0.5, "post did not wait for the driver"
    bystanders_alive(host)


def test_killmode_process_leftovers_reaped_and_cgroup_empty(host: Host) -> None:
    host.reset()
    host.install(
        "vllm.service", unit_text("vllm.service", GPUS, 8000, kill_mode="process"), UNIT_CONFIG
    )
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    tracker = [
        p
        for p in host.cgroup_pids("vllm.service")
        if "resource_tracker" in host.sh(f"tr '\\0' ' ' < /proc/{p}/cmdline", False)
    ]
    assert tracker, "the workload has no resource tracker"
    cursor = host.cursor()
    host.sim.systemctl("stop", "vllm.service")
    assert host.cgroup_pids("vllm.service") == []
    for pid in [pids["engine_core"], *pids["workers"], *tracker]:
        assert not host.alive(pid)
    assert host.free(GPUS)
    signalled = host.events_after(cursor, GPUGATE_EVENT="signal_sent", GPUGATE_PHASE="post")
    assert {int(e["GPUGATE_PID"]) for e in signalled} == {
        pids["engine_core"],
        *pids["workers"],
        *tracker,
    }


def test_workers_ignoring_sigterm_are_sigkilled(host: Host) -> None:
    host.reset()
    host.install(
        "vllm.service",
        unit_text("vllm.service", GPUS, 8000, "--ignore-sigterm-workers", kill_mode="process"),
        UNIT_CONFIG,
    )
    host.start("vllm.service")
    pids = host.wait_ready("/run/ready-vllm.service.json")
    cursor = host.cursor()
    host.sim.systemctl("stop", "vllm.service")
    for pid in pids["workers"]:
        assert not host.alive(pid)
    kills = host.events_after(cursor, MESSAGE_ID=SIGNAL_SENT_ID, GPUGATE_SIGNAL="SIGKILL")
    assert {int(e["GPUGATE_PID"]) for e in kills} >= set(pids["workers"])


def test_late_release_waits_extends_timeout_and_shows_status(host: Host) -> None:
    host.reset()
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 8000/' /etc/fake-nvml.conf")
    host.hand_start(GPUS, 8000, "hand-late")
    # A start timeout shorter than the driver's delay: only EXTEND_TIMEOUT_USEC saves it.
    host.install(
        "vllm.service", unit_text("vllm.service", GPUS, 8000, start_timeout=5), UNIT_CONFIG
    )
    host.sh("rm -f /run/ready-vllm.service.json")
    cursor = host.cursor()
    host.sim.systemctl("start", "--no-block", "vllm.service")
    # Every STATUS= systemd holds for the unit until its start is over; the wait's lasts the
    # driver's 8 s delay. (`systemctl status` once matched a journal line it printed while the
    # STATUS= it showed was still the one before.)
    statuses: set[str] = set()
    deadline = time.monotonic() + 300  # a guard only: the loop ends with the start
    while time.monotonic() < deadline:
        shown = host.sim.systemctl(
            "show", "--property=ActiveState,StatusText", "vllm.service", check=False
        ).stdout
        unit = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
        statuses.add(unit.get("StatusText", ""))
        if unit.get("ActiveState") not in ("inactive", "activating"):
            break
        time.sleep(0.2)
    assert any(status.startswith("gpugate pre: waiting for") for status in statuses), statuses
    host.wait_ready("/run/ready-vllm.service.json", timeout=60)
    assert host.sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() == "active"
    (finished,) = host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE="pre")
    assert finished["GPUGATE_RESULT"] == "success"
    assert float(finished["GPUGATE_SECONDS_WAIT"]) > 5
    assert host.events_after(cursor, GPUGATE_EVENT="memory_freed", GPUGATE_PHASE="pre")
    host.sim.systemctl("stop", "vllm.service")


def test_leaked_memory_fails_start_within_timeout(host: Host) -> None:
    host.reset()
    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")
    host.install(
        "vllm.service",
        unit_text("vllm.service", GPUS, 8000),
        "gpus = [0, 1, 2, 3, 4, 5]\n[pre]\nwait_timeout_s = 3\nsigterm_grace_s = 1\nsigkill_wait_s = 1\n"
        "[post]\nwait_timeout_s = 3\nsigterm_grace_s = 1\nsigkill_wait_s = 1\n",
    )
    cursor = host.cursor()
    host.sh("rm -f /run/ready-vllm.service.json")
    # The start fails at pre's deadline (else the guard's TimeoutExpired), not after a hang.
    assert (
        host.sim.run(["systemctl", "start", "vllm.service"], check=False, timeout=20).returncode
        != 0
    )
    entries = host.events_after(cursor, _SYSTEMD_UNIT="vllm.service", GPUGATE_EVENT="timeout")
    assert (
        entries and entries[0]["GPUGATE_GPU"] == "3" and entries[0]["GPUGATE_USED_MIB"] == "50000"
    )
    host.sh("rm -f /run/fake-nvml/leak/3")


def test_disjoint_units_independent_and_overlap_refused(host: Host) -> None:
    host.reset()
    host.install(
        "vllm-a.service",
        unit_text("vllm-a.service", (0, 1, 2), 8001),
        "gpus = [0, 1, 2]\n" + CONFIG,
    )
    host.install(
        "vllm-b.service",
        unit_text("vllm-b.service", (3, 4, 5), 8002),
        "gpus = [3, 4, 5]\n" + CONFIG,
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
    refused = host.events_after(cursor, GPUGATE_EVENT="refused")
    assert refused and "vllm-a.service" in refused[0]["MESSAGE"]
    host.sim.systemctl("stop", "vllm-a.service")
    bystanders_alive(host)


def test_cleanup_history_is_queryable(host: Host) -> None:
    host.reset()
    old, _ = host.hand_start(GPUS, 8000, "hand-history")
    host.install("vllm.service", unit_text("vllm.service", GPUS, 8000), UNIT_CONFIG)
    host.start("vllm.service")
    host.wait_ready("/run/ready-vllm.service.json")
    by_unit = host.journal_json("-u", "vllm.service", "GPUGATE_EVENT=signal_sent")
    assert {int(e["GPUGATE_PID"]) for e in by_unit} >= set(old["workers"])
    by_id = host.journal_json(f"MESSAGE_ID={SIGNAL_SENT_ID}")
    worker_entries = [e for e in by_id if int(e["GPUGATE_PID"]) in old["workers"]]
    # The process titles vLLM sets (the kernel's comm is cut to 15 characters).
    assert {e["GPUGATE_COMMAND"] for e in worker_entries} == {f"VLLM::Worker_TP{i}" for i in GPUS}
    assert {e["GPUGATE_GPU"] for e in worker_entries} == {str(i) for i in GPUS}
    host.sim.systemctl("stop", "vllm.service")


def test_unknown_unit_and_template_instance_with_escapes(host: Host) -> None:
    host.reset()
    missing = host.sim.run(["gpugate", "pre", "no-such-unit.service"], check=False)
    assert missing.returncode == ExitCode.UNKNOWN_UNIT
    assert "no-such-unit.service" in missing.stderr
    assert missing.stderr.count("\n") == 1
    template = host.sim.run(["gpugate", "pre", "vllm@.service"], check=False)
    assert template.returncode == ExitCode.UNKNOWN_UNIT, template.stderr
    # An instance whose name carries a systemd escape, configured through the template file.
    host.sim.install_unit(
        "vllm@.service", unit_text("vllm@%i.service", (5,), 8005).replace("--gpus 5", "--gpus %i")
    )
    host.sim.write_file("/etc/gpugate/vllm@.service.toml", "gpus = [5]\n" + CONFIG)
    old, _ = host.hand_start((5,), 8009, "hand-escape")
    instance = r"vllm@5.service"
    escaped = host.sim.run(["systemd-escape", "--template=vllm@.service", "5"]).stdout.strip()
    assert escaped == instance
    assert host.start(instance, check=False) == 0
    assert not any(host.alive(pid) for pid in old["workers"])
    entries = host.journal_json("-u", instance, "GPUGATE_EVENT=run_started")
    assert entries and entries[-1]["GPUGATE_UNIT"] == instance
    assert entries[-1]["GPUGATE_CONFIG"] == "/etc/gpugate/vllm@.service.toml"
    host.sim.systemctl("stop", instance)
    odd = host.sim.run(["gpugate", "pre", "--dry-run", r"vllm@a\x2db.service"], check=False)
    assert odd.returncode == 0, odd.stderr
