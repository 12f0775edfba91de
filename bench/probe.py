"""Times gpugate's own discovery code in a process of its own (a process loads one
libnvidia-ml.so.1: the stand-in, by its path).

    python3 -m bench.probe DEV_ROOT CGROUP_ROOT NVML_LIBRARY

Reads commands on stdin, one a line, and answers each with one JSON line:
`discover` runs gpugate.core.discover.discover() (cgroup, device files, NVML) with a fresh
ProcFs, `scan` only gpugate.host.scan.scan_device_users(); both answer
{"wall": s, "cpu": s, "gpu_holders": [PID, ...]} (holders of nvidia0..7).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from gpugate.core.discover import GPU_DEVICE, DiscoveryQuery, discover
from gpugate.host.nvml import NvmlDriver
from gpugate.host.scan import ProcFs, scan_device_users
from gpugate.host.systemd import HostRoots

UNIT = "bench.service"


def main(argv: list[str]) -> int:
    dev_root, cgroup_root = (Path(arg) for arg in argv[1:3])
    roots = HostRoots(dev=dev_root, cgroup=cgroup_root)
    driver = NvmlDriver(library=argv[3])
    prefix = os.path.join(dev_root, "nvidia")
    for line in sys.stdin:
        command = line.strip()
        wall, cpu = time.perf_counter(), time.process_time()
        if command == "discover":
            found = discover(
                DiscoveryQuery(UNIT, f"/system.slice/{UNIT}", "all", "bench"),
                driver=driver,
                procfs=ProcFs(Path("/proc")),
                roots=roots,
            )
            holders = [pid for pid, holder in found.holders.items() if holder.gpus]
        elif command == "scan":
            scan = scan_device_users(Path("/proc"), prefix)
            holders = [
                pid
                for pid, use in scan.users.items()
                if any(GPU_DEVICE.fullmatch(os.path.basename(path)) for path in use.paths)
            ]
        else:
            print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)
            continue
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(json.dumps({"wall": wall, "cpu": cpu, "gpu_holders": sorted(holders)}), flush=True)
    driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
