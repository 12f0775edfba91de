"""What an ordinary account on the GPU host can no longer make root do (issue 26, rules 3-5), on
the simulated GPU host (real systemd 252, the stand-in driver), with the account's own user
manager (`loginctl enable-linger`) and, for (e), Debian's sudo installed inside it only:

(c) a stale server of the account's, in its user manager, holds root's 0600
    /dev/shm/root-cache through O_PATH and its own segment open: `systemctl start` of the unit
    kills it; root's file stays (`shm-path-only`), the account's own segment goes;
(d) `systemd-run --user --unit=nvidia-persistenced` holding the unit's GPUs is killed as that
    account's stale server, while the system's nvidia-persistenced.service lives;
(e) with a sudoers rule for `gpugate run` only, alice's `sudo gpugate run --gpus 0 -- ...` onto
    GPU 0, which bob's live server holds: refused with exit 22 and one line naming it, bob's
    server lives, nothing started;
(f) bob's `sudo gpugate run --gpus 3` leases GPU 3: alice's `sudo gpugate run --gpus 3 --force`
    is refused with exit 77 and one line, nothing started; root's `--force` still runs.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator

import pytest
from incident import CONFIG, Host, prepare, unit_text
from realparts import install_debs, wait_for
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

UNIT = "vllm.service"
WORK = "/run/u26"
# Holds /dev/nvidiaN (and claims MIB on each with the stand-in NVML), the files its arguments
# name (path:FILE through O_PATH, rw:FILE open for reading and writing), then says so.
HOLD = """
import os, sys, time
ready, mib, gpus, specs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
held = [os.open(f"/dev/nvidia{g}", os.O_RDONLY) for g in gpus.split(",")]
for spec in specs:
    kind, _, path = spec.partition(":")
    held.append(os.open(path, os.O_PATH if kind == "path" else os.O_RDWR))
if int(mib):
    start = open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19]
    with open(f"/run/fake-nvml/claims/{os.getpid()}.tmp", "w") as claim:
        claim.write(f"{mib} {start} {gpus}\\n")
    os.rename(f"/run/fake-nvml/claims/{os.getpid()}.tmp", f"/run/fake-nvml/claims/{os.getpid()}")
with open(ready + ".tmp", "w") as out:
    out.write(str(os.getpid()))
