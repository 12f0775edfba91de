from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpugate.config import GateConfig, LoadedConfig
from gpugate.report import Reporter
from tests.fakes import FakeGpuMemory, ProcessPool, RecordingJournal, RecordingNotifier

UNIT = "vllm.service"
UNIT_CGROUP = "/system.slice/vllm.service"


@dataclass
class FakeHost:
    """A stand-in device root and cgroup tree, a fake GPU memory, and real processes."""

    root: Path
    dev: Path
    cgroup_root: Path
    memory: FakeGpuMemory
    pool: ProcessPool
    journal: RecordingJournal
    notifier: RecordingNotifier

    def device(self, name: str) -> Path:
        return self.dev / name

    def gpu_files(self, *indices: int) -> list[Path]:
        return [self.dev / "nvidiactl", self.dev / "nvidia-uvm"] + [
            self.dev / f"nvidia{i}" for i in indices
        ]

    def put_in_unit(self, *pids: int, cgroup: str = UNIT_CGROUP) -> None:
        procs = self.cgroup_root / cgroup.lstrip("/") / "cgroup.procs"
        procs.parent.mkdir(parents=True, exist_ok=True)
        existing = procs.read_text() if procs.exists() else ""
        procs.write_text(existing + "".join(f"{pid}\n" for pid in pids))

    def config(self, **overrides: object) -> LoadedConfig:
        paths = {
            "dev_root": self.dev,
            "cgroup_root": self.cgroup_root,
            "lock_dir": self.root / "locks",
        }
        fast = {"sigterm_grace_s": 1.0, "sigkill_wait_s": 1.0, "wait_timeout_s": 10.0}
        data: dict[str, object] = {
            "paths": paths,
            "pre": {**fast, **dict(overrides.pop("pre", {}))},  # type: ignore[call-overload]
            "post": {
                "kill_orphans": False,
                "kill_app_tree": False,
                **fast,
                **dict(overrides.pop("post", {})),  # type: ignore[call-overload]
            },
            **overrides,
        }
        return LoadedConfig(GateConfig.model_validate(data), "test.toml")

    def reporter(self, phase: str = "pre") -> Reporter:
        return Reporter(UNIT, phase, journal=self.journal, notifier=self.notifier, echo=False)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[FakeHost]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]:
        (dev / name).write_bytes(b"")
    cgroup_root = tmp_path / "cgroup"
    (cgroup_root / UNIT_CGROUP.lstrip("/")).mkdir(parents=True)
    (cgroup_root / UNIT_CGROUP.lstrip("/") / "cgroup.procs").write_text("")
    pool = ProcessPool(tmp_path)
    fake = FakeHost(
        tmp_path, dev, cgroup_root, FakeGpuMemory(), pool, RecordingJournal(), RecordingNotifier()
    )
    try:
        yield fake
    finally:
        pool.cleanup()
