"""The shared memory a killed application leaves in /dev/shm (issue 21), over real processes and
real files in a stand-in DEV/shm: which files go (those only the killed held, by device and
inode), which stay (held by a process not killed, by a protected daemon, reopened or replaced
before the unlink, never held at all), how the names in /proc are read (subfolders, spaces,
newlines, " (deleted)"), the dry run, the setting that turns it off, and exit 29."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpugate.config.file import parse_config
from gpugate.config.schema import GateConfig
from gpugate.core.outcome import RunSummary
from gpugate.core.shm_cleanup import FreshHolders, Kept, ShmHost
from gpugate.errors import ConfigError, ExitCode
from gpugate.front.commands.status import as_dict, render_table
from gpugate.front.hook import collect
from gpugate.host.scan import HostShm, scan_device_users
from gpugate.host.shm import (
    FileFacts,
    ShmArea,
    ShmFile,
    ShmKey,
    area_of,
    find_areas,
    maps_key,
    maps_names,
    mount_points,
    unlink_if_same,
)
from gpugate.phase import Phase
from tests.fakes import FakeHost, alive, start_time_of

SEGMENT_BYTES = 64 * 1024

# Holds files as its arguments say, then writes READY and sleeps:
#   dev:PATH     a device file open (a GPU holder)
#   open:PATH    a segment created, open and mapped (multiprocessing's SharedMemory)
#   mapped:PATH  created, mapped, fd closed (sem_open, NCCL's and torch's segments)
#   semaphore:PATH  as glibc's sem_open: made under a temporary name, mapped, linked to PATH,
#                the temporary name unlinked (maps shows "sem.XXXXXX (deleted)")
#   deleted:PATH created, mapped, then unlinked (the kernel's " (deleted)")
#   reopen:PATH  an existing file opened (a bystander that attaches to it)
#   leader-exit  the main thread exits after the files are held; another thread lives on
HOLDER = textwrap.dedent(
    """
    import ctypes, os, sys, threading, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    ready, size, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    kept = []
    def segment(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, b"x" * size)
        address = libc.mmap(None, size, 3, 1, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        return fd
    def hold():
        for spec in specs:
            kind, _, path = spec.partition(":")
            if kind == "dev":
                kept.append(os.open(path, os.O_RDONLY))
            elif kind == "open":
                kept.append(segment(path))
            elif kind == "mapped":
                os.close(segment(path))
            elif kind == "semaphore":  # glibc's sem_open: a temporary name, linked, unlinked
                temporary = os.path.join(os.path.dirname(path), "sem.Xk3q9Z")
                os.close(segment(temporary))
                os.link(temporary, path)
                os.unlink(temporary)
            elif kind == "deleted":
                os.close(segment(path))
                os.unlink(path)
            elif kind == "reopen":
                kept.append(os.open(path, os.O_RDONLY))
    if "leader-exit" in specs:
        specs.remove("leader-exit")
        def thread():
            hold()
            while os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/fd/{kept[0]}"):
                time.sleep(0.01)  # until the leader's own thread is gone (a zombie)
            open(ready, "w").write("ok")
            time.sleep(3600)
        threading.Thread(target=thread).start()
        ctypes.CDLL(None).pthread_exit(None)
    hold()
    open(ready, "w").write("ok")
    time.sleep(3600)
    """
)


@pytest.fixture
def shm(host: FakeHost) -> Path:
    folder = host.dev / "shm"
    folder.mkdir()
    return folder


def hold(host: FakeHost, *specs: str) -> int:
    """A real process holding files as the specs say; its PID once it holds them."""
    ready = host.root / f"held-{len(host.pool.popens)}"
    proc = host.pool.command([sys.executable, "-c", HOLDER, str(ready), str(SEGMENT_BYTES), *specs])
    deadline = time.monotonic() + 15
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the holder did not start"
        time.sleep(0.01)
    return proc.pid


def gpu_holder(host: FakeHost, *specs: str, gpu: int = 0) -> int:
    pid = hold(host, f"dev:{host.dev / f'nvidia{gpu}'}", *specs)
    host.memory.claim(pid, {gpu}, 20000)
    return pid


def run(host: FakeHost, phase: str = "pre", **config: object) -> RunSummary:
    config.setdefault("gpus", [0, 1, 2, 3])
    dry_run = bool(config.pop("dry_run", False))
    shm_host = config.pop("shm_host", None)
    return host.run_phase(
        phase,
        host.config(**config),
        host.reporter(phase),
        driver_factory=lambda: host.memory,
        dry_run=dry_run,
        **({"shm_host": shm_host} if shm_host else {}),
    )


def removed_paths(host: FakeHost) -> set[str]:
    return {e["GPUGATE_SHM_PATH"] for e in host.journal.events("shm_removed")}


def kept(host: FakeHost) -> dict[str, str]:
    """Each kept file and why, as its code (GPUGATE_REASON)."""
    return {e["GPUGATE_SHM_PATH"]: e["GPUGATE_REASON"] for e in host.journal.events("shm_kept")}


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_segments_of_a_stale_app_go_and_nothing_else(host: FakeHost, shm: Path) -> None:
    (shm / "sub" / "dir").mkdir(parents=True)
    theirs = [
        shm / "psm_5f3a",  # open and mapped
        shm / "sem.mp-k2x9",  # mapped only, by a temporary name, as sem_open leaves it
        shm / "nccl-Qx7Lm2",  # mapped only
        shm / "sub" / "dir" / "torch_12",  # in a subfolder
        shm / "with space",
        shm / "new\nline",  # maps shows "\\012"
        shm / "lit\\012eral",  # a real backslash: maps shows the same "\\012"
        shm / "ends (deleted)",  # not deleted: the suffix is part of its name
    ]
    worker = gpu_holder(
        host,
        f"open:{theirs[0]}",
        f"semaphore:{theirs[1]}",
        f"mapped:{theirs[2]}",
        f"open:{theirs[3]}",
        f"mapped:{theirs[4]}",
        f"mapped:{theirs[5]}",
        f"open:{theirs[6]}",
        f"mapped:{theirs[7]}",
    )
    keep = shm / "psm_keep"
    bystander = hold(host, f"open:{keep}")  # a live Python program with its own segment
    unheld = shm / "psm_unheld"
    unheld.write_bytes(b"y" * 4096)  # nobody holds it: never removed by name
    (shm / "lit\n012eral").write_bytes(b"z")  # what the other reading of that maps name says

    summary = run(host)

    assert summary.exit_code is ExitCode.OK
    assert not alive(worker) and alive(bystander)
    for path in theirs:
        assert not path.exists(), path
    assert keep.exists() and unheld.exists() and (shm / "lit\n012eral").exists()
    assert removed_paths(host) == {str(path) for path in theirs}
    for entry in host.journal.events("shm_removed"):
        assert int(entry["GPUGATE_SHM_BYTES"]) >= SEGMENT_BYTES
        assert entry["GPUGATE_SHM_HOLDERS"] == str(worker)
    assert not host.journal.events("shm_kept")


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_the_rest_of_the_application_counts_too(host: FakeHost, shm: Path) -> None:
    """A process that holds no GPU, taken with its application (the API server, the resource
    tracker): its segments are the killed's as well."""
    tracker_file = shm / "sem.mp-tracker"
    script = host.root / "app.sh"
    (host.root / "claims").mkdir()
    host.memory.claim_dir = host.root / "claims"
    script.write_text(
        f"{sys.executable} -c {shlex.quote(HOLDER)} {host.root}/helper-ready {SEGMENT_BYTES} "
        f"mapped:{tracker_file} &\n"
        f"exec 3<{host.dev / 'nvidia1'}\nsleep 3600 &\necho 1 500 > {host.root}/claims/$!\n"
        "wait\n"
    )
    app = host.pool.command(["setsid", "/bin/bash", str(script)])
    deadline = time.monotonic() + 15
    while not (host.root / "helper-ready").exists():
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.01)
    summary = run(host)
    assert summary.exit_code is ExitCode.OK
    assert not alive(app.pid)
    assert not tracker_file.exists()
    assert removed_paths(host) == {str(tracker_file)}


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_a_segment_also_held_by_a_process_not_killed_stays(host: FakeHost, shm: Path) -> None:
    shared, with_other_unit, own = shm / "psm_shared", shm / "psm_other", shm / "psm_own"
    worker = gpu_holder(host, f"open:{shared}", f"open:{with_other_unit}", f"open:{own}")
    # A protected daemon (by executable) holding a GPU and the shared segment.
    daemon_exe = host.root / "nvidia-persistenced"
    shutil.copy("/bin/sleep", daemon_exe)
    daemon = host.pool.command(
        ["/bin/bash", "-c", f"exec 3<{host.dev / 'nvidia0'} 4<{shared} {daemon_exe} 3600"]
    ).pid
    deadline = time.monotonic() + 15
    while os.path.realpath(f"/proc/{daemon}/exe") != str(daemon_exe):
        assert time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.01)
    # Another unit's process (no GPU, not in the application): it attached to the segment.
    other = hold(host, f"reopen:{with_other_unit}")
    host.put_in_unit(other, cgroup="/system.slice/other.service")

    summary = run(host, protected_executables=[str(daemon_exe)])

    assert summary.exit_code is ExitCode.OK
    assert not alive(worker) and alive(daemon) and alive(other)
    assert shared.exists() and with_other_unit.exists() and not own.exists()
    assert kept(host) == {str(shared): "shm-also-held", str(with_other_unit): "shm-also-held"}
    assert removed_paths(host) == {str(own)}


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_a_worker_whose_leader_thread_exited_is_read_from_its_threads(
    host: FakeHost, shm: Path
) -> None:
    segment, mapped = shm / "psm_thread", shm / "nccl-thread"
    pid = hold(
        host, f"dev:{host.dev / 'nvidia2'}", f"open:{segment}", f"mapped:{mapped}", "leader-exit"
    )
    host.put_in_unit(pid)  # (the fake NVML lists no process whose leader is a zombie)
    assert not os.listdir(f"/proc/{pid}/fd"), "the leader should be a zombie"
    scan = scan_device_users(Path("/proc"), None, shm_areas=find_areas(host.dev, Path("/proc")))
    assert {file.path for file in scan.shm[pid]} == {str(segment), str(mapped)}

    assert run(host).exit_code is ExitCode.OK
    assert not os.path.exists(f"/proc/{pid}/task") or os.listdir(f"/proc/{pid}/task") == [
        str(pid)
    ], "the live thread should be gone"
    assert not segment.exists() and not mapped.exists()
    assert removed_paths(host) == {str(segment), str(mapped)}


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_a_deleted_mapping_is_shown_and_a_new_file_of_its_name_stays(
    host: FakeHost, shm: Path
) -> None:
    name = shm / "psm_gone"
    worker = gpu_holder(host, f"deleted:{name}")
    name.write_bytes(b"new")  # someone made a new file of the same name since
    data = as_dict(collect(None, host.config(), host.memory, host.roots), host.config())
    (shown,) = [h for h in data["holders"] if h["pid"] == worker]
    assert shown["shm"] == [{"path": f"{name} (deleted)", "bytes": None}]

    assert run(host).exit_code is ExitCode.OK
    assert name.read_bytes() == b"new"
    assert not removed_paths(host)
    assert kept(host) == {str(name): "shm-gone"}


