"""A unit's own /dev/shm as gpugate reads it (issue 28): through a process's /proc/PID/root (a
real child in a mount namespace of its own with a tmpfs on /dev/shm), and the host's areas
reached under another root (/proc/1/root from a hook's namespace), names shown as the host's
processes see them, unlinks through that root."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpugate.host.scan import HostShm
from gpugate.host.shm import (
    ShmFile,
    ShmKey,
    facts,
    find_areas,
    host_root,
    inode_index,
    largest_files,
    own_shm_of_any,
    unlink_if_same,
)

HOST_SHM_DEV = os.stat("/dev/shm").st_dev


@pytest.fixture
def private_shm_child() -> Iterator[int]:
    """A child in a mount namespace of its own, a 1 MiB tmpfs on its /dev/shm, two files."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a mount namespace of its own")
    script = (
        "mount -t tmpfs -o size=1m none /dev/shm && head -c 8192 /dev/zero > /dev/shm/psm_a && "
        ": > /dev/shm/psm_b && mkdir /dev/shm/sub && echo ready && exec sleep 60"
    )
    child = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":  # the handshake: its files are there
            pytest.skip("this machine does not allow a tmpfs in a new mount namespace")
        yield child.pid
    finally:
        child.kill()
        child.wait()


@pytest.mark.root("a mount namespace of its own")
def test_a_process_with_its_own_dev_shm_shows_its_size_and_use(private_shm_child: int) -> None:
    found = own_shm_of_any(Path("/proc"), {private_shm_child}, {HOST_SHM_DEV})
    assert found is not None
    assert found.pid == private_shm_child and found.dev != HOST_SHM_DEV
    assert found.total_bytes == 1 << 20
    assert found.used_bytes >= 8192
    assert found.files == 2  # the folder is not a file
    assert own_shm_of_any(Path("/proc"), {os.getpid(), private_shm_child}, {HOST_SHM_DEV})


def test_a_process_sharing_the_hosts_dev_shm_has_none() -> None:
    assert own_shm_of_any(Path("/proc"), {os.getpid()}, {HOST_SHM_DEV}) is None
    assert own_shm_of_any(Path("/proc"), {2**22 + 3}, {HOST_SHM_DEV}) is None  # no such process


def test_a_dev_shm_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """A process's root where /dev/shm is a symlink (to a tmpfs elsewhere): not read."""
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "shm").symlink_to("/dev/shm")
    (proc / "77" / "root").symlink_to(root)
    assert own_shm_of_any(proc, {77}, set()) is None


def hostlike(tmp_path: Path) -> Path:
    root = tmp_path / "pid1root"
    (root / "dev" / "shm" / "sub").mkdir(parents=True)
    (root / "dev" / "shm" / "psm_x").write_bytes(b"x" * 8192)
    (root / "dev" / "shm" / "sub" / "psm_y").write_bytes(b"y")
    return root


def test_the_hosts_areas_under_another_root_keep_the_hosts_names(tmp_path: Path) -> None:
    root = hostlike(tmp_path)
    (area,) = find_areas(Path("/dev"), tmp_path / "no-proc", str(root))
    assert (area.path, area.where) == ("/dev/shm", f"{root}/dev/shm")
    index = inode_index([area])
    assert sorted(n for names in index.values() for n in names) == [
        "/dev/shm/psm_x",
        "/dev/shm/sub/psm_y",
    ]
    info = os.stat(root / "dev" / "shm" / "psm_x")
    file = ShmFile(ShmKey(info.st_dev, info.st_ino), ("/dev/shm/psm_x",))
    found = facts([area], file)
    assert found is not None and found.path == "/dev/shm/psm_x" and found.size == 8192
    assert largest_files([area], 1)[0][1].path == "/dev/shm/psm_x"
    assert [space.area for space in HostShm([area], tmp_path / "no-proc").spaces()] == [area]
    assert unlink_if_same([area], file).facts is not None
    assert not (root / "dev" / "shm" / "psm_x").exists()
    assert (root / "dev" / "shm" / "sub" / "psm_y").exists()


def test_a_symlinked_dev_shm_under_another_root_is_followed_inside_it(tmp_path: Path) -> None:
    root = tmp_path / "pid1root"
    (root / "run" / "shm").mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "dev" / "shm").symlink_to("../run/shm")
    (area,) = find_areas(Path("/dev"), tmp_path / "no-proc", str(root))
    assert (area.path, area.where) == ("/run/shm", f"{root}/run/shm")


def test_a_folder_swapped_for_a_symlink_is_not_followed_under_another_root(
    tmp_path: Path,
) -> None:
    root = hostlike(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "psm_y").write_bytes(b"y")
    info = os.stat(outside / "psm_y")
    (area,) = find_areas(Path("/dev"), tmp_path / "no-proc", str(root))
    shutil.rmtree(root / "dev" / "shm" / "sub")
    (root / "dev" / "shm" / "sub").symlink_to(outside)
    file = ShmFile(ShmKey(info.st_dev, info.st_ino), ("/dev/shm/sub/psm_y",))
    assert unlink_if_same([area], file).facts is None
    assert (outside / "psm_y").exists()


def test_host_root_only_for_the_real_dev(tmp_path: Path) -> None:
    assert host_root(tmp_path, Path("/proc")) is None  # stand-in roots (tests): never
    assert host_root(Path("/dev"), tmp_path) is None  # nothing to compare: as before
