from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import (
    UNIT_CGROUP,
    FakeGpuMemory,
    FakeHost,
    ProcessPool,
    RecordingJournal,
    RecordingNotifier,
)


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
