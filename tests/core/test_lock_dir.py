"""An unusable lock_dir is the operator's to fix: state that cannot be written (73) or a
permission error (77) naming the folder, never an internal error."""

from __future__ import annotations

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
