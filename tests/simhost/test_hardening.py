"""A root hook the unit cannot steer, and its own state checked before it acts, on the simulated
GPU host (real systemd 252, the stand-in driver): issue 18's scenarios (a) and (e).

(a) a `User=` unit whose `EnvironmentFile=` belongs to its service account sets
    GPUGATE_CGROUP_ROOT (and the other two roots) to a fake tree listing another unit's main PID
    and puts its own systemctl, docker, podman and scontrol first on PATH: the other unit
    survives, no planted program runs, and `gpugate install` names the writable file;
(e) `lock_dir` on a full tmpfs: the start fails with 73 and one line naming the folder and
    "No space", nothing is killed, and the start succeeds once space is freed; full again,
    the stop's post succeeds, removes the lease and warns (issue 34, rule 6).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from incident import Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

ACCOUNT = "mlteam"
ENV_FILE = "/etc/vllm-steer/vllm.env"
PLANTED_BIN = f"/srv/{ACCOUNT}/bin"
FAKE_TREE = f"/srv/{ACCOUNT}/cgroup"
PLANTED = ("systemctl", "docker", "podman", "scontrol", "nvidia-smi")
FAST = "[pre]\nsigterm_grace_s = 1\nwait_timeout_s = 10\n[post]\nsigterm_grace_s = 1\n"
LOCKS = "/run/gpulocks"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    h.sh(
        "systemctl stop vllm-steer.service victim.service vllm-full.service 2>/dev/null; "
        f"systemctl reset-failed 2>/dev/null; umount {LOCKS} 2>/dev/null",
        check=False,
    )
    h.reset()


def main_pid(host: Host, unit: str) -> int:
    return int(host.sh(f"systemctl show -p MainPID --value {unit}").strip())


def test_a_unit_environment_cannot_steer_root(host: Host) -> None:
    host.reset()
    host.sh(f"id {ACCOUNT} >/dev/null 2>&1 || useradd --system --no-create-home {ACCOUNT}")
    # Another unit, not gpugate's: its main PID is what the fake tree hands over.
    host.sim.install_unit("victim.service", "[Service]\nExecStart=/bin/sleep infinity\n")
    host.sim.systemctl("start", "victim.service")
    victim = main_pid(host, "victim.service")
    assert host.alive(victim)

    # What the service account can do with a file of its own: roots and a PATH of its making.
    unit = "vllm-steer.service"
    host.sh(f"rm -f /run/planted-*; mkdir -p {PLANTED_BIN} {FAKE_TREE}/system.slice/{unit}")
    for name in PLANTED:
        host.sim.write_file(
            f"{PLANTED_BIN}/{name}",
            f'#!/bin/sh\ntouch /run/planted-{name}\nexec /usr/bin/{name} "$@"\n',
            mode=0o755,
        )
    host.sim.write_file(f"{FAKE_TREE}/system.slice/{unit}/cgroup.procs", f"{victim}\n")
    host.sim.write_file(
        ENV_FILE,
        f"GPUGATE_CGROUP_ROOT={FAKE_TREE}\nGPUGATE_PROC_ROOT=/proc\nGPUGATE_DEV_ROOT=/dev\n"
        f"PATH={PLANTED_BIN}:/usr/sbin:/usr/bin:/sbin:/bin\nCUDA_VISIBLE_DEVICES=0\n",
        mode=0o644,
    )
    host.sh(f"chown -R {ACCOUNT} /srv/{ACCOUNT} {ENV_FILE}")
    host.sim.install_unit(
        unit,
        f"[Service]\nType=simple\nUser={ACCOUNT}\nEnvironmentFile={ENV_FILE}\n"
        "ExecStart=/bin/sleep infinity\nTimeoutStartSec=60\n",
    )

    installed = host.sim.run(["gpugate", "install", unit, "--gpus", "0"], check=False)
    assert installed.returncode == 0, installed.stderr
    warned = [ln for ln in installed.stderr.splitlines() if "EnvironmentFile=" in ln]
    assert len(warned) == 1, installed.stderr
    assert f"EnvironmentFile={ENV_FILE}" in warned[0]
    checked = host.sim.run(["gpugate", "config", "check", "--unit", unit], check=False)
    assert f"EnvironmentFile={ENV_FILE}" in checked.stderr, checked.stderr
    host.sim.write_file(f"/etc/gpugate/{unit}.toml", "gpus = [0]\n" + FAST)

    cursor = host.cursor()
    host.start(unit)
    host.sim.systemctl("stop", unit)

    assert host.alive(victim), "the other unit's main process was killed as the unit's"
    state = host.sim.systemctl("is-active", "victim.service", check=False).stdout.strip()
    assert state == "active"
    assert host.sh("ls /run/planted-* 2>/dev/null", check=False).strip() == "", (
        "a program from the unit's PATH ran as root"
    )
    entries = host.events_after(cursor, _SYSTEMD_UNIT=unit, GPUGATE_EVENT="signal_sent")
    assert entries == [], entries
    host.sim.systemctl("stop", "victim.service")

    # Made root's, the file is not named any more.
    host.sh(f"chown root:root {ENV_FILE}")
    again = host.sim.run(["gpugate", "config", "check", "--unit", unit], check=False)
    assert "EnvironmentFile=" not in again.stderr, again.stderr


def test_lock_dir_on_a_full_tmpfs(host: Host) -> None:
    host.reset()
    orphan, _ = host.hand_start((6,), 8060, "hand-full")
    unit = "vllm-full.service"
    # One lock_dir for the host (rule 4): default.toml's; the unit's file names the same.
    host.sim.write_file("/etc/gpugate/default.toml", f'lock_dir = "{LOCKS}"\n')
    host.install(
        unit,
        unit_text(unit, (6,), 8061),
        f'gpus = [6]\nlock_dir = "{LOCKS}"\n' + FAST,
    )
    host.sh(
        f"mkdir -p {LOCKS} && mount -t tmpfs -o size=64k tmpfs {LOCKS} && "
        f"(dd if=/dev/zero of={LOCKS}/filler bs=4k 2>/dev/null; true)"
    )
    try:
        cursor = host.cursor()
        assert host.start(unit, check=False) != 0
        shown = host.sh(f"SYSTEMD_COLORS=0 systemctl status --no-pager -n 0 {unit}", check=False)
        assert "status=73" in shown, shown  # systemd's line for the hook: exit 73
        logged = host.sh(f"journalctl --no-pager -o cat -u {unit}", check=False)
        assert "status=73/CANTCREAT" in logged, logged
        said = [
            e
            for e in host.events_after(cursor, _SYSTEMD_UNIT=unit, GPUGATE_PHASE="pre")
            if e.get("GPUGATE_EVENT") == "error"
        ]
        problems = [(e.get("GPUGATE_PROBLEM"), e.get("GPUGATE_EXIT_CODE")) for e in said]
        assert problems == [("state-os-error", "73")], said
        assert said[0]["MESSAGE"].startswith(f"{LOCKS}: "), said  # names the folder
        assert "status=70" not in logged  # never an internal error (exit 70)
        assert all(host.alive(pid) for pid in orphan["workers"]), "killed before the check"

        host.sh(f"rm -f {LOCKS}/filler; systemctl reset-failed {unit}")
        assert host.start(unit) == 0
        host.wait_ready(f"/run/ready-{unit}.json")
        assert not any(host.alive(pid) for pid in orphan["workers"])
        assert host.sh(f"ls {LOCKS}/leases", check=False).strip() == f"{unit}.json"

        # Full again, the stop's post goes on (issue 34, rule 6): it succeeds, the unit
        # ends inactive, not failed, its lease is removed (that needs no space), and the
        # journal says what it could not record.
        host.sh(f"(dd if=/dev/zero of={LOCKS}/filler bs=4k 2>/dev/null; true)")
        cursor = host.cursor()
        host.sim.systemctl("stop", unit)
        state = host.sh(f"systemctl is-active {unit}", check=False).strip()
        assert state == "inactive", state
        assert host.sh(f"ls {LOCKS}/leases", check=False).strip() == ""
        post = host.events_after(cursor, _SYSTEMD_UNIT=unit, GPUGATE_PHASE="post")
        warned = [e for e in post if e.get("GPUGATE_REASON") == "state-unwritable"]
        assert warned and warned[0].get("GPUGATE_PROBLEM") == "state-os-error", post
        assert [e for e in post if e.get("GPUGATE_EVENT") == "run_finished"], post
        assert not [e for e in post if e.get("GPUGATE_EVENT") == "error"], post
    finally:
        host.sh(
            f"systemctl stop {unit}; umount {LOCKS}; rm -f /etc/gpugate/default.toml", check=False
        )
