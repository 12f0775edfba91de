"""CUDA MPS on the simulated GPU host (real systemd, the stand-in driver with its MPS lists),
issue 46 item 4 (docs/mps.md): an MPS server unit whose process is /usr/bin/nvidia-cuda-mps-server
(protected by default) and a gpugate-gated client unit on GPU 0.

- server first, then the client unit: the client starts (the server neither refuses nor holds
  up its start, even with more memory than free_mib), a stale client left in a login scope is
  freed by the client's pre, the server is never signalled;
- `status --json` names the client with its MiB (`mps_client`), the server as `mps_server`;
  `gpugate sweep` counts an orphaned client's MiB under owner "nobody" (not "unlisted");
- client unit first, then the server, then the client restarted: both stay, the server is
  never signalled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from incident import PYTHON, REPO, Host, prepare
from sandbox import SimHost

pytestmark = [pytest.mark.simhost, pytest.mark.slow]

SERVER_UNIT = "nvidia-mps.service"
CLIENT_UNIT = "vllm-mps-client.service"
STALE_SCOPE = "hand-mps-stale.scope"
SCRIPT = "/opt/mps/mps_proc.py"
SERVER_EXE = "/usr/bin/nvidia-cuda-mps-server"
SIGNALS = "/run/mps-signals.log"
SERVER_MIB = 5000  # above free_mib: the client's wait must not be for it
CLIENT_MIB = 4000
STALE_MIB = 9000
CONFIG = (
    "gpus = [0]\n[pre]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"
    "[post]\nsigterm_grace_s = 2\nwait_timeout_s = 30\n"
)
SWEEP_CONFIG = "/etc/gpugate/mps-sweep.toml"
METRICS = "/run/gpugate-metrics/gpugate.prom"


def proc_cmd(ready: str, mib: int, *extra: str, exe: str = PYTHON) -> str:
    return f"{exe} {SCRIPT} --gpus 0 --mib {mib} --ready {ready} " + " ".join(extra)


@pytest.fixture(scope="module")
def host(simhost: SimHost) -> Iterator[Host]:
    h = prepare(simhost)
    h.sim.write_file(SCRIPT, (REPO / "tests" / "simhost" / "workload" / "mps_proc.py").read_text())
    # The server's executable at NVIDIA's path inside the host's overlay: a copy of Python.
    h.sh(f'cp "$(readlink -f {PYTHON})" {SERVER_EXE}')
    h.sim.install_unit(
        SERVER_UNIT,
        "[Unit]\nDescription=CUDA MPS (stand-in)\n[Service]\nType=simple\n"
        f"ExecStart={proc_cmd('/run/ready-mps.json', SERVER_MIB, '--log-signals', SIGNALS, exe=SERVER_EXE)}\n",
    )
    h.install(
        CLIENT_UNIT,
        "[Unit]\nDescription=MPS client\n[Service]\nType=simple\n"
        "ExecStartPre=/usr/bin/gpugate pre %n\nExecStopPost=/usr/bin/gpugate post %n\n"
        f"ExecStart={proc_cmd(f'/run/ready-{CLIENT_UNIT}.json', CLIENT_MIB, '--mps')}\n"
        "TimeoutStartSec=60\n",
        CONFIG,
    )
    h.sim.write_file(
        SWEEP_CONFIG, f'metrics_textfile = "{METRICS}"\n[pre]\nsigterm_grace_s = 2\n[sweep]\n'
    )
    yield h
    h.sh(f"systemctl stop {CLIENT_UNIT} {SERVER_UNIT} {STALE_SCOPE} 2>/dev/null", check=False)
    h.sh(f"rm -f {SERVER_EXE}", check=False)
    h.reset()


def start_server(host: Host) -> int:
    host.sh(f"rm -f /run/ready-mps.json {SIGNALS}")
    host.sim.systemctl("start", SERVER_UNIT)
    pid = int(host.wait_ready("/run/ready-mps.json")["pid"])
    assert host.sh(f"readlink /proc/{pid}/exe").strip() == SERVER_EXE
    return pid


def start_stale_client(host: Host) -> int:
    """A client whose unit is gone: left in a login's scope, nobody's."""
    ready = "/run/ready-mps-stale.json"
    host.sh(f"rm -f {ready}")
    host.sim.spawn_scope(proc_cmd(ready, STALE_MIB, "--mps").split(), unit=STALE_SCOPE)
    return int(host.wait_ready(ready)["pid"])


def start_client(host: Host) -> int:
    assert host.start(CLIENT_UNIT, check=False) == 0, host.sh(
        f"journalctl -t gpugate -n 30 --no-pager -u {CLIENT_UNIT}", check=False
    )
    return int(host.wait_ready(f"/run/ready-{CLIENT_UNIT}.json")["pid"])


def signals(host: Host) -> str:
    return host.sh(f"cat {SIGNALS} 2>/dev/null", check=False)


def holders(host: Host, *args: str) -> dict[int, dict[str, Any]]:
    out = host.sim.run(["gpugate", "status", "--json", *args], timeout=60)
    return {h["pid"]: h for h in json.loads(out.stdout)["holders"]}


def metric(host: Host, gpu: str, owner: str) -> float:
    for line in host.sh(f"cat {METRICS}").splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith("gpugate_gpu_memory_mib{") and (
            f'gpu="{gpu}"' in series and f'owner="{owner}"' in series
        ):
            return float(value)
    raise AssertionError(f"no gpugate_gpu_memory_mib for GPU {gpu}, owner {owner}")


def test_server_first_then_the_client_unit_and_a_stale_client_freed(host: Host) -> None:
    host.reset()
    server = start_server(host)
    stale = start_stale_client(host)
    cursor = host.cursor()

    client = start_client(host)

    assert host.alive(server) and host.alive(client) and not host.alive(stale)
    assert signals(host) == ""
    entries = host.events_after(cursor, GPUGATE_UNIT=CLIENT_UNIT)
    signalled = {e["GPUGATE_PID"] for e in entries if e.get("GPUGATE_EVENT") == "signal_sent"}
    assert signalled == {str(stale)}
    spared = [e for e in entries if e.get("GPUGATE_EVENT") == "process_spared"]
    assert {(e["GPUGATE_PID"], e["GPUGATE_REASON"]) for e in spared} >= {(str(server), "protected")}

    found = holders(host)
    assert found[client]["used_mib"] == {"0": CLIENT_MIB} and found[client]["mps_client"] == [0]
    assert found[client]["owner"] == "unit"
    assert found[server]["mps_server"] is True and found[server]["owner"] == "protected"
    assert found[server]["used_mib"] == {"0": SERVER_MIB}

    # an orphaned client between starts: nobody's, with its MiB
    stale = start_stale_client(host)
    result = host.sim.run(["gpugate", "sweep", "--config", SWEEP_CONFIG], check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert metric(host, "0", "nobody") == STALE_MIB
    assert metric(host, "0", "unit") == CLIENT_MIB
    assert metric(host, "0", "protected") == SERVER_MIB
    assert metric(host, "0", "unlisted") == 0
    found = holders(host, "--config", SWEEP_CONFIG)
    assert found[stale]["owner"] == "nobody" and found[stale]["used_mib"] == {"0": STALE_MIB}

    host.sim.systemctl("stop", CLIENT_UNIT)
    assert host.alive(server) and not host.alive(client) and signals(host) == ""
    host.sh(f"systemctl stop {STALE_SCOPE} {SERVER_UNIT}", check=False)


def test_client_unit_first_then_the_server_then_the_client_restarted(host: Host) -> None:
    host.reset()
    client = start_client(host)
    server = start_server(host)
    assert host.alive(client) and host.alive(server)

    host.sh(f"rm -f /run/ready-{CLIENT_UNIT}.json")
    assert host.sim.systemctl("restart", CLIENT_UNIT, check=False).returncode == 0
    again = int(host.wait_ready(f"/run/ready-{CLIENT_UNIT}.json")["pid"])

    assert again != client and not host.alive(client) and host.alive(again)
    assert host.alive(server) and signals(host) == ""
    assert host.sim.systemctl("is-active", CLIENT_UNIT, check=False).stdout.strip() == "active"
    host.sh(f"systemctl stop {CLIENT_UNIT} {SERVER_UNIT}", check=False)