os.rename(ready + ".tmp", ready)
time.sleep(36000)
"""


class Accounts:
    def __init__(self, host: Host) -> None:
        self.host = host

    def add(self, name: str) -> int:
        """An ordinary account with a user manager of its own (lingering)."""
        host = self.host
        host.sh(f"id {name} >/dev/null 2>&1 || useradd --create-home --shell /bin/sh {name}")
        uid = int(host.sh(f"id -u {name}").strip())
        host.sh(f"loginctl enable-linger {name}")
        wait_for(
            f"user@{uid}.service",
            lambda: host.sh(f"systemctl is-active user@{uid}.service", False).strip() == "active",
        )
        return uid

    def user_run(self, name: str, unit: str, *args: str) -> int:
        """`systemd-run --user --unit=UNIT` as NAME: HOLD with ARGS; its PID once it holds."""
        host = self.host
        uid = int(host.sh(f"id -u {name}").strip())
        ready = f"{WORK}/ready-{name}-{unit}"
        host.sh(f"rm -f {ready}")
        argv = [
            "runuser", "-u", name, "--", "env", f"XDG_RUNTIME_DIR=/run/user/{uid}",
            "systemd-run", "--user", f"--unit={unit}", "--collect",
            "/usr/bin/python3", f"{WORK}/hold.py", ready, *args,
        ]  # fmt: skip
        host.sh(shlex.join(argv))
        return int(wait_for(f"{unit} of {name} holding", lambda: host.sh(f"cat {ready}", False)))


@pytest.fixture(scope="module")
def accounts(simhost: SimHost) -> Iterator[Accounts]:
    host = prepare(simhost)
    host.sh(f"mkdir -p {WORK} /run/fake-nvml/claims && chmod 1777 {WORK} /run/fake-nvml/claims")
    host.sim.write_file(f"{WORK}/hold.py", HOLD, mode=0o755)
    yield Accounts(host)
    host.reset()


def exists(host: Host, path: str) -> bool:
    return host.sh(f"test -e {shlex.quote(path)} && echo yes", False).strip() == "yes"


def test_c_roots_file_held_through_o_path_stays(accounts: Accounts) -> None:
    host = accounts.host
    host.reset()
    accounts.add("carol")
    host.install(UNIT, unit_text(UNIT, (0,), 8000), "gpus = [0]\n" + CONFIG)
    host.sh("head -c 4096 /dev/zero > /dev/shm/root-cache && chmod 0600 /dev/shm/root-cache")
    own = "/dev/shm/psm_carol"
    host.sh(f"runuser -u carol -- sh -c 'head -c 4096 /dev/zero > {own}'")
    stale = accounts.user_run(
        "carol", "stale-vllm", "20000", "0", "path:/dev/shm/root-cache", f"rw:{own}"
    )
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert not host.alive(stale)
    assert exists(host, "/dev/shm/root-cache"), "root's file was removed"
    assert not exists(host, own), "the killed account's own segment stayed"
    (kept,) = host.events_after(cursor, GPUGATE_EVENT="shm_kept", GPUGATE_PHASE="pre")
    assert (kept["GPUGATE_SHM_PATH"], kept["GPUGATE_REASON"]) == (
        "/dev/shm/root-cache",
        "shm-path-only",
    )
    removed = host.events_after(cursor, GPUGATE_EVENT="shm_removed", GPUGATE_PHASE="pre")
    assert [e["GPUGATE_SHM_PATH"] for e in removed] == [own]
    host.sh(f"systemctl stop {UNIT}; rm -f /dev/shm/root-cache", False)


def test_d_a_user_unit_named_nvidia_persistenced_is_killed(accounts: Accounts) -> None:
    host = accounts.host
    host.reset()
    uid = accounts.add("dave")
    # The system's own, staged by incident.stage_incident: it holds every device file.
    daemon = int(host.sh("systemctl show -p MainPID --value nvidia-persistenced.service"))
    assert daemon > 0 and host.alive(daemon)
    host.install(UNIT, unit_text(UNIT, (0,), 8000), "gpus = [0]\n" + CONFIG)
    stale = accounts.user_run("dave", "nvidia-persistenced", "20000", "0")
    cgroup = host.sh(f"cat /proc/{stale}/cgroup").strip()
    assert cgroup.endswith(f"user@{uid}.service/app.slice/nvidia-persistenced.service"), cgroup
    cursor = host.cursor()

    assert host.start(UNIT, check=False) == 0

    assert not host.alive(stale), "the user unit was spared by its name"
    assert host.alive(daemon)
    active = host.sim.systemctl("is-active", "nvidia-persistenced.service", check=False)
    assert active.stdout.strip() == "active"
    found = host.events_after(cursor, GPUGATE_EVENT="holder_found", GPUGATE_PHASE="pre")
    assert {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in found}.get(str(stale)) == "orphan"
    spared = host.events_after(cursor, GPUGATE_EVENT="process_spared", GPUGATE_PHASE="pre")
    assert any(e["GPUGATE_PID"] == str(daemon) for e in spared)
    host.sh(f"systemctl stop {UNIT}", False)


def test_e_sudo_gpugate_run_refuses_another_accounts_server(accounts: Accounts) -> None:
    host = accounts.host
    host.reset()
    install_debs(host.sim, "sudo", ["sudo"])
    accounts.add("alice")
    accounts.add("bob")
    host.sim.write_file(
        "/etc/sudoers.d/gpugate-run", "alice ALL=(root) NOPASSWD: /usr/bin/gpugate run *\n", 0o440
    )
    host.sh("visudo -c")
    # sudo resolves the host's name (and says so on stderr where it cannot)
    host.sh('grep -qw "$(hostname)" /etc/hosts || echo "127.0.1.1 $(hostname)" >> /etc/hosts')
    bobs = accounts.user_run("bob", "bobs-server", "20000", "0")
    before = json.dumps(host.status()["gpus"][0])

    for argv in (
        "sudo -n /usr/bin/gpugate run --gpus 0 -- /bin/sleep 30",
        # sudo sets SUDO_UID itself: what alice exports changes nothing
        "env SUDO_UID=0 SUDO_USER=root sudo -n /usr/bin/gpugate run --gpus 0 -- /bin/sleep 30",
    ):
        result = host.sim.run(["runuser", "-u", "alice", "--", "sh", "-c", argv], check=False)

        assert result.returncode == 22, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"PID {bobs}" in lines[0], lines
        assert host.alive(bobs)
    assert json.dumps(host.status()["gpus"][0]) == before
    units = host.sh("systemctl list-units --all --plain --no-legend 'gpugate-run-*'", False)
    assert not units.strip(), units
    # sudo -n with a command the rule does not allow: sudo itself refuses
    denied = host.sim.run(
        ["runuser", "-u", "alice", "--", "sudo", "-n", "/usr/bin/gpugate", "pre", UNIT],
        check=False,
    )
    assert denied.returncode != 0 and host.alive(bobs)


def test_f_sudo_gpugate_run_force_over_another_accounts_lease_is_refused(
    accounts: Accounts,
) -> None:
    """Issue 34, rule 5: bob's `sudo gpugate run --gpus 3` holds a lease on GPU 3; alice's
    `sudo gpugate run --gpus 3 --force` (a sudoers rule for `gpugate run` only) is refused
    with exit 77 and one line naming bob's run, nothing started; root may still force."""
    host = accounts.host
    host.reset()
    install_debs(host.sim, "sudo", ["sudo"])
    accounts.add("alice")
    accounts.add("bob")
    host.sim.write_file(
        "/etc/sudoers.d/gpugate-run",
        "alice,bob ALL=(root) NOPASSWD: /usr/bin/gpugate run *\n",
        0o440,
    )
    host.sh("visudo -c")
    host.sh('grep -qw "$(hostname)" /etc/hosts || echo "127.0.1.1 $(hostname)" >> /etc/hosts')
    # bob's run, started from a unit of bob's of its own (pipe mode): it leases GPU 3
    host.sh(
        "systemd-run --unit=bobs-shell --collect -p User=bob -- sudo -n /usr/bin/gpugate run "
        "--name bobs-run --gpus 3 -- /bin/sleep 3600"
    )
    lease = "/run/gpugate/leases/bobs-run.service.json"
    wait_for("bob's lease", lambda: exists(host, lease))
    wait_for(
        "bob's run active",
        lambda: host.sh("systemctl is-active bobs-run.service", False).strip() == "active",
    )
    before = host.sh(f"cat {lease}")

    argv = "sudo -n /usr/bin/gpugate run --gpus 3 --force -- /bin/sleep 30"
    result = host.sim.run(["runuser", "-u", "alice", "--", "sh", "-c", argv], check=False)
    assert result.returncode == 77, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bobs-run.service" in lines[0], lines
    units = host.sh("systemctl list-units --all --plain --no-legend 'gpugate-run-*'", False)
    assert not units.strip(), units
    assert host.sh(f"cat {lease}") == before
    assert host.sim.systemctl("is-active", "bobs-run.service", check=False).stdout.strip() == (
        "active"
    )

    # root may still force (bob's sleep holds no GPU: nothing of bob's is killed)
    forced = host.sim.run(
        ["/usr/bin/gpugate", "run", "--gpus", "3", "--force", "--", "/bin/true"], check=False
    )
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert host.sim.systemctl("is-active", "bobs-run.service", check=False).stdout.strip() == (
        "active"
    )
    host.sh("systemctl stop bobs-shell.service bobs-run.service", False)
