"""The benchmarks on the simulated GPU host (tests/simhost: a real systemd booted in private
namespaces, the stand-in NVIDIA driver, the vLLM-like workload, gpugate installed from this
working tree as the README says):

- reclaim latency: a hand-started 8-GPU server, `gpugate pre` run directly; from the moment
  the stand-in driver reports the last of its memory freed (freed.log, with an independent
  1 ms NVML poller inside so the report is not gpugate's own) to gpugate's exit; next to it
  the hand cleanup operators run today: `kill -9`, then `until <GPUs free>; do sleep 5; done`;
- the whole incident: that server with one worker that ignores SIGTERM, then
  `systemctl start vllm.service` (gpugate on ExecStartPre=) until the unit is active, split
  by gpugate's journal entries, the driver's log and systemd's timestamps;
- start-up there: `gpugate pre` on the clean simulated host, with the real `systemctl show`
  and journald.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from bench.crowd import HERE, REPO
from bench.stage import fake_nvml_lib

sys.path.insert(0, str(REPO / "tests" / "simhost"))

from incident import ALL, CONFIG, PYTHON, Host, prepare, unit_text
from sandbox import SimHost, preflight

UNIT = "vllm.service"
FREE_MIB = 1024
RECLAIM_DELAY_MS = 1000
INCIDENT_DELAY_MS = 2000
OBSERVER = "/opt/bench/observer.py"
TIMED = "/opt/bench/timed.py"
OBSERVER_LOG = "/run/bench-observer.log"
FREED_LOG = "/run/fake-nvml/freed.log"


@dataclass
class Reclaim:
    gpugate_ms: list[float] = field(default_factory=list)
    gpugate_rss_kib: list[int] = field(default_factory=list)
    gpugate_wall_s: list[float] = field(default_factory=list)
    hand_ms: list[float] = field(default_factory=list)
    probe_ms: list[float] = field(default_factory=list)  # one `gpugate status --json`


@dataclass
class Incident:
    total_s: float  # systemctl start returned: the unit is active
    parts: dict[str, float]  # seconds each, in order; they add up to total_s
    gpugate_s: float  # the ExecStartPre= process, start to exit
    killed: int


@dataclass
class SimResult:
    reclaim: Reclaim
    incidents: list[Incident]
    startup: list[float] = field(default_factory=list)  # seconds, `gpugate pre`, clean host
    startup_rss_kib: list[int] = field(default_factory=list)
    note: str = ""


def unavailable() -> str | None:
    return preflight()


def _set_delay(host: Host, delay_ms: int) -> None:
    host.sh(f"sed -i 's/^release_delay_ms.*/release_delay_ms = {delay_ms}/' /etc/fake-nvml.conf")


def _hand_start(host: Host, name: str, port: int, *extra: str) -> dict[str, Any]:
    """A server started by hand from a login session: typed into an interactive shell on a
    terminal (incident.Host.hand_start), with extra server options."""
    server, _shell = host.hand_start(ALL, port, name, *extra)
    return server


def _freed_ns(host: Host, pids: list[int]) -> int:
    """When the stand-in driver reported the last of these processes' memory freed."""
    wanted = set(pids)
    times = [
        int(fields[0])
        for line in host.sh(f"cat {FREED_LOG} 2>/dev/null", check=False).splitlines()
        if len(fields := line.split()) >= 2 and int(fields[1]) in wanted
    ]
    if len(times) < len(wanted):
        raise RuntimeError(f"freed.log has {len(times)} of {len(wanted)} releases")
    return max(times)


def _exit_line(output: str) -> list[str]:
    for line in output.splitlines():
        if line.startswith("EXIT "):
            return line.split()
    raise RuntimeError(f"no EXIT line in:\n{output}")


def _observed(script: str, procs: bool = False) -> str:
    """script, with the 1 ms NVML observer running around it."""
    flag = " --procs" if procs else ""
    return (
        f": > {OBSERVER_LOG}; : > {FREED_LOG}; {PYTHON} {OBSERVER} {OBSERVER_LOG}{flag} & obs=$!; "
        f"sleep 0.1; {script}; kill $obs; wait $obs"
    )


def _reclaim_gpugate(host: Host, rep: int, result: Reclaim) -> None:
    _set_delay(host, RECLAIM_DELAY_MS)
    server = _hand_start(host, f"hand-reclaim-{rep}", 8000)
    out = host.sh(_observed(f"{PYTHON} {TIMED} gpugate pre {UNIT}"))
    _, exited_ns, wall, code, rss, _cpu = _exit_line(out)
    if code != "0":
        raise RuntimeError(f"gpugate pre exited {code}:\n{out}")
    freed = _freed_ns(host, server["workers"])
    result.gpugate_ms.append((int(exited_ns) - freed) / 1e6)
    result.gpugate_rss_kib.append(int(rss))
    result.gpugate_wall_s.append(float(wall))
    host.reset()


def _reclaim_by_hand(host: Host, rep: int, delay_ms: int, result: Reclaim) -> None:
    """The runbook: kill -9 the server, then poll the GPUs every 5 s until they are free.
    The runs' driver delays spread evenly over the loop's period, so the releases fall all
    over it, as they do on a real host."""
    _set_delay(host, delay_ms)
    server = _hand_start(host, f"hand-loop-{rep}", 8000)
    pids = " ".join(map(str, [server["api_server"], server["engine_core"], *server["workers"]]))
    busy = (
        "gpugate status --json | "
        f'{PYTHON} -c \'import json,sys; sys.exit(0 if any(g["used_mib"] > {FREE_MIB} '
        'for g in json.load(sys.stdin)["gpus"]) else 1)\''
    )
    loop = f"kill -9 {pids}; while {busy}; do sleep 5; done; echo EXIT $(date +%s%N)"
    out = host.sh(_observed(loop))
    exited_ns = int(_exit_line(out)[1])
    result.hand_ms.append((exited_ns - _freed_ns(host, server["workers"])) / 1e6)
    probe = host.sh(f"{PYTHON} {TIMED} sh -c {shlex.quote(busy)}", check=False)
    result.probe_ms.append(float(_exit_line(probe)[2]) * 1000)
    host.reset()