def test_status_shows_each_holders_shm_and_the_free_space(host: FakeHost, shm: Path) -> None:
    worker = gpu_holder(host, f"open:{shm / 'psm_a'}", f"mapped:{shm / 'psm_b'}")
    data = as_dict(collect(None, host.config(), host.memory, host.roots), host.config())
    (shown,) = [h for h in data["holders"] if h["pid"] == worker]
    assert [item["path"] for item in shown["shm"]] == [str(shm / "psm_a"), str(shm / "psm_b")]
    assert shown["shm_bytes"] >= 2 * SEGMENT_BYTES
    (area,) = data["shm"]
    assert area["path"] == os.path.realpath(shm)
    assert 0 <= area["free_bytes"] <= area["total_bytes"]
    table = render_table(data)
    assert " SHM " in table and f"{os.path.realpath(shm)}: " in table


def test_dry_run_removes_nothing_and_lists_what_would_go(host: FakeHost, shm: Path) -> None:
    files = [shm / "psm_1", shm / "sem.mp-2", shm / "nccl-3"]
    worker = gpu_holder(host, f"open:{files[0]}", f"semaphore:{files[1]}", f"mapped:{files[2]}")
    keep = shm / "psm_keep"
    hold(host, f"open:{keep}")

    assert run(host, dry_run=True).exit_code is ExitCode.OK

    assert alive(worker) and all(path.exists() for path in files)
    would = host.journal.events("shm_removed")
    assert {e["GPUGATE_SHM_PATH"] for e in would} == {str(path) for path in files}
    assert all(e["GPUGATE_DRY_RUN"] == "1" for e in would)


