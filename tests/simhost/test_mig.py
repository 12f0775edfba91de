"""MIG slices on the simulated GPU host (real systemd, the stand-in driver with GPU 0 in MIG
mode and three slices, the vLLM-like workload on slices): issue 37's "Done when".

a.service owns slice 1 and a stale hand-started server holds slice 1; b.service runs on slice
2. Every one of them holds /dev/nvidia0. Starting a kills only the stale server; b's server
lives; `status` shows the three slices with their holders; whole.service on GPU 0 is refused
while a or b runs, and a is refused while whole runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from incident import Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

NVML_CONF = "/etc/fake-nvml.conf"
MIG_CONF = "mig = 0 1/0/20000/2g.20gb 2/0/20000/2g.20gb 5/0/40000/3g.40gb\n"
GPU0 = "GPU-fa4e5a11-0000-0000-0000-000000000000"
FAST = "[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n[post]\nsigterm_grace_s = 2\n"
SLICE_MIB = ("--mib", "5000")  # each worker's use of its slice (of 20000)


def mig_uuid(gi: int) -> str:
    """The stand-in's UUID of GPU 0's slice with GPU instance GI (compute instance 0)."""
    return f"MIG-fa4e5a11-0000-0000-0000-0000{gi:04x}0000"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    h.sh(f"printf '%s' {json.dumps(MIG_CONF)} >> {NVML_CONF}")
    yield h
    h.sh(
        "systemctl stop a.service b.service whole.service 2>/dev/null; "
        f"sed -i '/^mig/d' {NVML_CONF}",
        check=False,
    )
    h.reset()


def on(name: str, gpus: str, port: int, visible: str) -> str:
    """The vLLM-like unit; its workers on GPUS (N or N/GI/CI), CUDA_VISIBLE_DEVICES=VISIBLE."""
    text = unit_text(name, (0,), port, *SLICE_MIB).replace("--gpus 0 ", f"--gpus {gpus} ", 1)
    return text.replace("[Service]\n", f"[Service]\nEnvironment=CUDA_VISIBLE_DEVICES={visible}\n")


def active(host: Host, unit: str) -> str:
    return host.sim.systemctl("is-active", unit, check=False).stdout.strip()


def status_json(host: Host) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(host.sim.run(["gpugate", "status", "--json"]).stdout)
    return data


def test_a_slices_start_frees_that_slice_alone(host: Host) -> None:
    host.reset()
    stale, _ = host.hand_start((0,), 8301, "hand-mig1", "--gpus", "0/1/0", *SLICE_MIB)
    host.install("b.service", on("b.service", "0/2/0", 8302, f"MIG-{GPU0}/2/0"), FAST)
    host.install("a.service", on("a.service", "0/1/0", 8303, mig_uuid(1)), FAST)
    host.install("whole.service", on("whole.service", "0", 8304, "0"), FAST)

    host.start("b.service")
    b = host.wait_ready("/run/ready-b.service.json")
    cursor = host.cursor()
    host.start("a.service")
    a = host.wait_ready("/run/ready-a.service.json")
    assert not any(host.alive(pid) for pid in stale["workers"]), "the stale server on slice 1"
    assert all(host.alive(pid) for pid in b["workers"]), "b's server on slice 2 lives"
    killed = {
        int(e["GPUGATE_PID"])
        for e in host.events_after(cursor, _SYSTEMD_UNIT="a.service", GPUGATE_EVENT="signal_sent")
    }
    # the stale application (its workers, and the rest of its tree), nothing of b's
    assert set(stale["workers"]) <= killed
    assert not killed & {b["api_server"], b["engine_core"], *b["workers"]}
    (started,) = host.events_after(
        cursor, _SYSTEMD_UNIT="a.service", GPUGATE_EVENT="run_started", GPUGATE_PHASE="pre"
    )
    assert started["GPUGATE_GPU"] == str(1024 + 0)  # slice 1 alone (host.nvml.mig_key)

    data = status_json(host)
    slices = {g["shown"]: g for g in data["gpus"] if g["mig"] is not None}
    assert set(slices) == {"0/1/0", "0/2/0", "0/5/0"}
    assert slices["0/1/0"]["mig"]["pids"] == a["workers"]
    assert slices["0/2/0"]["mig"]["pids"] == b["workers"]
    assert slices["0/5/0"]["mig"]["pids"] == []
    assert slices["0/1/0"]["leased_to"] == ["a.service"]
    assert slices["0/2/0"]["leased_to"] == ["b.service"]
    assert slices["0/1/0"]["used_mib"] == 5000

    # the whole GPU while a and b run: refused, nothing killed
    assert host.start("whole.service", check=False) != 0
    assert active(host, "whole.service") == "failed"
    assert all(host.alive(pid) for pid in [*a["workers"], *b["workers"]])
    host.sim.systemctl("stop", "a.service")
    assert host.start("whole.service", check=False) != 0, "b still runs on slice 2"
    assert all(host.alive(pid) for pid in b["workers"])
    host.sim.systemctl("stop", "b.service")
    host.sh("systemctl reset-failed whole.service", check=False)

    # and the reverse: a slice while the whole GPU is leased
    host.start("whole.service")
    whole = host.wait_ready("/run/ready-whole.service.json")
    assert host.start("a.service", check=False) != 0
    assert active(host, "a.service") == "failed"
    assert all(host.alive(pid) for pid in whole["workers"])
    host.sim.systemctl("stop", "whole.service")


@pytest.mark.parametrize(
    "visible",
    [
        mig_uuid(3),  # no such slice
        f"MIG-{GPU0[:-1]}1/1/0",  # GPU 1: not in MIG mode
        f"MIG-{GPU0}/4/0",  # the legacy form, no slice with GI 4
    ],
)
def test_an_unresolved_slice_fails_the_start_killing_nothing(host: Host, visible: str) -> None:
    host.reset()
    stale, _ = host.hand_start((0,), 8311, "hand-mig-bad", "--gpus", "0/1/0", *SLICE_MIB)
    host.install("a.service", on("a.service", "0/1/0", 8312, visible), FAST)
    cursor = host.cursor()
    assert host.start("a.service", check=False) != 0
    entries = host.events_after(cursor, _SYSTEMD_UNIT="a.service", GPUGATE_PHASE="pre")
    assert [e.get("GPUGATE_EXIT_CODE") for e in entries if e.get("GPUGATE_EXIT_CODE")] == ["78"]
    assert all(host.alive(pid) for pid in stale["workers"])
    host.sh("systemctl reset-failed a.service; systemctl stop hand-mig-bad.scope", check=False)
