"""What an operator sees of gpugate through systemd: `systemctl status` names each failure's
exit code truly, and `journalctl -t gpugate` finds every entry of a run, each error once."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
from incident import PYTHON, Host, prepare
from sandbox import SimHost

from gpugate.errors import SYSEXITS_NAMES, ExitCode

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

FAST = (
    "[pre]\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\nwait_timeout_s = 2\n"
    "[post]\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\nwait_timeout_s = 2\n"
)
BROKEN_DRIVER = "/etc/fake-nvml-not-loaded.conf"
LEASES = "/run/gpugate/leases"
# A unit whose start succeeds holds a lease on its GPUs until its post releases it.
POST = "ExecStopPost=/usr/bin/gpugate post %n\n"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    simhost.write_file(BROKEN_DRIVER, "gpu_count = 8\ninit_error = 9\n")
    yield h
    h.sh("systemctl stop 'gate-*.service' 'hold-*.service' 'hold-*.scope' 2>/dev/null", False)
    # A test that failed before its unit's stop leaves that unit's lease: the simulated host
    # is shared with the next module (test_shared_host checks the lease folder is empty).
    h.sh(f"rm -f {LEASES}/gate-*.service.json", False)
    h.reset()


def gate_unit(
    host: Host,
    name: str,
    pre: str = "/usr/bin/gpugate pre %n",
    *,
    config: str = FAST,
    extra: str = "",
) -> None:
    host.sim.install_unit(
        name,
        f"[Service]\nType=simple\nExecStartPre={pre}\nExecStart=/bin/sleep infinity\n"
        f"NotifyAccess=exec\nTimeoutStartSec=60\n{extra}",
    )
    host.sim.write_file(f"/etc/gpugate/{name}.toml", config)


def holder_unit(host: Host, name: str, gpu: int) -> None:
    """Another service holding GPU `gpu` (a device fd and NVML memory), without gpugate."""
    host.sim.install_unit(
        name,
        "[Service]\nType=simple\n"
        f"ExecStart={PYTHON} /opt/fakevllm/fake_vllm.py --gpus {gpu} --port 8300 --mib 1000 "
        f"--ready-file /run/ready-{name}.json\n",
    )
    host.sh(f"rm -f /run/ready-{name}.json")
    host.sim.systemctl("start", name)
    host.wait_ready(f"/run/ready-{name}.json")


def status_lines(host: Host, name: str) -> tuple[str, str]:
    """`systemctl status`: its Process: line for the hook, and the line systemd logged."""
    text = host.sh(f"SYSTEMD_COLORS=0 systemctl status --no-pager -n 20 {name}", check=False)
    (process,) = [ln for ln in text.splitlines() if "ExecStartPre=" in ln]
    logged = [ln for ln in text.splitlines() if "Control process exited" in ln]
    return process, logged[-1] if logged else ""


def start_fails(host: Host, name: str) -> None:
    assert host.sim.systemctl("start", name, check=False).returncode != 0


def test_systemctl_status_names_each_failure_truly(host: Host) -> None:
    """Each failure kind a unit's start can meet, and the label systemd prints for it."""
    kinds: dict[str, ExitCode] = {}

    gate_unit(host, "gate-config.service", config="free_mib = 0\n")
    kinds["gate-config.service"] = ExitCode.CONFIG

    gate_unit(host, "gate-usage.service", "/usr/bin/gpugate pre %n --no-such-option")
    kinds["gate-usage.service"] = ExitCode.USAGE

    gate_unit(host, "gate-unit.service", "/usr/bin/gpugate pre not-a-service.timer")
    kinds["gate-unit.service"] = ExitCode.UNKNOWN_UNIT

    gate_unit(host, "gate-nvml.service", extra=f"Environment=FAKE_NVML_CONFIG={BROKEN_DRIVER}\n")
    kinds["gate-nvml.service"] = ExitCode.NVML_UNAVAILABLE

    # Not root and no "+": the lock folder cannot be made. A lock_dir of its own only through
    # --config outside /etc/gpugate (rule 4: the lookup's files share the host's).
    host.sim.write_file(
        "/etc/gpugate-perm.toml", 'gpus = [4]\nlock_dir = "/run/gpugate-perm/locks"\n' + FAST
    )
    gate_unit(
        host,
        "gate-perm.service",
        "/usr/bin/gpugate pre --config /etc/gpugate-perm.toml %n",
        extra="User=nobody\n",
    )
    host.sh("mkdir -p /run/gpugate-perm && chmod 0755 /run/gpugate-perm")
    kinds["gate-perm.service"] = ExitCode.PERMISSION

    holder_unit(host, "hold-other.service", 5)
    gate_unit(host, "gate-others.service", config="gpus = [5]\n" + FAST)
    kinds["gate-others.service"] = ExitCode.HELD_BY_OTHERS

    host.sh("mkdir -p /run/fake-nvml/leak && echo 50000 > /run/fake-nvml/leak/3")
    gate_unit(host, "gate-leak.service", config="gpus = [3]\n" + FAST)
    kinds["gate-leak.service"] = ExitCode.MEMORY_TIMEOUT

    gpu2 = next(g for g in host.status()["gpus"] if g["index"] == 2)["uuid"]
    host.sh("mkdir -p /run/gpugate")
    host.sim.spawn_scope(
        ["flock", f"/run/gpugate/{gpu2}.lock", "sleep", "600"], unit="hold-lock.scope"
    )
    gate_unit(host, "gate-lock.service", config="gpus = [2]\n" + FAST)
    kinds["gate-lock.service"] = ExitCode.LOCK_TIMEOUT

    try:
        for name, code in kinds.items():
            start_fails(host, name)
            process, logged = status_lines(host, name)
            said = host.sh(f"journalctl --no-pager -o cat -u {name} -n 8", check=False)
            assert f"(code=exited, status={int(code)})" in process, (name, process, said)
            assert logged.endswith(f"code=exited, status={code.systemd_label}"), (name, logged)
            assert code.systemd_label.split("/", 1)[1] in {"n/a", *SYSEXITS_NAMES.values()}
    finally:
        host.sh(
            "systemctl stop hold-other.service hold-lock.scope; rm -f /run/fake-nvml/leak/*",
            check=False,
        )
    gate_unit(host, "gate-ok.service", config="gpus = [4]\n" + FAST, extra=POST)
    host.sim.systemctl("start", "gate-ok.service")
    assert "(code=exited, status=0/SUCCESS)" in status_lines(host, "gate-ok.service")[0]
    shown = host.sh("systemctl show -p StatusText --value gate-ok.service").strip()
    assert shown == "", f"a running service still shows gpugate's words: {shown!r}"
    stop_releases_lease(host, "gate-ok.service")


