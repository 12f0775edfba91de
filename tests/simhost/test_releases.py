"""The .deb on the oldest and the newest Debian gpugate supports: the simulated host booted over
a root built by debootstrap (tests/simhost/roots.py) instead of this machine's Debian 12 root.

Debian 11 (bullseye): systemd 247, Python 3.9, glibc 2.31 — it stands for RHEL 9 (Python 3.9,
systemd 252) and Ubuntu 22.04 (3.10, 249). Debian 13 (trixie): systemd 257, Python 3.13 — it
stands for Ubuntu 24.04 (3.12, 255). On each, the .deb built in this session is installed with
the release's own apt (no network inside: every dependency must be in the root), put on a
vLLM-like unit with `gpugate install`, and the incident runs: a server started by hand on
GPUs 0-3 and another unit's job on GPUs 6-7; the unit starts, the stale server is gone, the
job lives; then SIGKILL of the unit's API server, and post frees the GPUs. And the unit's
own /dev/shm (issue 28, tests/simhost/test_own_shm.py): with install's defaults a server's
psm_* segments never reach the host's /dev/shm, the unit's TimeoutStopSec=3 is kept, and
`systemctl stop` after systemd's SIGKILL leaves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from incident import MIB_PER_GPU, SIGNAL_SENT_ID, Host, server_cmd, stage_incident, unit_text
from roots import SUITES, RootBuildError, debian_root, missing_tools
from sandbox import SimHost
from test_own_shm import STOP_TIMEOUT_S, own_shm_scenario, stage_bystanders, stage_server
from test_sweep import timer_cycle

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

INSIDE = "/var/cache/gpugate-deb"
UNIT_GPUS = (0, 1, 2, 3)
JOB_GPUS = (6, 7)


@pytest.fixture(scope="module", params=sorted(SUITES))
def release(
    request: pytest.FixtureRequest, built_deb: Path, fake_nvml_lib: Path | None
) -> Iterator[tuple[str, Host]]:
    """A host booted over SUITE's root with the .deb installed and the incident's workload."""
    suite: str = request.param
    if fake_nvml_lib is None:
        pytest.skip("the stand-in libnvidia-ml.so.1 could not be built (gcc missing?)")
    reason = missing_tools()
    if reason is not None:
        pytest.skip(reason)
    try:
        root = debian_root(suite)
    except RootBuildError as err:
        pytest.fail(f"could not build the {suite} root: {err}")
    sim = SimHost.boot(root=root, nvml_lib=fake_nvml_lib, gpus=8)
    try:
        assert not sim.exists("/usr/bin/gpugate")
        sim.write_file(f"{INSIDE}/{built_deb.name}", built_deb.read_bytes())
        installed = sim.run(
            f"cd {INSIDE} && apt-get install -y --no-install-recommends ./gpugate_*.deb",
            env={"DEBIAN_FRONTEND": "noninteractive"},
            timeout=300,
            check=False,
        )
        assert "Setting up gpugate" in installed.stdout, installed.stdout + installed.stderr
        yield suite, stage_incident(sim)
    finally:
        sim.poweroff()


def test_release_is_what_it_stands_for(release: tuple[str, Host]) -> None:
    suite, host = release
    systemd, python = SUITES[suite]
    assert host.sh("systemctl --version").split()[1] == systemd
    assert (
        host.sh("python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").strip()
        == python
    )
    # The launcher took the running Python's compiled parts: pydantic-core and systemd-python
    # import (the journal module is what gpugate sends its events with).
    assert host.sh("gpugate --version").strip() == "gpugate 0.1.0"
    abi = "cp3" + python.split(".")[1]
    probe = host.sh(
        "/usr/bin/python3 -I -c 'import sys; "
        f'sys.path[0:0] = ["/usr/lib/gpugate/{abi}", "/usr/lib/gpugate/common"]; '
        "import pydantic_core, systemd.journal, pydantic; "
        "print(pydantic_core.__file__, systemd.journal.__file__, pydantic.VERSION)'"
    ).split()
    assert probe[0].startswith(f"/usr/lib/gpugate/{abi}/pydantic_core/")
    assert probe[1].startswith(f"/usr/lib/gpugate/{abi}/systemd/")
    assert probe[2].startswith("2.")
    assert SIGNAL_SENT_ID in host.sh("journalctl --list-catalog")


def test_incident_on_release(release: tuple[str, Host]) -> None:
    _suite, host = release
    sim = host.sim
    # Another unit's job on GPUs 6-7, started by systemd: gpugate may not touch it.
    sim.install_unit("job-other.service", unit_text("job-other.service", JOB_GPUS, 8100))
    sim.systemctl("start", "job-other.service")
    job = host.wait_ready("/run/ready-job-other.service.json")
    # A server started by hand from a login on GPUs 0-3.
    old, shell = host.hand_start(UNIT_GPUS, 8000, "hand-vllm")
    used = host.used()
    assert all(used[i] == MIB_PER_GPU for i in (*UNIT_GPUS, *JOB_GPUS)), used

    # The operator's unit knows nothing of gpugate; `gpugate install` puts it on.
    sim.install_unit(
        "vllm.service",
        "[Unit]\nDescription=vLLM-like server\n[Service]\nType=simple\n"
        f"ExecStart={server_cmd(UNIT_GPUS, 8000, '/run/ready-vllm.service.json')}\n",
    )
    sim.run(["gpugate", "install", "vllm.service", "--gpus", "0,1,2,3"])
    cursor = host.cursor()
    assert host.start("vllm.service", check=False) == 0, sim.journal("-u", "vllm.service")
    new = host.wait_ready("/run/ready-vllm.service.json")
    for pid in [old["api_server"], old["engine_core"], *old["workers"]]:
        assert not host.alive(pid), f"old server process {pid} survived"
    assert host.alive(shell), "the login session's shell was killed"
    for pid in [job["api_server"], job["engine_core"], *job["workers"]]:
        assert host.alive(pid), f"the other unit's process {pid} was killed"
    assert "/system.slice/vllm.service" in host.sh(f"cat /proc/{new['api_server']}/cgroup")
    status = host.status()
    holders = {h["unit"] for h in status["holders"] if h["used_mib"]}
    assert holders == {"vllm.service", "job-other.service"}, status["holders"]
    kills = host.events_after(cursor, MESSAGE_ID=SIGNAL_SENT_ID)
    assert {int(e["GPUGATE_PID"]) for e in kills} >= set(old["workers"])
    assert not {int(e["GPUGATE_PID"]) for e in kills} & set(job["workers"])

    # SIGKILL of the API server: the workers outlive it; post must free the GPUs, after the
    # driver's late release.
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 2000/' /etc/fake-nvml.conf")
    cursor = host.cursor()
    host.sh(f"kill -9 {new['api_server']}")
    deadline = time.monotonic() + 60
    while sim.systemctl("is-active", "vllm.service", check=False).stdout.strip() not in (
        "inactive",
        "failed",
    ):
        assert time.monotonic() < deadline, "unit never stopped"
        time.sleep(0.1)
    if not host.free(UNIT_GPUS):  # say why: post's own lines and the unit's end
        raise AssertionError(
            f"GPUs {UNIT_GPUS} not free after the unit stopped: {host.used()}\n"
            + sim.journal("-u", "vllm.service", "-n", "40", "-o", "short-precise")
        )
    for pid in new["workers"]:
        assert not host.alive(pid), f"worker {pid} survived post"
    (finished,) = host.events_after(cursor, GPUGATE_EVENT="run_finished", GPUGATE_PHASE="post")
    assert finished["GPUGATE_RESULT"] == "success", finished
    assert float(finished["GPUGATE_SECONDS_WAIT"]) > 0.5, "post did not wait for the driver"
    used = host.used()
    assert all(used[i] == MIB_PER_GPU for i in JOB_GPUS), used
    assert sim.systemctl("is-active", "job-other.service", check=False).stdout.strip() == "active"


def test_own_dev_shm_on_release(release: tuple[str, Host]) -> None:
    suite, host = release
    stage_server(host)
    stage_bystanders(host)
    took = own_shm_scenario(host)
    print(f"{suite}: systemctl stop with TimeoutStopSec={STOP_TIMEOUT_S}: {took:.1f}s")  # -s


def test_sweep_timer_on_release(release: tuple[str, Host]) -> None:
    """The package's gpugate-sweep.timer on systemd 247 and 257: installed disabled, enabled
    by `gpugate install --sweep`, a sweep run by it, disabled by `uninstall --sweep`."""
    _, host = release
    timer_cycle(host, packaged=True)