@pytest.mark.parametrize("phase", ["pre", "post"])
def test_remove_shm_false_leaves_every_file(host: FakeHost, shm: Path, phase: str) -> None:
    segment = shm / "psm_x"
    worker = gpu_holder(host, f"open:{segment}")
    host.put_in_unit(worker)
    assert run(host, phase, **{phase: {"remove_shm": False}}).exit_code is ExitCode.OK
    assert not alive(worker) and segment.exists()
    assert not host.journal.events("shm_removed") and not host.journal.events("shm_kept")


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_post_removes_the_units_own_segments(host: FakeHost, shm: Path) -> None:
    segment = shm / "psm_unit"
    worker = gpu_holder(host, f"mapped:{segment}")
    host.put_in_unit(worker)
    assert run(host, "post").exit_code is ExitCode.OK
    assert not segment.exists()


def test_too_little_free_space_fails_pre_with_exit_29(host: FakeHost, shm: Path) -> None:
    big = shm / "psm_big"
    big.write_bytes(b"b" * (4 * SEGMENT_BYTES))  # held by nobody: it stays, and is named
    free_mib = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize // (1024 * 1024)

    summary = run(host, shm_min_free_mib=free_mib + 1024)

    assert summary.exit_code is ExitCode.SHM_SPACE
    (error,) = [e for e in host.journal.events("error") if e.get("GPUGATE_EXIT_CODE") == "29"]
    assert error["GPUGATE_SHM_NEEDED_BYTES"] == str((free_mib + 1024) * 1024 * 1024)
    assert int(error["GPUGATE_SHM_FREE_BYTES"]) < int(error["GPUGATE_SHM_NEEDED_BYTES"])
    assert big.exists()  # held by no process: not the run's to remove
    (finished,) = host.journal.events("run_finished")
    assert finished["GPUGATE_RESULT"] == "shm_space"
    assert big.exists()