def stop_releases_lease(host: Host, name: str) -> None:
    """The unit held a lease while it ran; its stop (the post hook) releases it."""
    assert host.sim.exists(f"{LEASES}/{name}.json"), f"{name} took no lease"
    host.sim.systemctl("stop", name)
    assert not host.sim.exists(f"{LEASES}/{name}.json"), f"{name}'s post left its lease"


def unit_entries(host: Host, cursor: str, name: str) -> list[dict[str, Any]]:
    """Every journal entry written by a process of the unit after the cursor."""
    return [
        e for e in host.journal_json(f"--after-cursor={cursor}") if e.get("_SYSTEMD_UNIT") == name
    ]


def tagged_cursors(host: Host) -> set[str]:
    return {e["__CURSOR"] for e in host.journal_json("-t", "gpugate")}


@pytest.mark.parametrize(
    ("name", "config", "extra", "error"),
    [
        # an error before the run's reporter exists: stderr alone, captured by journald
        ("gate-j-config.service", "free_mib = 0\n", "", "free_mib: Input should be"),
        # an error inside the run: the structured entry alone (stderr is the journal)
        (
            "gate-j-nvml.service",
            FAST,
            f"Environment=FAKE_NVML_CONFIG={BROKEN_DRIVER}\n",
            "NVML: the NVIDIA kernel driver is not loaded",
        ),
    ],
)
def test_journal_tag_finds_every_entry_each_error_once(
    host: Host, name: str, config: str, extra: str, error: str
) -> None:
    gate_unit(host, name, config=config, extra=extra)
    cursor = host.cursor()
    start_fails(host, name)
    # journald's stream entries may come in after the unit failed: `journalctl --sync` returns
    # once journald has handled all it had been sent (it takes the request at a lower priority
    # than its sockets), a handshake with journald itself.
    host.sh("journalctl --sync")
    entries = unit_entries(host, cursor, name)
    assert entries, "gpugate wrote nothing to the journal"
    assert {e.get("SYSLOG_IDENTIFIER") for e in entries} == {"gpugate"}, entries
    assert {e["__CURSOR"] for e in entries} <= tagged_cursors(host)
    said = [e for e in entries if error in e["MESSAGE"]]
    assert len(said) == 1, json.dumps(said, indent=1)
    for entry in entries:
        if "CODE_FILE" in entry:  # structured entries: the real call site, never report.py
            assert "/gpugate/" in entry["CODE_FILE"] and not entry["CODE_FILE"].endswith(
                "report.py"
            )
            assert int(entry["CODE_LINE"]) > 0 and entry["CODE_FUNC"]


