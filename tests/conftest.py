from __future__ import annotations

import os
import shutil
import subprocess
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


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.root("why")`: a test that needs root is skipped, saying why, when not root."""
    marker = item.get_closest_marker("root")
    if marker is not None and os.geteuid() != 0:
        why = marker.args[0] if marker.args else "it needs root"
        pytest.skip(f"needs root: {why}")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[FakeHost]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]:
        (dev / name).write_bytes(b"")
    cgroup_root = tmp_path / "cgroup"
    (cgroup_root / UNIT_CGROUP.lstrip("/")).mkdir(parents=True)
    (cgroup_root / UNIT_CGROUP.lstrip("/") / "cgroup.procs").write_text("")
    (tmp_path / "run").mkdir()
    pool = ProcessPool(tmp_path)
    fake = FakeHost(
        tmp_path, dev, cgroup_root, FakeGpuMemory(), pool, RecordingJournal(), RecordingNotifier()
    )
    try:
        yield fake
    finally:
        pool.cleanup()


REPO = Path(__file__).resolve().parents[1]
PYENV = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv"))


def missing_stage_tools() -> str | None:
    """Why packaging/stage cannot run here, or None."""
    for tool in ("gcc", "pkg-config", "strip", "objdump", "diff"):
        if shutil.which(tool) is None:
            return f"{tool} not found (scripts/setup installs gcc, pkg-config, binutils)"
    for minor in range(9, 14):
        if not list(PYENV.glob(f"versions/3.{minor}.*/bin/python3.{minor}")):
            return f"no Python 3.{minor} under {PYENV}: the packages carry every Python 3.9-3.13"
    return None


@pytest.fixture(scope="session")
def staged_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """packaging/stage's tree, made once per session: the .deb and the RPM are packed from it
    (STAGED=TREE packaging/build-deb, build-rpm)."""
    reason = missing_stage_tools()
    if reason:
        pytest.skip(reason)
    tree = tmp_path_factory.mktemp("staged") / "root"
    result = subprocess.run(
        ["bash", str(REPO / "packaging" / "stage"), str(tree)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return tree
