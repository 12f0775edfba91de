"""What `gpugate oci-hook` costs a container start, against the same machine's floor.

    python3 bench/oci_hook.py [--runs 20] [--command PATH]

Every container start on a host with gpugate's hooks.d file runs the hook, GPUs or not:
- no GPU: the state on stdin, the bundle's config.json read and parsed, exit 0 (the fast
  path, front/commands/oci_hook.py; target: well under 50 ms of wall time);
- one GPU (195:1 in linux.devices) on a stand-in host (stand-in devices, cgroup tree and
  NVML, bench/stage.py): the whole start gate, config, NVML, discovery, lease, wait;
next to `python -c pass` and `python -I -S -c pass` with the interpreter gpugate's command
runs (its #! line). Medians of interleaved runs; wall and CPU milliseconds; the ratio to the
bare interpreter, never an absolute timed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stage import Stage, installed_gpugate
from bench.startup import _python_of

CONTAINER_ID = "b" * 64
TARGET_NO_GPU_MS = 50.0


def bundle(
    root: Path,
    env: list[str],
    mounts: list[dict[str, str]] | None = None,
    devices: list[dict[str, object]] | None = None,
) -> Path:
    folder = root / "bundle"
    folder.mkdir(mode=0o700, exist_ok=True)
    spec = {
        "ociVersion": "1.0.2",
        "process": {"args": ["/bin/sh"], "env": ["PATH=/usr/bin:/bin", *env]},
        "root": {"path": "rootfs"},
        "mounts": mounts or [],
        "linux": {"cgroupsPath": f"machine.slice:libpod:{CONTAINER_ID}", "devices": devices or []},
        "annotations": {"io.container.manager": "libpod"},
    }
    (folder / "config.json").write_text(json.dumps(spec))
    return folder


def state_file(root: Path, folder: Path) -> Path:
    state = {"ociVersion": "1.0.2", "id": CONTAINER_ID, "status": "creating", "pid": 0,
             "bundle": str(folder), "annotations": {}}  # fmt: skip
    path = root / "state.json"
    path.write_text(json.dumps(state))
    return path


def timed(argv: list[str], stdin: Path | None, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run, from fork to reap."""
    with open(stdin, "rb") if stdin else open(os.devnull, "rb") as source:
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=source, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        assert proc.stderr is not None
        said = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {code}: {said.decode(errors='replace')}")
    return wall, usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--command", help="the gpugate to time (default: bench's venv)")
    args = parser.parse_args(argv)
    command = [args.command] if args.command else installed_gpugate()[0]
    python = _python_of(command)
    with tempfile.TemporaryDirectory(prefix="gpugate-oci-bench-") as tmp:
        root = Path(tmp)
        stage = Stage(root / "stage")
        plain = root / "plain"
        plain.mkdir()
        gpu = root / "gpu"
        gpu.mkdir()
        # podman's own bind mounts: the no-GPU path stats each source.
        files = [
            {"source": p, "destination": p, "type": "bind"} for p in ("/etc/hosts", "/etc/passwd")
        ]
        no_gpu_state = state_file(plain, bundle(plain, ["HOME=/root"], files))
        device: dict[str, object] = {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}
        gpu_state = state_file(gpu, bundle(gpu, [], files, [device]))
        config = ["--config", str(stage.config)]
        cases: dict[str, tuple[list[str], Path | None]] = {
            "python -c pass": ([python, "-c", "pass"], None),
            "python -I -S -c pass": ([python, "-I", "-S", "-c", "pass"], None),
            "oci-hook, no GPU": ([*command, "oci-hook", "createRuntime"], no_gpu_state),
            "oci-hook, 1 GPU (whole gate)": (
                [*command, *stage.roots_args(), "oci-hook", *config, "createRuntime"],
                gpu_state,
            ),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        env = stage.env()
        for _ in range(args.runs):
            for name, (case, stdin) in cases.items():
                samples[name].append(timed(case, stdin, env))
    floor = statistics.median(w for w, _ in samples["python -c pass"])
    print(f"gpugate oci-hook createRuntime: {args.runs} interleaved runs, medians ({command[0]})")
    print(f"| {'case':<30} | wall ms | CPU ms | x python -c pass |")
    print(f"| {'-' * 30} | ------: | -----: | ---------------: |")
    for name, runs in samples.items():
        wall = statistics.median(w for w, _ in runs) * 1000
        cpu = statistics.median(c for _, c in runs) * 1000
        print(f"| {name:<30} | {wall:7.1f} | {cpu:6.1f} | {wall / (floor * 1000):16.2f} |")
    no_gpu = statistics.median(w for w, _ in samples["oci-hook, no GPU"]) * 1000
    verdict = "met" if no_gpu < TARGET_NO_GPU_MS else "NOT met"
    target = f"well under {TARGET_NO_GPU_MS:g} ms"
    print(f"target: no-GPU container {target}: {no_gpu:.1f} ms wall ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
