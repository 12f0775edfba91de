"""The main job where no GPU is present: the incident and its fix on the simulated GPU host.

Boots the host (real systemd, stand-in NVIDIA driver, 8 GPUs), starts a vLLM-like server by
hand from a login session so that it holds ~88 GiB on every GPU, puts gpugate on a vLLM-like
unit with `gpugate install`, makes the driver release memory a few seconds late, and
`systemctl start`s the unit. It shows what an operator sees: the drop-in, `systemctl status`
with gpugate's STATUS= line while it waits, the GPU memory before and after, and the journal
(`journalctl -t gpugate`, with timestamps). Powers the host off at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: fake_nvml

from fake_nvml.build import build_fake_nvml
from incident import ALL, REPO, Host, prepare, unit_text
from sandbox import SimHost

RELEASE_DELAY_MS = 4000  # the driver frees a killed process's memory this late
UNIT = "vllm.service"


def show(title: str, text: str) -> None:
    print(f"\n== {title} ==\n{text.rstrip()}")


def bare_unit() -> str:
    """The vLLM unit as an operator has it: no gpugate lines (install adds the drop-in)."""
    lines = unit_text(UNIT, ALL, 8000).splitlines()
    return (
        "\n".join(ln for ln in lines if not ln.startswith(("ExecStartPre=", "ExecStopPost=")))
        + "\n"
    )


def wait_for_status_line(host: Host, timeout: float = 60) -> str:
    """`systemctl status` while gpugate waits for the driver: its Status: line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = host.sh(f"SYSTEMD_COLORS=0 systemctl status --no-pager -n 0 {UNIT}", check=False)
        if 'Status: "gpugate pre: waiting' in text:
            return text
        time.sleep(0.2)
    return host.sh(f"systemctl status --no-pager -n 0 {UNIT}", check=False)


def main() -> int:
    lib = build_fake_nvml(REPO / ".simhost" / "fake-nvml")
    print("booting the simulated GPU host (systemd in private namespaces, 8 stand-in GPUs)...")
    with SimHost.boot(nvml_lib=lib, gpus=8) as sim:
        print(f"booted in {sim.boot_seconds:.2f} s; installing gpugate from source inside...")
        host = prepare(sim)
        old, shell = host.hand_start(ALL, 8000, "hand-vllm")
        print(
            f"a server started by hand from a login session (shell PID {shell}): "
            f"API server {old['api_server']}, engine core {old['engine_core']}, "
            f"workers {old['workers']}"
        )
        show("before `systemctl start vllm.service`: gpugate status", host.sh("gpugate status"))
        sim.install_unit(UNIT, bare_unit())
        show("gpugate install vllm --gpus all", host.sh("gpugate install vllm --gpus all"))
        show(
            "/etc/systemd/system/vllm.service.d/gpugate.conf (written by gpugate install)",
            host.sh("grep -v '^#' /etc/systemd/system/vllm.service.d/gpugate.conf"),
        )
        host.sh(
            f"sed -i 's/^release_delay_ms.*/release_delay_ms = {RELEASE_DELAY_MS}/' "
            "/etc/fake-nvml.conf"
        )
        print(f"\nthe driver now frees a killed process's memory {RELEASE_DELAY_MS} ms late")
        started = time.monotonic()
        host.sh(f"rm -f /run/ready-{UNIT}.json; systemctl start --no-block {UNIT}")
        show("systemctl status vllm.service, while gpugate waits", wait_for_status_line(host))
        new = host.wait_ready(f"/run/ready-{UNIT}.json", timeout=120)
        print(
            f"\nthe unit's own server is up after {time.monotonic() - started:.1f} s: "
            f"API server {new['api_server']}"
        )
        show(
            "journalctl -t gpugate (every gpugate entry of this start, with timestamps)",
            host.sh("journalctl --no-pager -t gpugate -o short-precise"),
        )
        show(
            "systemctl status vllm.service, running (gpugate left no STATUS= behind)",
            host.sh(f"systemctl status --no-pager -n 0 {UNIT}", check=False),
        )
        show("after: gpugate status", host.sh("gpugate status"))
        survivors = [pid for pid in [old["api_server"], *old["workers"]] if host.alive(pid)]
        active = host.sh(f"systemctl is-active {UNIT}", check=False).strip()
        print(f"\nold server processes still alive: {survivors or 'none'}; {UNIT} is {active}")
        print(f"the login shell {shell} is {'alive' if host.alive(shell) else 'GONE (bug)'}")
        ok = active == "active" and not survivors and host.alive(shell)
        sim.systemctl("stop", UNIT)
    print("\nsimulated host powered off.", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
