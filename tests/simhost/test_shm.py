"""The shared memory a stale application leaves in /dev/shm (issue 21), on the simulated GPU host
(its own tmpfs on /dev/shm): a vLLM-like server started by hand on GPUs 0-3 holds a
multiprocessing segment open (worker 0), an NCCL-like segment mapped with its fd closed (the
engine core) and a multiprocessing semaphore (the API server, sem_open); a live bystander holds
its own `psm_keep`; a file nobody holds lies beside them. `systemctl start` of the unit (gpugate
on ExecStartPre=) removes the three and names them in the journal; the rest stays. A dry run
removes nothing and lists the three. A segment another unit attached to stays."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

import pytest
from incident import CONFIG, PYTHON, Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

GPUS = (0, 1, 2, 3)
PORT = 8000
UNIT = "vllm.service"
UNIT_CONFIG = "gpus = [0, 1, 2, 3]\n" + CONFIG
KEEP = "/dev/shm/psm_keep"
UNHELD = "/dev/shm/psm_unheld"
BYSTANDER = (
    "from multiprocessing import shared_memory; import time; "
    f"segment = shared_memory.SharedMemory({KEEP.rsplit('/', 1)[1]!r}, create=True, size=4096); "
    "open('/run/keep-ready', 'w').write('{}'); time.sleep(36000)"
)


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    h.reset()


@pytest.fixture
def stale(host: Host) -> Iterator[dict[str, Any]]:
    """The unit installed, the bystander and the unheld file in place, and the stale server."""
    host.reset()
    host.install(UNIT, unit_text(UNIT, GPUS, PORT), UNIT_CONFIG)
    host.sh(f"rm -f /run/keep-ready {KEEP}; head -c 8192 /dev/zero > {UNHELD}")
    host.sim.spawn_scope([PYTHON, "-c", BYSTANDER], unit="shm-bystander.scope")
    host.wait_ready("/run/keep-ready")
    pids, _ = host.hand_start(GPUS, PORT, "hand-shm", "--shm", "stale")
    assert len(pids["shm"]) == 3
    for path in pids["shm"]:
        assert host.sh(f"test -f {shlex.quote(path)} && echo yes", False).strip() == "yes", path
    yield pids
    host.sh(f"systemctl stop {UNIT} shm-bystander.scope 2>/dev/null", False)
    host.reset()
    host.sh(f"rm -f {KEEP} {UNHELD} " + " ".join(map(shlex.quote, pids["shm"])), False)


def exists(host: Host, path: str) -> bool:
    return host.sh(f"test -e {shlex.quote(path)} && echo yes", False).strip() == "yes"


def test_start_removes_the_stale_apps_segments_and_nothing_else(
    host: Host, stale: dict[str, Any]
) -> None:
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    host.wait_ready(f"/run/ready-{UNIT}.json")
    assert host.sim.systemctl("is-active", UNIT, check=False).stdout.strip() == "active"
    for path in stale["shm"]:
        assert not exists(host, path), f"{path} of the killed application is still there"
    assert exists(host, KEEP), "the bystander's segment was removed"
    assert exists(host, UNHELD), "a file nobody held was removed"
    removed = host.events_after(cursor, GPUGATE_EVENT="shm_removed", GPUGATE_PHASE="pre")
    assert {e["GPUGATE_SHM_PATH"] for e in removed} == set(stale["shm"])
    for entry in removed:
        assert int(entry["GPUGATE_SHM_BYTES"]) > 0
        assert "GPUGATE_DRY_RUN" not in entry
    status = host.status()
    assert status["shm"] and status["shm"][0]["path"] == "/dev/shm"


def test_dry_run_removes_nothing_and_lists_the_three(host: Host, stale: dict[str, Any]) -> None:
    result = host.sim.run(["gpugate", "pre", "--dry-run", UNIT], check=False, timeout=120)

    assert result.returncode == 0, result.stdout + result.stderr
    for path in stale["shm"]:
        assert exists(host, path)
        assert repr(path) in result.stdout, result.stdout  # listed, and left in place
    assert KEEP not in result.stdout and UNHELD not in result.stdout
    assert all(host.alive(pid) for pid in (stale["api_server"], *stale["workers"]))


def test_a_segment_another_unit_attached_to_stays(host: Host, stale: dict[str, Any]) -> None:
    shared = stale["shm"][0]  # worker 0's segment, open and mapped
    attach = (
        f"import os, time; fd = os.open({shared!r}, os.O_RDONLY); "
        "open('/run/peer-ready', 'w').write('{}'); time.sleep(36000)"
    )
    host.sh("rm -f /run/peer-ready")
    host.sim.install_unit(
        "shm-peer.service", f"[Service]\nExecStart={PYTHON} -c {shlex.quote(attach)}\n"
    )
    host.sim.systemctl("start", "shm-peer.service")
    try:
        host.wait_ready("/run/peer-ready")
        cursor = host.cursor()

        assert host.start(UNIT, check=False) == 0

        assert exists(host, shared), "a segment another unit holds was removed"
        for path in stale["shm"][1:]:
            assert not exists(host, path), path
        (kept,) = host.events_after(cursor, GPUGATE_EVENT="shm_kept", GPUGATE_PHASE="pre")
        assert kept["GPUGATE_SHM_PATH"] == shared
        assert kept["GPUGATE_REASON"] == "shm-also-held", kept
        assert "shm-peer.service" in kept["GPUGATE_SHM_KEPT"], kept["GPUGATE_SHM_KEPT"]
        removed = host.events_after(cursor, GPUGATE_EVENT="shm_removed", GPUGATE_PHASE="pre")
        assert {e["GPUGATE_SHM_PATH"] for e in removed} == set(stale["shm"][1:])
    finally:
        host.sh("systemctl stop shm-peer.service", False)
