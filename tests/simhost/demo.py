"""The main job where no GPU is present: the incident and its fix on the simulated GPU host.

Boots the host (real systemd, stand-in NVIDIA driver, 8 GPUs), starts a vLLM-like server by
hand from a login session so that it holds ~88 GiB on every GPU, then `systemctl start`s a
vLLM-like unit that has `ExecStartPre=gpugate pre %n`, and prints what gpugate did: the GPU
memory before and after and gpugate's journal entries. Powers the host off at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_nvml.build import build_fake_nvml
from incident import ALL, CONFIG, REPO, Host, prepare, unit_text
from sandbox import SimHost


def show_memory(host: Host, title: str) -> None:
    print(f"\n== {title}: `gpugate status` ==")
    print(host.sh("gpugate status"))


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
        show_memory(host, "before `systemctl start vllm.service`")
        host.install("vllm.service", unit_text("vllm.service", ALL, 8000), CONFIG)
        print("\n== /etc/systemd/system/vllm.service ==")
        print(host.sh("cat /etc/systemd/system/vllm.service"))
        cursor = host.cursor()
        code = host.start("vllm.service", check=False)
        print(f"`systemctl start vllm.service` exited {code}")
        new = host.wait_ready("/run/ready-vllm.service.json")
        print(f"the unit's own server is up: API server {new['api_server']}")
        print("\n== journalctl -u vllm.service (gpugate's entries) ==")
        print(host.sh(f"journalctl --no-pager -u vllm.service --after-cursor='{cursor}' -o cat"))
        show_memory(host, "after")
        survivors = [pid for pid in [old["api_server"], *old["workers"]] if host.alive(pid)]
        print(f"old server processes still alive: {survivors or 'none'}")
        print(f"the login shell {shell} is {'alive' if host.alive(shell) else 'GONE (bug)'}")
        ok = code == 0 and not survivors and host.alive(shell)
        sim.systemctl("stop", "vllm.service")
    print("\nsimulated host powered off.", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