def test_enough_free_space_passes_and_post_never_checks(host: FakeHost, shm: Path) -> None:
    assert run(host, shm_min_free_mib=1).exit_code is ExitCode.OK
    free_mib = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize // (1024 * 1024)
    assert run(host, "post", shm_min_free_mib=free_mib + 1024).exit_code is ExitCode.OK


# The race: what happens between the kill and the unlink.


class Meddling:
    """The real host, with something done to the files just before the fresh look."""

    def __init__(self, real: HostShm, meddle: Callable[[], None]) -> None:
        self.real, self.meddle = real, meddle

    def holders(self) -> FreshHolders:
        self.meddle()
        return self.real.holders()

    def facts(self, file: ShmFile) -> FileFacts | None:
        return self.real.facts(file)

    def unlink(self, file: ShmFile, allowed: Callable[[FileFacts], bool]) -> object:
        return self.real.unlink(file, allowed)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def meddling(host: FakeHost, meddle: Callable[[], None]) -> Callable[[list[ShmArea]], ShmHost]:
    return lambda areas: Meddling(HostShm(areas, Path("/proc")), meddle)  # type: ignore[return-value]


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_a_segment_reopened_after_the_kill_stays(host: FakeHost, shm: Path) -> None:
    reopened, other = shm / "psm_reopened", shm / "psm_other"
    worker = gpu_holder(host, f"open:{reopened}", f"open:{other}")
    attached: list[int] = []

    summary = run(
        host, shm_host=meddling(host, lambda: attached.append(hold(host, f"reopen:{reopened}")))
    )

    assert summary.exit_code is ExitCode.OK
    assert not alive(worker) and alive(attached[0])
    assert reopened.exists() and not other.exists()
    assert kept(host) == {str(reopened): "shm-held-now"}
    (entry,) = host.journal.events("shm_kept")
    assert entry["GPUGATE_SHM_HOLDERS"] == str(worker)  # the killed holder; the new one lives


