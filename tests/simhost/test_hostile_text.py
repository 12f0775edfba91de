"""Issue 26 (a), on the simulated GPU host (real systemd 252, journald, the stand-in driver): what
processes say about themselves cannot end a run or write to the operator's terminal.

Two stale holders on the unit's GPUs, started by hand in a login scope: one whose command line
and comm are not UTF-8 (one byte 0xff), one whose command line clears the screen, sets the
window title, rings the bell and, after a newline, forges a line of gpugate's
("FAKE LINE gpugate: all GPUs free"). `gpugate status` (table and JSON) and `pre --dry-run`
show them escaped, one line each; `systemctl start` kills both and the unit starts; the
journal's MESSAGE carries no raw ESC, BEL or newline of theirs, while GPUGATE_COMMAND keeps
their exact bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from incident import Host, prepare, unit_text
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

UNIT = "vllm-hostile.service"
FORGED = "FAKE LINE gpugate: all GPUs free"
HOLDER = "/opt/hostile/holder.py"
FAST = "[pre]\nsigterm_grace_s = 1\nwait_timeout_s = 20\n[post]\nsigterm_grace_s = 1\n"
# A holder as a CUDA process is one: device files open, memory claimed from the stand-in
# driver (as tests/simhost/workload/fake_vllm.py's workers claim it), its comm from COMM.
HOLDER_SCRIPT = """\
import os, signal, sys
gpu = int(os.environ["GPU"])
fds = [os.open(f"/dev/{n}", os.O_RDONLY) for n in ("nvidiactl", "nvidia-uvm", f"nvidia{gpu}")]
with open("/proc/self/comm", "wb") as comm:
    comm.write(os.environb[b"COMM"])
with open(f"/proc/{os.getpid()}/stat", "rb") as stat:
    start = stat.read().rsplit(b")", 1)[1].split()[19].decode()
os.makedirs("/run/fake-nvml/claims", exist_ok=True)
with open(f"/run/fake-nvml/claims/{os.getpid()}", "w") as claim:
    claim.write(f"40000 {start} {gpu}\\n")
with open(os.environ["READY"], "w") as ready:
    ready.write(str(os.getpid()))
while True:
    signal.pause()
"""
# sh's printf makes the bytes inside the host: \\377 is 0xff; \\033 ESC; \\007 and \\a BEL.
NOT_UTF8 = "\"$(printf '\\377')\" serve"
ESCAPES = f"\"$(printf '\\033[2J\\033[H\\033]0;owned\\007\\a\\n{FORGED}')\" --port 8000"
RAW = ("\x1b", "\x07", "\ufffd")


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    h.sim.write_file(HOLDER, HOLDER_SCRIPT, mode=0o755)
    yield h
    h.sh(f"systemctl stop {UNIT} 'hostile-*.scope' 2>/dev/null; systemctl reset-failed", False)
    h.reset()


def start_holder(host: Host, name: str, gpu: int, args: str, comm: str) -> int:
    ready = f"/run/ready-{name}"
    host.sh(f"rm -f {ready}")
    host.sim.spawn_scope(
        f"GPU={gpu} READY={ready} COMM=\"$(printf '{comm}')\" exec /usr/bin/python3 {HOLDER} {args}",
        unit=f"{name}.scope",
    )
    text = ""
    for _ in range(300):
        text = host.sh(f"cat {ready} 2>/dev/null", check=False).strip()
        if text:
            break
        host.sh("sleep 0.1")
    assert text, f"{name} did not start"
    return int(text)


def no_raw(text: str) -> bool:
    return not any(mark in text for mark in RAW)


@pytest.mark.message
def test_hostile_process_text_cannot_end_a_run_or_forge_a_line(host: Host) -> None:
    host.reset()
    host.install(UNIT, unit_text(UNIT, (4, 5), 8070), "gpus = [4, 5]\n" + FAST)
    bad = start_holder(host, "hostile-bytes", 4, NOT_UTF8, "\\377worker")
    forger = start_holder(host, "hostile-escapes", 5, ESCAPES, "\\033]0;t\\007")
    assert host.alive(bad) and host.alive(forger)

    table = host.sim.run(["gpugate", "status"], check=False)
    assert table.returncode == 0, table.stderr
    assert no_raw(table.stdout + table.stderr), table.stdout
    rows = table.stdout.splitlines()
    assert not [row for row in rows if row.strip().startswith("FAKE LINE")], table.stdout
    assert any("\\xff serve" in row for row in rows), table.stdout
    assert any("\\x1b[2J\\x1b[H\\x1b]0;owned\\a\\a\\nFAKE LINE" in row for row in rows)

    data = json.loads(host.sim.run(["gpugate", "status", "--json"]).stdout)
    holders = {h["pid"]: h for h in data["holders"]}
    assert holders[bad]["command"][-2:] == ["\\xff", "serve"]
    assert holders[bad]["comm"] == "\\xffworker"
    assert holders[forger]["command"][-3].startswith("\\x1b[2J")

    dry = host.sim.run(["gpugate", "pre", "--dry-run", UNIT], check=False)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert no_raw(dry.stdout + dry.stderr), dry.stdout
    lines = dry.stdout.splitlines()
    assert lines and all(line.startswith(f"gpugate pre {UNIT}: ") for line in lines), lines
    assert sum(f"PID {bad} " in line and "would kill" in line for line in lines) == 1
    assert host.alive(bad) and host.alive(forger)

    cursor = host.cursor()
    assert host.start(UNIT, check=False) == 0, host.sh(f"journalctl -n 30 -u {UNIT}", False)
    host.wait_ready(f"/run/ready-{UNIT}.json")
    assert not host.alive(bad) and not host.alive(forger)
    assert host.sh(f"systemctl is-active {UNIT}", check=False).strip() == "active"

    entries = host.events_after(cursor, GPUGATE_UNIT=UNIT)
    assert entries
    for entry in entries:
        message = entry["MESSAGE"]
        # journalctl -o json gives a field that is not printable UTF-8 as a list of bytes.
        assert isinstance(message, str), entry
        assert no_raw(message) and "\n" not in message, message
    signals = [e for e in entries if e.get("GPUGATE_EVENT") == "signal_sent"]
    by_pid = {int(e["GPUGATE_PID"]): e for e in signals}
    assert set(by_pid) >= {bad, forger}
    # The structured field keeps the very bytes: 0xff is there, as the journal's byte list.
    command = by_pid[bad]["GPUGATE_COMMAND"]
    assert isinstance(command, list) and 0xFF in command, command
    escaped = by_pid[forger]["GPUGATE_COMMAND"]
    raw = bytes(escaped) if isinstance(escaped, list) else escaped.encode()
    assert b"\x1b[2J" in raw and FORGED.encode() in raw
    status = host.sh(f"SYSTEMD_COLORS=0 systemctl status --no-pager -n 0 {UNIT}", check=False)
    assert no_raw(status)
    host.sim.systemctl("stop", UNIT)