def _realtime_us(text: str) -> float:
    """systemctl show --timestamp=us+utc: 'Sun 2026-11-29 12:17:02.612214 UTC' -> seconds."""
    stamp = datetime.strptime(text.strip(), "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(
        tzinfo=timezone.utc
    )
    return stamp.timestamp()


def _incident(host: Host, rep: int) -> Incident:
    _set_delay(host, INCIDENT_DELAY_MS)
    server = _hand_start(host, f"hand-incident-{rep}", 8000, "--ignore-sigterm-worker", "3")
    host.install(UNIT, unit_text(UNIT, ALL, 8000), CONFIG)
    cursor = host.cursor()
    out = host.sh(
        _observed(
            f"echo START $(date +%s%N); systemctl start {UNIT}; echo ACTIVE $(date +%s%N)",
            procs=True,
        )
    )
    marks = {
        line.split()[0]: int(line.split()[1]) / 1e9 for line in out.splitlines() if " " in line
    }
    show = host.sh(f"systemctl show --timestamp=us+utc -p ExecStartPre {UNIT}")
    pre_start = _realtime_us(show.split("start_time=[", 1)[1].split("]", 1)[0])
    pre_stop = _realtime_us(show.split("stop_time=[", 1)[1].split("]", 1)[0])
    entries = host.journal_json(f"--after-cursor={cursor}", "-u", UNIT, "GPUGATE_PHASE=pre")

    def at(entry: dict[str, Any]) -> float:
        return int(entry.get("_SOURCE_REALTIME_TIMESTAMP") or entry["__REALTIME_TIMESTAMP"]) / 1e6

    signals = [e for e in entries if e.get("GPUGATE_EVENT") == "signal_sent"]
    sigterm = min(at(e) for e in signals if e.get("GPUGATE_SIGNAL") == "SIGTERM")
    sigkill = min(at(e) for e in signals if e.get("GPUGATE_SIGNAL") == "SIGKILL")
    finished = [e for e in entries if e.get("GPUGATE_EVENT") == "run_finished"]
    # The last worker gone: the first moment the driver listed no process on its GPU.
    listed_before: dict[str, int] = {}
    gone_at: dict[str, float] = {}
    for line in host.sh(f"cat {OBSERVER_LOG}").splitlines():
        stamp, gpu, _used, listed = line.split()
        if int(listed) == 0 and listed_before.get(gpu, 0) > 0 and gpu not in gone_at:
            gone_at[gpu] = int(stamp) / 1e9
        listed_before[gpu] = int(listed)
    gone = max(gone_at.values())
    freed = _freed_ns(host, server["workers"]) / 1e9
    parts = {
        "systemd: start to ExecStartPre=": pre_start - marks["START"],
        "gpugate: start-up, discovery, first SIGTERM": sigterm - pre_start,
        "grace (sigterm_grace_s, one worker ignores SIGTERM)": sigkill - sigterm,
        "kill: SIGKILL until the driver lists no process": gone - sigkill,
        "driver delay (release_delay_ms)": freed - gone,
        "gpugate: freed to exit": pre_stop - freed,
        "systemd: ExecStartPre= exit to active": marks["ACTIVE"] - pre_stop,
    }
    incident = Incident(
        total_s=marks["ACTIVE"] - marks["START"],
        parts=parts,
        gpugate_s=pre_stop - pre_start,
        killed=int(finished[-1].get("GPUGATE_KILLED", 0)) if finished else 0,
    )
    host.sim.systemctl("stop", UNIT)
    host.reset()
    return incident


def _startup(host: Host, runs: int, result: SimResult) -> None:
    host.install(UNIT, unit_text(UNIT, ALL, 8000), CONFIG)
    for _ in range(runs):
        out = host.sh(f"{PYTHON} {TIMED} gpugate pre {UNIT} 2>/dev/null")
        _, _, wall, code, rss, _ = _exit_line(out)
        if code != "0":
            raise RuntimeError(f"gpugate pre on the clean simulated host exited {code}")
        result.startup.append(float(wall))
        result.startup_rss_kib.append(int(rss))


def measure_simulated(reclaims: int, hand_loops: int, incidents: int, startups: int) -> SimResult:
    with SimHost.boot(nvml_lib=fake_nvml_lib(), gpus=8) as sim:
        host = prepare(sim)
        for name in ("observer.py", "timed.py"):
            sim.write_file(f"/opt/bench/{name}", (HERE / "inside" / name).read_text())
        host.install(UNIT, unit_text(UNIT, ALL, 8000), CONFIG)
        result = SimResult(Reclaim(), [])
        _startup(host, startups, result)
        for rep in range(reclaims):
            _reclaim_gpugate(host, rep, result.reclaim)
        for rep in range(hand_loops):
            delay_ms = 500 + 5000 * (2 * rep + 1) // (2 * hand_loops)
            _reclaim_by_hand(host, rep, delay_ms, result.reclaim)
        for rep in range(incidents):
            result.incidents.append(_incident(host, rep))
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def dump(result: SimResult) -> str:
    return json.dumps(result, default=lambda o: o.__dict__, indent=1)
