"""An unusable lock_dir is the operator's to fix: state that cannot be written (73) or a
permission error (77) naming the folder, never an internal error."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, PermissionDenied, StateUnwritable
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import Gpu

GPU = Gpu(0, "GPU-fa4e5a11-0000-0000-0000-000000000000", 0, "Fake GPU", 1000)


def take(lock_dir: Path) -> None:
    with gpu_locks(lock_dir, [GPU], time.monotonic() + 1):
        pass


@pytest.mark.parametrize(
    "layout",
    ["file", "file/below", "file/below/deeper"],
)
def test_a_file_in_the_way_is_unwritable_state(tmp_path: Path, layout: str) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StateUnwritable) as raised:
        take(tmp_path / layout)
    assert raised.value.exit_code is ExitCode.STATE_UNWRITABLE
    assert str(tmp_path / layout) in str(raised.value) and "\n" not in str(raised.value)


def test_a_lock_file_that_is_a_folder_is_unwritable_state(tmp_path: Path) -> None:
    (tmp_path / f"{GPU.uuid}.lock").mkdir()
    with pytest.raises(StateUnwritable) as raised:
        take(tmp_path)
    assert f"{GPU.uuid}.lock" in str(raised.value)


def test_a_folder_it_may_not_write_is_a_permission_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere; the simulated-host test covers User=nobody")
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    with pytest.raises(PermissionDenied):
        take(locked / "gpugate")


def test_a_usable_folder_is_made_and_used(tmp_path: Path) -> None:
    take(tmp_path / "run" / "gpugate")
    assert (tmp_path / "run" / "gpugate" / f"{GPU.uuid}.lock").is_file()


@pytest.mark.parametrize("layout", ["file", "file/below", "lockfile-is-a-folder"])
def test_after_a_stop_a_lock_that_cannot_be_made_is_told_not_raised(
    tmp_path: Path, layout: str
) -> None:
    """on_unlocked given (a phase whose state is not required): the run goes on without
    the lock, told where and why; without, the same is StateUnwritable (above)."""
    (tmp_path / "file").write_text("")
    lock_dir = tmp_path / layout
    if layout == "lockfile-is-a-folder":
        (tmp_path / layout / f"{GPU.uuid}.lock").mkdir(parents=True)
    told: list[tuple[Path, str]] = []
    entered = False
    with gpu_locks(
        lock_dir, [GPU], time.monotonic() + 1, on_unlocked=lambda p, c: told.append((p, c))
    ):
        entered = True
    assert entered
    ((path, cause),) = told
    expected = lock_dir / f"{GPU.uuid}.lock" if layout.startswith("lockfile") else lock_dir
    assert path == expected and cause and "\n" not in cause


def test_after_a_stop_a_usable_lock_is_still_taken(tmp_path: Path) -> None:
    """on_unlocked changes nothing where the lock can be had: a second holder waits."""
    told: list[tuple[Path, str]] = []
    with gpu_locks(
        tmp_path, [GPU], time.monotonic() + 1, on_unlocked=lambda p, c: told.append((p, c))
    ):
        fd = os.open(tmp_path / f"{GPU.uuid}.lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert told == []