@pytest.mark.root("the killed's fds and maps are read as root reads them")
def test_a_segment_replaced_under_its_name_after_the_kill_stays(host: FakeHost, shm: Path) -> None:
    replaced = shm / "psm_replaced"
    worker = gpu_holder(host, f"open:{replaced}")

    def replace() -> None:
        # A new file renamed over the name, as tools do (made while the old inode exists: a
        # disk file system would hand a freed inode number straight out again; tmpfs counts up).
        new = replaced.with_name(".new")
        new.write_bytes(b"a new server's segment")
        new.replace(replaced)

    assert run(host, shm_host=meddling(host, replace)).exit_code is ExitCode.OK
    assert not alive(worker)
    assert replaced.read_bytes() == b"a new server's segment"
    assert kept(host) == {str(replaced): "shm-gone"}


def test_unlink_checks_the_inode_and_never_follows_a_swapped_folder(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    (folder / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    area = ShmArea(str(folder), os.stat(folder).st_dev)
    target = folder / "sub" / "seg"
    target.write_bytes(b"1")
    info = os.stat(target)
    file = ShmFile(ShmKey(info.st_dev, info.st_ino), (str(target),))
    # The folder is swapped for a symlink to a folder holding the very same inode (a hard link).
    os.link(target, outside / "seg")
    target.unlink()
    (folder / "sub").rmdir()
    (folder / "sub").symlink_to(outside)
    assert unlink_if_same([area], file).facts is None
    assert (outside / "seg").exists()
    # Outside every area, or on another device: never.
    assert unlink_if_same([ShmArea(str(folder), info.st_dev + 1)], file).facts is None


@pytest.mark.root("a tmpfs in a private mount namespace")
def test_a_container_s_own_dev_shm_is_another_device(host: FakeHost, shm: Path) -> None:
    """A process in another mount namespace with its own tmpfs at the same path: its fd names
    the same path as a host file, but the device differs; the host's file stays."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a tmpfs in a private mount namespace")
    host_file = shm / "psm_same_name"
    host_file.write_bytes(b"host")
    ready = host.root / "container-ready"
    inner = (
        f"mount -t tmpfs none {shm} && exec {sys.executable} -c {shlex.quote(HOLDER)} {ready} "
        f"{SEGMENT_BYTES} dev:{host.dev / 'nvidia3'} open:{host_file}"
    )
    proc = host.pool.command(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner])
    deadline = time.monotonic() + 15
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the container did not start"
        time.sleep(0.01)
    host.pool.started.append((proc.pid, start_time_of(proc.pid)))
    host.memory.claim(proc.pid, {3}, 20000)

    assert run(host).exit_code is ExitCode.OK
    assert not alive(proc.pid)
    assert host_file.read_bytes() == b"host"
    assert not host.journal.events("shm_removed") and not host.journal.events("shm_kept")


def test_an_unreadable_process_keeps_every_file(tmp_path: Path) -> None:
    """Where a fresh look could not read every process's files, nothing is removed."""
    from gpugate.core.shm_cleanup import ShmLedger, remove

    class Blind:
        def holders(self) -> FreshHolders:
            return FreshHolders({}, [4242])

        def facts(self, file: ShmFile) -> FileFacts | None:
            return FileFacts(file.path, 1, 1, 0)

        def unlink(self, file: ShmFile, allowed: object) -> object:
            raise AssertionError("must not unlink")

    ledger = ShmLedger()
    ledger.note({10: [ShmFile(ShmKey(1, 2), ("/dev/shm/psm_q",))]})
    (result,) = remove(ledger, {10}, Blind(), str)  # type: ignore[arg-type]
    assert result.kept is Kept.UNREADABLE and result.kept_by == ("PID 4242",)


def test_areas_come_from_dev_and_from_mountinfo(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw\n"
        "31 25 0:29 / /run/shm rw,relatime - tmpfs tmpfs rw\n"
        "40 25 0:30 / /mnt/with\\040space rw - tmpfs tmpfs rw\n"
    )
    assert mount_points(proc) == {"/dev/shm", "/run/shm", "/mnt/with space"}
    assert mount_points(tmp_path / "no-proc") == set()
    # DEV/shm a symlink (as /dev/shm -> /run/shm on old Debian): the area is its target.
    dev, target = tmp_path / "dev", tmp_path / "real-shm"
    dev.mkdir()
    target.mkdir()
    (dev / "shm").symlink_to(target)
    areas = find_areas(dev, tmp_path / "no-proc")
    assert [area.path for area in areas] == [str(target)]
    assert areas[0].dev == os.stat(target).st_dev
    assert area_of(areas, str(target / "sub" / "x")) == areas[0]
    assert area_of(areas, str(target) + "x") is None
    assert find_areas(tmp_path / "no-dev", tmp_path / "no-proc") == []


def test_maps_names_and_keys() -> None:
    assert maps_names("/dev/shm/a b") == ("/dev/shm/a b",)
    assert maps_names("/dev/shm/new\\012line") == ("/dev/shm/new\\012line", "/dev/shm/new\nline")
    key = maps_key(b"7f00-7f10 rw-s 00000000 00:1b 4242      ")
    assert key == ShmKey(os.makedev(0, 0x1B), 4242)
    assert maps_key(b"garbage") is None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("shm_min_free_mib = 0", "shm_min_free_mib"),
        ('shm_min_free_mib = "16G"', "shm_min_free_mib"),
        ("shm_min_free_mib = 1.5", "shm_min_free_mib"),
        ('[pre]\nremove_shm = "yes"', "pre.remove_shm"),
        ("[epilog]\nremove_shm = 1", "epilog.remove_shm"),
    ],
)
def test_bad_shm_settings_name_file_and_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "f.toml")
    assert str(raised.value).startswith(f"f.toml: {field}: ") and "\n" not in str(raised.value)


def test_shm_settings_defaults_and_per_phase() -> None:
    config = parse_config("shm_min_free_mib = 16384\n[post]\nremove_shm = false", "f.toml")
    assert config.shm_min_free_mib == 16384
    assert [config.policy(p).remove_shm for p in Phase] == [
        True,
        False,
        True,
        True,
    ]
    assert config.post.kill_orphans is False, "a partial [post] keeps post's defaults"
    assert GateConfig().shm_min_free_mib is None
