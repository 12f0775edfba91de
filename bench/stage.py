"""The stand-in host the local benchmarks run against: device files, a cgroup tree, the
stand-in NVML library and its settings, a gpugate config pointing at them; and gpugate
installed the way the README installs it (its own venv), for the start-up timings."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from bench.crowd import BUILD, REPO, BenchError, make_device_root

UNIT = "bench.service"
SIMHOST = REPO / "tests" / "simhost"


def load_by_path(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fake_nvml_lib() -> Path:
    build = load_by_path("bench_fake_nvml_build", REPO / "tests" / "fake_nvml" / "build.py")
    return Path(build.build_fake_nvml(REPO / ".simhost" / "fake-nvml"))


@dataclass
class Stage:
    """A stand-in host under ROOT: ROOT/dev (nvidia0..7, nvidiactl, nvidia-uvm, shm/), ROOT/cgroup
    with the unit's empty cgroup, ROOT/locks, ROOT/nvml (the stand-in driver's state)."""

    root: Path

    def __post_init__(self) -> None:
        self.dev = make_device_root(self.root / "dev")
        # Every host has DEV/shm: gpugate's scan then also notes each process's files there
        # (core/discover.py's shm areas), as it does on a real host.
        (self.dev / "shm").mkdir(exist_ok=True)
        cgroup = self.root / "cgroup" / "system.slice" / UNIT
        cgroup.mkdir(parents=True, exist_ok=True)
        (cgroup / "cgroup.procs").write_text("")
        self.locks = self.root / "locks"
        self.state = self.root / "nvml"
        self.state.mkdir(parents=True, exist_ok=True)
        self.nvml_config = self.root / "fake-nvml.conf"
        self.nvml_config.write_text(
            f"gpu_count = 8\ndev_root = {self.dev}\nstate_dir = {self.state}\n"
        )
        self.config = self.root / "gpugate.toml"
        self.config.write_text(f'lock_dir = "{self.locks}"\n')
        self.lib = fake_nvml_lib()

    def env(self, *, source_tree: bool = False) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = str(self.lib.parent)
        env["FAKE_NVML_CONFIG"] = str(self.nvml_config)
        env.pop("NOTIFY_SOCKET", None)
        if source_tree:
            env["PYTHONPATH"] = f"{REPO / 'src'}:{REPO}"
        return env

    def roots_args(self) -> list[str]:
        """gpugate's hidden options for stand-in roots and NVML (never the environment:
        docs/hardening.md)."""
        return [
            "--host-roots",
            f"dev={self.dev},cgroup={self.root / 'cgroup'},run={self.root}",
            "--nvml-library",
            str(self.lib),
        ]

    def gpu_paths(self) -> list[str]:
        return [str(self.dev / f"nvidia{i}") for i in range(8)]


def installed_gpugate() -> tuple[list[str], str]:
    """gpugate as the README installs it: a venv of its own (.bench/venv) with the wheel of
    this working tree and its dependencies; returns its command and how it was installed.

    Falls back to `python3 -m gpugate` from the source tree where the wheels cannot be built
    (no network for the dependencies the first time).
    """
    venv = BUILD / "venv"
    try:
        sandbox = load_by_path("bench_simhost_sandbox", SIMHOST / "sandbox.py")
        wheelhouse = Path(sandbox.build_wheelhouse(REPO))
        stamp = venv / ".installed"
        wheels = sorted(wheelhouse.glob("gpugate-*.whl"))
        if not wheels:
            raise BenchError(f"no gpugate wheel in {wheelhouse}")
        if not stamp.exists() or stamp.stat().st_mtime < wheels[-1].stat().st_mtime:
            if not (venv / "bin" / "pip").exists():
                _run([sys.executable, "-m", "venv", str(venv)])
            pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-index"]
            _run([*pip, "--find-links", str(wheelhouse), "gpugate"])
            _run([*pip, "--force-reinstall", "--no-deps", str(wheels[-1])])
            stamp.write_text(f"{wheels[-1].name}\n")
        shown = venv.relative_to(REPO) if venv.is_relative_to(REPO) else venv
        return [str(venv / "bin" / "gpugate")], f"venv {shown} (wheel {wheels[-1].name})"
    except (BenchError, subprocess.CalledProcessError, OSError) as err:
        print(f"bench: cannot install gpugate into {venv} ({err}); using the source tree")
        return [sys.executable, "-m", "gpugate"], "source tree (python3 -m gpugate)"


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def machine() -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": f"{os.cpu_count()} ({cpu})",
        "memory": f"{mem_kib / 1024 / 1024:.1f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "baselines": f"{_version(['fuser', '-V'])}, lsof {_version(['lsof', '-v'], 'revision')}",
        "pid_max": Path("/proc/sys/kernel/pid_max").read_text().strip(),
    }


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _version(argv: list[str], marker: str = "") -> str:
    if shutil.which(argv[0]) is None:
        return "missing"
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    for line in (result.stdout + result.stderr).splitlines():
        if not marker or marker in line:
            return line.strip()
    return "?"
