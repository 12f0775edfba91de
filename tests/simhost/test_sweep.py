"""`gpugate sweep` on the simulated GPU host (real systemd, the stand-in driver, the vLLM-like
workload), issue 36: a server started by hand on GPU 2 (no unit), a unit's server on GPUs 0-1,
nvidia-persistenced and a watcher holding every device file.

One sweep reports exactly the hand-started server's GPU holders as unowned (the others under
their owners); a second writes no new journal entry; with a lease on GPU 2 and reap_after_s
past, it is reported, not reaped; without the lease it is reaped (its whole tree, its /dev/shm
files) and GPU 2 is free, the others untouched. The timer: `gpugate install --sweep`, a sweep
run by it, `gpugate uninstall --sweep`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from incident import Host, prepare, server_cmd, unit_text
from sandbox import SimHost
from test_stale_apps import Login

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

UNIT = "vllm-sweep.service"
FAST = "[pre]\nsigterm_grace_s = 2\n[post]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"
SWEEP_CONFIG = "/etc/gpugate/sweep.toml"
STATE = "/run/gpugate/sweep.json"
LEASE = "/run/gpugate/leases/nvidia-persistenced.service.json"


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    yield h
    h.sh(
        f"systemctl stop {UNIT} hand-watcher.scope hand-monitor.scope 2>/dev/null; "
        f"rm -f {LEASE} /etc/gpugate/default.toml",
        check=False,
    )
    h.reset()


def sweep(host: Host) -> None:
    result = host.sim.run(["gpugate", "sweep", "--config", SWEEP_CONFIG], check=False, timeout=120)
    assert result.returncode == 0, result.stderr


def holders(host: Host) -> dict[int, dict[str, Any]]:
    out = host.sim.run(["gpugate", "status", "--json", "--config", SWEEP_CONFIG], timeout=60)
    return {h["pid"]: h for h in json.loads(out.stdout)["holders"]}


def backdate_state(host: Host, seconds: int) -> None:
    """As if the sweep had first seen them unowned `seconds` earlier."""
    script = (
        "import json,sys; p=sys.argv[1]; d=json.load(open(p)); "
        f"[e.update(since=e['since']-{seconds}) for e in d['unowned']]; "
        "open(p,'w').write(json.dumps(d))"
    )
    host.sim.run(["/usr/bin/python3", "-c", script, STATE])


def tree(host: Host, pid: int) -> set[int]:
    found, queue = {pid}, [pid]
    while queue:
        text = host.sh(f"cat /proc/{queue.pop()}/task/*/children 2>/dev/null", False)
        for child in map(int, text.split()):
            if child not in found:
                found.add(child)
                queue.append(child)
    return found


def test_sweep_reports_the_hand_started_server_and_reaps_it_only_unleased(host: Host) -> None:
    host.reset()
    host.sh(f"rm -f {STATE} {LEASE}")
    host.sim.write_file(SWEEP_CONFIG, "[sweep]\n")
    host.install(UNIT, unit_text(UNIT, (0, 1), 8101), FAST)
    host.start(UNIT)
    served = host.wait_ready(f"/run/ready-{UNIT}.json")
    devices = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
    redirects = " ".join(f"{3 + i}</dev/{name}" for i, name in enumerate(devices))
    host.sim.spawn_scope(["bash", "-c", f"exec {redirects} sleep 36002"], unit="hand-watcher.scope")
    hand, _shell = host.hand_start((2,), 8102, "hand-sweep", "--shm", "swp")
    hand_tree = tree(host, hand["api_server"])
    cursor = host.cursor()

    sweep(host)

    seen = host.events_after(cursor, GPUGATE_EVENT="unowned_seen")
    found = holders(host)
    on_gpu2 = {pid for pid, h in found.items() if pid in hand_tree and h["gpus"]}
    assert on_gpu2 and {int(e["GPUGATE_PID"]) for e in seen} == on_gpu2
    assert all(e["GPUGATE_UNIT"] == "gpugate-sweep.service" for e in seen)
    owners = {pid: h["owner"] for pid, h in found.items() if h["gpus"]}
    assert {pid for pid, owner in owners.items() if owner == "nobody"} == on_gpu2
    assert {owners[pid] for pid in served["workers"]} == {"unit"}
    assert sorted(set(owners.values())) == ["nobody", "protected", "unit", "watcher"]
    assert all(isinstance(found[pid]["unowned_s"], int) for pid in on_gpu2)

    cursor = host.cursor()
    sweep(host)
    assert host.events_after(cursor, GPUGATE_EVENT="unowned_seen") == []

    gpu2 = next(g for g in host.status()["gpus"] if g["index"] == 2)
    lease = {"unit": "nvidia-persistenced.service", "gpus": [2], "uuids": [gpu2["uuid"]]}
    lease.update({"share": False, "since": time.time(), "pid": 1})
    host.sim.write_file(LEASE, json.dumps(lease))
    host.sim.write_file(SWEEP_CONFIG, "[sweep]\nreap_after_s = 60\n")
    backdate_state(host, 600)
    cursor = host.cursor()
    sweep(host)
    assert all(host.alive(pid) for pid in hand_tree), "a leased GPU: reported, not reaped"
    assert host.events_after(cursor, GPUGATE_EVENT="signal_sent") == []

    host.sh(f"rm -f {LEASE}")
    cursor = host.cursor()
    sweep(host)
    killed = host.events_after(cursor, GPUGATE_EVENT="holder_found")
    assert {e["GPUGATE_REASON"] for e in killed} <= {"orphan", "app-tree"}
    assert not any(host.alive(pid) for pid in {hand["api_server"], *hand["workers"]})
    assert host.used()[2] == 0
    for path in hand["shm"]:
        assert not host.sim.exists(path)
    assert all(host.alive(pid) for pid in served["workers"])
    units = ("nvidia-persistenced.service", "hand-watcher.scope")
    assert host.sim.systemctl("is-active", *units).stdout.split() == ["active", "active"]
    cursor = host.cursor()
    sweep(host)
    gone = host.events_after(cursor, GPUGATE_EVENT="unowned_gone")
    assert {int(e["GPUGATE_PID"]) for e in gone} == on_gpu2
    host.sh(f"systemctl stop {UNIT} hand-watcher.scope hand-sweep.scope", check=False)


def test_the_timer_installs_runs_and_uninstalls(host: Host) -> None:
    timer_cycle(host, packaged=False)


def timer_cycle(host: Host, *, packaged: bool) -> None:
    """`gpugate install --sweep`: the timer enabled and listed, a sweep run by it; then
    `gpugate uninstall --sweep`: disabled and stopped. packaged: the package's unit files in
    /usr/lib/systemd/system, disabled until then, and none written to /etc; else install
    writes them to /etc/systemd/system and uninstall removes them."""
    written = "/etc/systemd/system/gpugate-sweep.timer"
    if packaged:
        for name in ("gpugate-sweep.service", "gpugate-sweep.timer"):
            assert host.sim.exists(f"/usr/lib/systemd/system/{name}"), name
        assert is_enabled(host) == "disabled", "the package leaves it off"
    host.sim.run(["gpugate", "install", "--sweep"], timeout=120)
    try:
        assert is_enabled(host) == "enabled"
        assert host.sim.exists(written) is not packaged
        listed = host.sim.systemctl("list-timers", "--all", "--no-pager", "gpugate-sweep.timer")
        assert "gpugate-sweep.service" in listed.stdout
        deadline = time.monotonic() + 90
        while host.sh("systemctl show -P ExecMainExitTimestampMonotonic gpugate-sweep.service")[
            :1
        ] in ("", "0"):
            assert time.monotonic() < deadline, "the timer did not run a sweep"
            time.sleep(0.5)
        result = host.sh("systemctl show -P Result gpugate-sweep.service").strip()
        assert result == "success"
    finally:
        host.sim.run(["gpugate", "uninstall", "--sweep"], timeout=120)
    assert is_enabled(host) in (("disabled",) if packaged else ("disabled", ""))
    assert not host.sim.exists(written)
    active = host.sim.systemctl("is-active", "gpugate-sweep.timer", check=False).stdout.strip()
    assert active in ("inactive", "unknown")


def is_enabled(host: Host) -> str:
    return host.sim.systemctl("is-enabled", "gpugate-sweep.timer", check=False).stdout.strip()


DEVICES = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
REAP = "[sweep]\nreap_after_s = 60\n[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 20\n"


def hold_devices(host: Host, unit: str, names: list[str]) -> int:
    """A process holding these device files open only (nvtop, nvitop --only N)."""
    redirects = " ".join(f"{3 + i}</dev/{name}" for i, name in enumerate(names))
    host.sim.spawn_scope(["bash", "-c", f"exec {redirects} sleep 36003"], unit=unit)
    return int(host.sh(f"cat /sys/fs/cgroup/user.slice/{unit}/cgroup.procs").split()[0])


def owners(host: Host) -> dict[int, str]:
    return {pid: h["owner"] for pid, h in holders(host).items() if h["gpus"]}


def test_watchers_stay_watchers_across_a_leak_and_a_late_free_and_nothing_without_memory_is_reaped(
    host: Host,
) -> None:
    host.reset()
    host.sh(f"rm -f {STATE} {LEASE}")
    host.sim.write_file(SWEEP_CONFIG, REAP)
    nvtop = hold_devices(host, "hand-watcher.scope", DEVICES)
    monitor = hold_devices(host, "hand-monitor.scope", ["nvidia4", "nvidiactl"])
    try:
        host.sim.write_file("/run/fake-nvml/leak/4", "30000\n")  # a driver leak, no process
        cursor = host.cursor()
        sweep(host)
        found = owners(host)
        assert found[nvtop] == "watcher" and found[monitor] == "watcher"
        backdate_state(host, 600)
        sweep(host)
        assert host.alive(nvtop) and host.alive(monitor)
        assert host.events_after(cursor, GPUGATE_EVENT="unowned_seen") == []
        assert host.events_after(cursor, GPUGATE_EVENT="signal_sent") == []

        # a late free: a server on GPU 2 killed (as a start's pre would), its memory still used
        host.sh("sed -i 's/^release_delay_ms.*/release_delay_ms = 600000/' /etc/fake-nvml.conf")
        hand, _shell = host.hand_start((2,), 8104, "hand-late")
        for pid in (hand["api_server"], *hand["workers"]):
            host.sh(f"kill -KILL {pid}", check=False)
        host.sh("systemctl stop hand-late.scope", check=False)
        assert host.used()[2] > 0
        cursor = host.cursor()
        sweep(host)
        found = owners(host)
        assert found[nvtop] == "watcher" and found[monitor] == "watcher"
        backdate_state(host, 600)
        sweep(host)
        assert host.alive(nvtop) and host.alive(monitor)
        assert host.events_after(cursor, GPUGATE_EVENT="unowned_seen") == []
        assert host.events_after(cursor, GPUGATE_EVENT="signal_sent") == []
    finally:
        host.sh("systemctl stop hand-watcher.scope hand-monitor.scope", check=False)
        host.reset()


def session_state(host: Host, session: str) -> str:
    return host.sh(f"loginctl show-session -P State {session} 2>/dev/null", False).strip()


def test_an_attended_sessions_server_lives_and_a_closed_ones_is_reaped(host: Host) -> None:
    host.reset()
    host.sh(f"rm -f {STATE} {LEASE}")
    host.sim.write_file(SWEEP_CONFIG, REAP)
    login = Login(host, "alice")
    try:
        ready = "/run/ready-alice.json"
        host.sh(f"rm -f {ready}")
        # started so that it outlives the login (nohup setsid), as a tmux server would
        login.type(f"nohup setsid {server_cmd((3,), 8105, ready)} >/dev/null 2>&1 &")
        served = host.wait_ready(ready)
        pids = {served["api_server"], *served["workers"]}
        assert session_state(host, login.session) in ("active", "online")
        cursor = host.cursor()
        sweep(host)
        found = owners(host)
        assert {found[pid] for pid in served["workers"]} == {"session"}
        assert host.events_after(cursor, GPUGATE_EVENT="unowned_seen") == []
        sweep(host)  # nothing of it in the state to backdate: never unowned
        assert all(host.alive(pid) for pid in pids)

        login.type("exit")  # logged out; the server stays in the session's scope
        deadline = time.monotonic() + 30
        while session_state(host, login.session) not in ("closing", ""):
            assert time.monotonic() < deadline, "the session did not close"
            time.sleep(0.2)
        cursor = host.cursor()
        sweep(host)
        found = owners(host)
        assert {found[pid] for pid in served["workers"]} == {"nobody"}
        seen = {
            int(e["GPUGATE_PID"]) for e in host.events_after(cursor, GPUGATE_EVENT="unowned_seen")
        }
        assert set(served["workers"]) <= seen
        backdate_state(host, 600)
        sweep(host)
        assert not any(host.alive(pid) for pid in served["workers"])
        assert host.used()[3] == 0
    finally:
        login.close()
        host.reset()


def test_a_wall_clock_step_of_an_hour_reaps_nothing(host: Host) -> None:
    """The sweep's wall clock stepped by +1 h (injected: the machine's clock is not touched)."""
    host.reset()
    host.sh(f"rm -f {STATE} {LEASE}")
    host.sim.write_file(SWEEP_CONFIG, REAP)
    hand, _shell = host.hand_start((5,), 8106, "hand-clock")
    try:
        sweep(host)
        interpreter = host.sh('head -1 "$(command -v gpugate)"').strip().lstrip("#!")
        stepped = (
            "import sys, time; real = time.time; time.time = lambda: real() + 3600; "
            "from gpugate.front.entry import run; "
            f"sys.argv = ['gpugate', 'sweep', '--config', '{SWEEP_CONFIG}']; run()"
        )
        cursor = host.cursor()
        result = host.sim.run([interpreter, "-c", stepped], check=False, timeout=120)
        assert result.returncode == 0, result.stderr
        assert all(host.alive(pid) for pid in (hand["api_server"], *hand["workers"]))
        assert host.events_after(cursor, GPUGATE_EVENT="signal_sent") == []
    finally:
        host.sh("systemctl stop hand-clock.scope", check=False)
        host.reset()


def gpugate_entries(host: Host, cursor: str) -> list[dict[str, Any]]:
    """The sweep service's entries after cursor, as `journalctl -t gpugate` lists them
    (matched here: journalctl 252 with --after-cursor skips the first match of a field)."""
    listed = {e["__CURSOR"] for e in host.journal_json("-t", "gpugate", "-n", "50")}
    return [
        e
        for e in host.journal_json(f"--after-cursor={cursor}")
        if e["__CURSOR"] in listed and e.get("GPUGATE_UNIT") == "gpugate-sweep.service"
    ]


def test_under_the_timers_service_config_errors_and_state_warnings_are_gpugates_entries(
    host: Host,
) -> None:
    host.reset()
    host.sim.run(["gpugate", "install", "--sweep"], timeout=120)
    try:
        host.sim.systemctl("stop", "gpugate-sweep.timer")
        host.sim.write_file("/etc/gpugate/default.toml", "[sweep]\nreap_after_s = 5\n")
        cursor = host.cursor()
        host.sim.systemctl("start", "gpugate-sweep.service", check=False)
        entries = gpugate_entries(host, cursor)
        errors = [e for e in entries if e.get("GPUGATE_EVENT") == "error"]
        assert len(errors) == 1
        assert errors[0]["GPUGATE_EXIT_CODE"] == "78"
        assert "sweep.reap_after_s" in errors[0]["MESSAGE"]
        assert errors[0]["MESSAGE_ID"] == "b7d2f9a4c1e34a5b8d6c0e3f9a7b2d23"
        said = [e for e in entries if "reap_after_s" in e.get("MESSAGE", "")]
        assert said == errors, "said once, as the structured entry"

        host.sh("rm -f /etc/gpugate/default.toml")
        host.sim.write_file(STATE, "not json\n", 0o600)
        cursor = host.cursor()
        host.sim.systemctl("start", "gpugate-sweep.service")
        warnings = [e for e in gpugate_entries(host, cursor) if e.get("GPUGATE_EVENT") == "warning"]
        assert [e["GPUGATE_REASON"] for e in warnings] == ["sweep-state-refused"]
        assert warnings[0]["MESSAGE_ID"] == "e4a9c6b2d8f14e3a9c5b7d1f0a6e2c34"
    finally:
        host.sh("rm -f /etc/gpugate/default.toml", check=False)
        host.sim.run(["gpugate", "uninstall", "--sweep"], timeout=120)
