"""The host's cgroup layout: unified and hybrid hosts are served from the tree systemd tracks
units in, a v1-only host gets one line and exit 28 with nothing killed (docs/install.md)."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest

from gpugate.errors import ExitCode, HostUnsupported
from gpugate.front.cli import main
from gpugate.host.systemd import (
    HYBRID,
    LEGACY,
    UNIFIED,
    CgroupLayout,
    HostRoots,
    cgroup_layout,
    host_cgroup_layout,
    on_units_tree,
)
from tests.fakes import UNIT_CGROUP, FakeHost, alive, raises_error

# What /proc/self/mountinfo shows (only the lines that matter, plus a few that do not).
ROOT_FS = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
SYSFS = "18 22 0:17 / /sys rw,nosuid,nodev,noexec,relatime shared:6 - sysfs sysfs rw\n"
V2_AT_ROOT = (
    "27 18 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
TMPFS_AT_ROOT = (
    "27 18 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
)
V2_AT_UNIFIED = (
    "28 27 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 "
    "cgroup2 rw,nsdelegate\n"
)
V1_SYSTEMD = (
    "29 27 0:25 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup "
    "cgroup rw,xattr,name=systemd\n"
)
V1_CONTROLLERS = "".join(
    f"{30 + i} 27 0:{26 + i} / /sys/fs/cgroup/{name} rw,nosuid,nodev,noexec,relatime "
    f"shared:{12 + i} - cgroup cgroup rw,{name}\n"
    for i, name in enumerate(("cpu,cpuacct", "memory", "devices", "pids", "freezer", "blkio"))
)
# Debian 11-13, Ubuntu 22.04+, RHEL 9: systemd's default since 247 on these distros
UNIFIED_HOST = ROOT_FS + SYSFS + V2_AT_ROOT
# Ubuntu 20.04, Debian 10 (systemd 241-245): v1 controllers, units tracked in cgroup2/unified
HYBRID_HOST = ROOT_FS + SYSFS + TMPFS_AT_ROOT + V2_AT_UNIFIED + V1_SYSTEMD + V1_CONTROLLERS
# RHEL 8 (systemd 239), or any host booted with systemd.legacy_systemd_cgroup_controller=1
LEGACY_HOST = ROOT_FS + SYSFS + TMPFS_AT_ROOT + V1_SYSTEMD + V1_CONTROLLERS


@pytest.mark.parametrize(
    ("mountinfo", "kind", "mount"),
    [
        (UNIFIED_HOST, UNIFIED, "/sys/fs/cgroup"),
        (HYBRID_HOST, HYBRID, "/sys/fs/cgroup/unified"),
        # the controllers listed before the unified mount: order of lines does not matter
        (ROOT_FS + TMPFS_AT_ROOT + V1_CONTROLLERS + V1_SYSTEMD + V2_AT_UNIFIED, HYBRID, None),
        (LEGACY_HOST, LEGACY, None),
        # v1 only, and a cgroup2 a container runtime or an operator mounted elsewhere: no tree
        # systemd puts units in
        (
            LEGACY_HOST + "90 22 0:50 / /mnt/cgroup2 rw - cgroup2 none rw\n",
            LEGACY,
            None,
        ),
        (LEGACY_HOST.replace("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/elogind"), LEGACY, None),
        # no cgroup file system mounted at all
        (ROOT_FS + SYSFS, LEGACY, None),
        ("", LEGACY, None),
        # a later mount on the same point hides the earlier one
        (ROOT_FS + V2_AT_ROOT + TMPFS_AT_ROOT + V1_CONTROLLERS, LEGACY, None),
        (ROOT_FS + TMPFS_AT_ROOT + V2_AT_ROOT, UNIFIED, "/sys/fs/cgroup"),
        # the unified mount of a hybrid host hidden by a tmpfs over it
        (
            HYBRID_HOST + "99 27 0:60 / /sys/fs/cgroup/unified rw - tmpfs tmpfs rw\n",
            LEGACY,
            None,
        ),
        # a cgroup v1 mount named "cgroup2" is still v1 (the file system type decides)
        (
            ROOT_FS
            + TMPFS_AT_ROOT
            + "28 27 0:24 / /sys/fs/cgroup/unified rw - cgroup cgroup2 rw\n",
            LEGACY,
            None,
        ),
        # truncated and junk lines are passed over
        (UNIFIED_HOST + "garbage\n41 1 0:1\n - \n", UNIFIED, "/sys/fs/cgroup"),
        # an escaped mount point elsewhere (space as \040) does not confuse the parse
        (
            HYBRID_HOST + "77 22 0:70 / /media/usb\\040disk rw - vfat /dev/sdb1 rw\n",
            HYBRID,
            "/sys/fs/cgroup/unified",
        ),
    ],
)
def test_layout_from_mountinfo(mountinfo: str, kind: str, mount: str | None) -> None:
    layout = cgroup_layout(mountinfo)
    assert layout.kind == kind
    if kind == LEGACY:
        assert layout.unified_mount is None
    elif mount is not None:
        assert layout.unified_mount == PurePosixPath(mount)


def test_this_machines_own_mountinfo_parses() -> None:
    """Whatever this machine is, its real mountinfo gives one of the three layouts."""
    layout = host_cgroup_layout(HostRoots())
    assert layout is not None and layout.kind in (UNIFIED, HYBRID, LEGACY)


def stand_in(tmp_path: Path, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    return proc


def test_roots_follow_the_layout(tmp_path: Path) -> None:
    sys_fs_cgroup = tmp_path / "sys-fs-cgroup"
    (sys_fs_cgroup / "unified").mkdir(parents=True)
    roots = HostRoots(dev=tmp_path, proc=tmp_path, cgroup=sys_fs_cgroup)
    unified = on_units_tree(roots, lambda _: cgroup_layout(UNIFIED_HOST))
    assert unified.cgroup == sys_fs_cgroup
    hybrid = on_units_tree(roots, lambda _: cgroup_layout(HYBRID_HOST))
    assert hybrid.cgroup == sys_fs_cgroup / "unified"
    assert (hybrid.dev, hybrid.proc) == (roots.dev, roots.proc)
    # the real roots: a hybrid host's unified tree is still one systemd can be asked about
    assert HostRoots(cgroup=Path("/sys/fs/cgroup/unified")).ask_systemd
    assert HostRoots().ask_systemd
    assert not hybrid.ask_systemd


@pytest.mark.message
@pytest.mark.parametrize("layout", [cgroup_layout(LEGACY_HOST), CgroupLayout(HYBRID, None)])
def test_a_v1_only_host_is_refused(tmp_path: Path, layout: CgroupLayout) -> None:
    with pytest.raises(HostUnsupported) as raised:
        on_units_tree(HostRoots(cgroup=tmp_path), lambda _: layout)
    message = raised.value.message
    assert "\n" not in message
    assert "systemd.unified_cgroup_hierarchy=1" in message  # the fix: the kernel's option
    assert raised.value.exit_code == ExitCode.HOST_UNSUPPORTED == 28


def test_a_hybrid_layout_without_its_unified_folder_is_refused(tmp_path: Path) -> None:
    with raises_error(HostUnsupported):
        on_units_tree(HostRoots(cgroup=tmp_path), lambda _: cgroup_layout(HYBRID_HOST))


def test_unreadable_mountinfo_is_one_line(tmp_path: Path) -> None:
    with raises_error(HostUnsupported):
        host_cgroup_layout(HostRoots(proc=tmp_path))


def run(
    host: FakeHost,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mountinfo: str,
    *argv: str,
    sys_fs_cgroup: Path | None = None,
) -> tuple[int, str]:
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root}/locks"\n[pre]\nsigterm_grace_s = 1\n')
    proc = stand_in(tmp_path, mountinfo)
    code = main(
        [*argv, "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=HostRoots(dev=host.dev, cgroup=sys_fs_cgroup or host.cgroup_root),
        reporter_factory=lambda unit, phase: host.reporter(phase),
        cgroup_layout=lambda roots: host_cgroup_layout(HostRoots(proc=proc)),
    )
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [["pre", "vllm.service"], ["post", "vllm.service"], ["status"]])
def test_pre_post_and_status_on_a_v1_only_host_kill_nothing(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(orphan, {1}, 500)
    (in_unit,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(in_unit, {1}, 500)
    host.put_in_unit(in_unit)
    code, err = run(host, tmp_path, capsys, LEGACY_HOST, *command)
    assert code == ExitCode.HOST_UNSUPPORTED
    assert err.count("\n") == 1 and err.startswith("gpugate: ")  # one line, no traceback
    assert alive(orphan) and alive(in_unit)


def test_a_hybrid_host_is_served_from_its_unified_tree(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """post kills the unit's process from the unified tree; a process that the v1 name=systemd
    tree (same unit path, a different hierarchy) lists is not the unit's and lives on."""
    sys_fs_cgroup = tmp_path / "sys-fs-cgroup"
    sys_fs_cgroup.mkdir()
    (sys_fs_cgroup / "unified").symlink_to(host.cgroup_root)
    (worker,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(worker, {0}, 4096)
    host.put_in_unit(worker)
    (host.root / "bystander-file").write_text("")
    (bystander,) = host.pool.holder([host.root / "bystander-file"])
    v1_unit = sys_fs_cgroup / "systemd" / UNIT_CGROUP.lstrip("/")
    v1_unit.mkdir(parents=True)
    (v1_unit / "cgroup.procs").write_text(f"{bystander}\n")
    code, err = run(
        host, tmp_path, capsys, HYBRID_HOST, "post", "vllm.service", sys_fs_cgroup=sys_fs_cgroup
    )
    assert code == 0, err
    assert not alive(worker)
    assert alive(bystander)


def test_status_on_a_hybrid_host_names_the_units_cgroup(
    host: FakeHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys_fs_cgroup = tmp_path / "sys-fs-cgroup"
    sys_fs_cgroup.mkdir()
    (sys_fs_cgroup / "unified").symlink_to(host.cgroup_root)
    (worker,) = host.pool.holder(host.gpu_files(3))
    host.memory.claim(worker, {3}, 1000)
    host.put_in_unit(worker)
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root}/locks"\n')
    proc = stand_in(tmp_path, HYBRID_HOST)
    code = main(
        ["status", "vllm.service", "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=HostRoots(dev=host.dev, cgroup=sys_fs_cgroup),
        cgroup_layout=lambda roots: host_cgroup_layout(HostRoots(proc=proc)),
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["unit_cgroup"] == UNIT_CGROUP
    assert alive(worker)