def test_journal_tag_lists_a_successful_run_whole(host: Host) -> None:
    # Room for the 1.5 s release on a loaded machine: this run must succeed.
    roomy = FAST.replace("wait_timeout_s = 2", "wait_timeout_s = 20")
    gate_unit(host, "gate-j-ok.service", config="gpus = [6]\n" + roomy, extra=POST)
    host.sh(
        f"systemd-run --quiet --scope --slice=user.slice --unit=hold-j.scope setsid {shlex.quote(PYTHON)} /opt/fakevllm/fake_vllm.py --gpus 6 --port 8400 --mib 5000 --ready-file /run/ready-hold-j.json >/dev/null 2>&1 &"
    )
    host.wait_ready("/run/ready-hold-j.json")
    cursor = host.cursor()
    host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 1500/' /etc/fake-nvml.conf")
    try:
        host.sim.systemctl("start", "gate-j-ok.service")
    finally:
        host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 0/' /etc/fake-nvml.conf")
    entries = unit_entries(host, cursor, "gate-j-ok.service")
    events = [e.get("GPUGATE_EVENT") for e in entries]
    assert events[0] == "run_started" and events[-1] == "run_finished", events
    assert "signal_sent" in events and "memory_freed" in events
    (waiting, *_) = [e for e in entries if e.get("GPUGATE_EVENT") == "waiting"]
    assert waiting["GPUGATE_WAITING_FOR"] == "memory" and waiting["GPUGATE_GPU"] == "6"
    assert int(waiting["GPUGATE_USED_MIB"]) > 0 and "GPUGATE_SECONDS_LEFT" in waiting
    assert {e["SYSLOG_IDENTIFIER"] for e in entries} == {"gpugate"}
    assert {e["__CURSOR"] for e in entries} <= tagged_cursors(host)
    stop_releases_lease(host, "gate-j-ok.service")


def test_unit_names_as_systemctl_reads_them(host: Host) -> None:
    nosuch = host.sim.run(["gpugate", "install", "nosuch", "--no-reload"], check=False)
    assert nosuch.returncode == ExitCode.UNKNOWN_UNIT
    assert "nosuch.service" in nosuch.stderr
    assert nosuch.stderr.count("\n") == 1
    assert not host.sim.exists("/etc/systemd/system/nosuch.service.d/gpugate.conf")
    forced = host.sim.run(["gpugate", "install", "nosuch", "--force", "--no-reload"], check=False)
    assert forced.returncode == 0, forced.stderr
    assert host.sim.exists("/etc/systemd/system/nosuch.service.d/gpugate.conf")
    host.sim.run(["gpugate", "uninstall", "nosuch", "--no-reload"])
    gate_unit(host, "gate-name.service", config="gpus = [4]\n" + FAST)
    shown = json.loads(host.sh("gpugate status gate-name --json"))
    assert shown["unit"] == "gate-name.service"
    newline = host.sim.run(["gpugate", "status", "gate-name.service\n"], check=False)
    assert newline.returncode == ExitCode.UNKNOWN_UNIT


def test_status_into_a_closed_pipe_ends_quietly(host: Host) -> None:
    # --watch writes again after `head` has gone: the second draw meets the closed pipe.
    result = host.sim.run(
        ["bash", "-c", "gpugate status --watch | head -c 10 >/dev/null; echo ${PIPESTATUS[0]}"],
        timeout=60,
    )
    assert result.stdout.strip() == "0" and result.stderr == "", result.stderr
