"""gpugate's own state (locks, leases, failed-start records, metrics) that cannot be written is
exit 73 with one line naming the folder and the cause, found before anything is killed: a
full file system, a read-only one, a file where a folder should be, for each state folder."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpugate.errors import ExitCode, GateError, StateUnwritable
from gpugate.front.cli import main
from gpugate.host.locks import check_writable
from gpugate.integrations.records import Lease, lease_path, write_lease
from gpugate.phase import Phase
from tests.fakes import UNIT, FakeHost, alive

REPO = Path(__file__).resolve().parents[2]


def in_private_tmpfs(tmp_path: Path, mount_options: str, fill: bool, code: str) -> str:
    """Run `code` (python, with FOLDER bound to the tmpfs) in a mount namespace of its own
    with a 64 KiB tmpfs mounted on tmp_path/fs, filled to the last byte where fill; returns
    what it printed."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    folder = tmp_path / "fs"
    folder.mkdir()
    filler = f"dd if=/dev/zero of={folder}/filler bs=4k 2>/dev/null;" if fill else ""
    remount = f"mount -o remount,ro {folder};" if "ro" in mount_options.split(",") else ""
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {folder} && {filler} {remount} "
        f"exec {sys.executable} -c {_quote(f'from pathlib import Path; FOLDER = Path({str(folder)!r}); {code}')}"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


PROBE = (
    "from gpugate.host.locks import check_writable\n"
    "from gpugate.errors import StateUnwritable\n"
    "try:\n"
    "    check_writable(FOLDER / 'sub', 'GPU leases')\n"
    "    print('ok')\n"
    "except StateUnwritable as exc:\n"
    "    print(int(exc.exit_code), exc.message)\n"
)


@pytest.mark.parametrize(
    ("options", "fill", "cause"),
    [
        ("rw", True, "No space left on device"),
        ("ro", False, "Read-only file system"),
    ],
)
@pytest.mark.root("a private tmpfs in a mount namespace of its own")
def test_a_full_or_read_only_file_system_is_exit_73(
    tmp_path: Path, options: str, fill: bool, cause: str
) -> None:
    said = in_private_tmpfs(tmp_path, options, fill, PROBE)
    code, _, message = said.partition(" ")
    assert code == "73", said
    assert message.startswith(f"{tmp_path / 'fs' / 'sub'}: ") and message.endswith(cause)
    assert "\n" not in message


@pytest.mark.root("a private tmpfs in a mount namespace of its own")
def test_space_freed_is_writable_again(tmp_path: Path) -> None:
    code = (
        "from gpugate.host.locks import check_writable\n"
        "from gpugate.errors import StateUnwritable\n"
        "(FOLDER / 'sub').mkdir()\n"
        "try:\n"
        "    check_writable(FOLDER / 'sub', 'GPU locks')\n"
        "except StateUnwritable as exc:\n"
        "    print(exc.code)\n"
        "(FOLDER / 'filler').unlink()\n"
        "check_writable(FOLDER / 'sub', 'GPU locks')\n"
        "print('freed:', sorted(p.name for p in (FOLDER / 'sub').iterdir()))\n"
    )
    # The folder is made before the filler: a full tmpfs has no inode-free page for mkdir.
    said = in_private_tmpfs(tmp_path, "rw", True, code).splitlines()
    assert said[0] == "state-os-error", said  # ENOSPC: the OS's own error
    assert said[1] == "freed: []", "the probe leaves nothing behind"


@pytest.mark.parametrize("below", ["", "deeper"])
def test_a_file_where_a_folder_should_be(tmp_path: Path, below: str) -> None:
    (tmp_path / "leases").write_text("")
    folder = tmp_path / "leases" / below if below else tmp_path / "leases"
    what = "GPU leases"
    with pytest.raises(StateUnwritable) as raised:
        check_writable(folder, what)
    assert raised.value.exit_code is ExitCode.STATE_UNWRITABLE
    assert (raised.value.path, raised.value.what) == (folder, what)


@pytest.mark.parametrize(
    ("phase", "blocked", "what"),
    [
        ("pre", "locks/leases", "GPU leases"),
        ("pre", "locks/failed", "failed-start records"),
        ("pre", "locks", "GPU locks"),
        ("prolog", "locks", "GPU locks"),
    ],
)
def test_nothing_is_killed_when_a_start_cannot_record_its_state(
    host: FakeHost, phase: str, blocked: str, what: str
) -> None:
    """Before a start (state_required): each state folder it writes, a file in its way: the
    run ends before the kill, exit 73; it must not start ungated."""
    assert Phase(phase).traits.state_required
    (orphan,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(orphan)
    path = host.root / blocked
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    loaded = host.config(metrics_textfile=host.root / "textfile" / "gpugate.prom")
    with pytest.raises(StateUnwritable) as raised:
        host.run_phase(phase, loaded, host.reporter(phase), driver_factory=lambda: host.memory)
    assert (raised.value.path, raised.value.what) == (path, what)
    assert alive(orphan)
    assert host.journal.events("signal_sent") == []


@pytest.mark.parametrize("phase", ["post", "epilog"])
@pytest.mark.parametrize("blocked", ["locks", "locks/leases"])
def test_after_a_stop_the_kills_go_on_when_state_cannot_be_written(
    host: FakeHost, phase: str, blocked: str
) -> None:
    """After a stop (state_required false), lock_dir or its leases folder with a file in the
    way: the leftovers die all the same, the run's result is its own (0), and the journal
    says what could not be recorded (GPUGATE_REASON)."""
    assert not Phase(phase).traits.state_required
    (orphan,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(orphan)
    path = host.root / blocked
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    loaded = host.config()
    summary = host.run_phase(
        phase, loaded, host.reporter(phase), driver_factory=lambda: host.memory
    )
    assert summary.exit_code is ExitCode.OK
    assert not alive(orphan)
    reasons = {e.get("GPUGATE_REASON") for e in host.journal.events("warning")}
    if blocked == "locks":
        assert {"state-unwritable", "lock-not-taken"} <= reasons, reasons
    else:
        assert phase != "post" or "state-not-recorded" in reasons, reasons


def test_a_lease_that_cannot_be_written_stops_pre_before_the_kill(host: FakeHost) -> None:
    """The probe passes (the folder is fine) but the lease itself cannot be put in place: pre
    writes its lease before the kill, so the orphan lives and the run ends 73, not 70."""
    (orphan,) = host.pool.holder(host.gpu_files(0))
    (host.root / "locks" / "leases" / "vllm.service.json").mkdir(parents=True)
    with pytest.raises(StateUnwritable) as raised:
        host.run_phase(
            "pre", host.config(gpus=[0]), host.reporter("pre"), driver_factory=lambda: host.memory
        )
    assert raised.value.exit_code is ExitCode.STATE_UNWRITABLE
    assert Path(str(raised.value.path)) == host.root / "locks" / "leases" / "vllm.service.json"
    assert alive(orphan)
    assert host.journal.events("signal_sent") == []


CLONE_NEWNS = 0x00020000


def in_own_mounts(
    prepare: Callable[[], None], work: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """work() in a forked copy of this (root) process with a mount namespace of its own
    (private: nothing it mounts reaches the host's), after prepare(); its JSON-able result
    comes back through a pipe."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a private tmpfs")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        code = 99
        try:
            os.close(read_end)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=30)
            prepare()
            os.write(write_end, json.dumps(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        data: dict[str, Any] = json.loads(reader.read() or "{}")
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child failed"
    return data


def run_in(host: FakeHost, phase: str) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        try:
            summary = host.run_phase(
                phase, host.config(), host.reporter(phase), driver_factory=lambda: host.memory
            )
            code = int(summary.exit_code)
        except GateError as exc:
            code = int(exc.exit_code)
        lease = lease_path(host.root / "locks", UNIT)
        warnings = [e.get("GPUGATE_REASON", "") for e in host.journal.events("warning")]
        return {"code": code, "warnings": warnings, "lease": lease.exists()}

    return work


def sh(line: str) -> None:
    subprocess.run(["sh", "-ec", line], check=True, timeout=30)


def prepare_lock_dir(kind: str, locks: Path, uuids: list[str]) -> Callable[[], None]:
    """lock_dir as a 64 KiB tmpfs holding the unit's lease and its GPUs' lock files (as pre
    leaves them), then filled to the last byte (without the lock file too), or made
    read-only; or missing below a read-only tmpfs."""

    def prepare() -> None:
        if kind == "missing":
            sh(f"mount -t tmpfs -o size=64k,ro tmpfs {locks.parent}")
            return
        sh(f"mount -t tmpfs -o size=64k tmpfs {locks}")
        write_lease(locks, Lease(UNIT, (0,), (uuids[0],), share=False, since=1.0))
        if kind != "full-no-lock-file":
            for uuid in uuids:
                (locks / f"{uuid}.lock").touch()
        if kind.startswith("full"):
            sh(f"dd if=/dev/zero of={locks}/filler bs=4k 2>/dev/null || true")
        if kind == "read-only":
            sh(f"mount -o remount,ro {locks}")

    return prepare


LOCK_DIRS = ["full", "full-no-lock-file", "read-only", "missing"]


@pytest.mark.parametrize("lock_dir", LOCK_DIRS)
@pytest.mark.parametrize("phase", ["pre", "post", "epilog"])
@pytest.mark.root("a private tmpfs in a mount namespace of its own")
def test_a_full_read_only_or_missing_lock_dir(host: FakeHost, phase: str, lock_dir: str) -> None:
    """pre refuses before the kill (exit 73, its lease could not be recorded); post and
    epilog kill the unit's leftovers all the same, with the result they would have had (0),
    and say what they could not record. Removing a lease needs no space: a full lock_dir's
    lease is gone after post; a read-only one's stays (a stale lease, said)."""
    (orphan,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(orphan)
    locks = host.root / "locks"
    if lock_dir == "missing":
        (host.root / "ro").mkdir()
        locks = host.root / "ro" / "locks"
    else:
        locks.mkdir()
    prepare = prepare_lock_dir(lock_dir, locks, [g.uuid for g in host.memory.gpus()])
    real = host.config
    host.config = lambda **o: real(**{"lock_dir": locks, **o})  # type: ignore[method-assign]
    said = in_own_mounts(prepare, run_in(host, phase))
    if phase == "pre":
        assert said["code"] == ExitCode.STATE_UNWRITABLE, said
        assert alive(orphan)
        return
    assert said["code"] == ExitCode.OK, said
    assert not alive(orphan)
    assert "state-unwritable" in said["warnings"], said
    if lock_dir in ("full", "full-no-lock-file", "read-only"):
        # there, or made (an empty file takes no data block): taken, read-only included
        assert "lock-not-taken" not in said["warnings"], said
    if phase == "post" and lock_dir.startswith("full"):
        assert not said["lease"], "removing a lease needs no space"
    if phase == "post" and lock_dir == "read-only":
        assert said["lease"] and "state-not-recorded" in said["warnings"], said
    if lock_dir == "missing":  # nor can it be made: the kills go on without the lock
        assert "lock-not-taken" in said["warnings"], said


@pytest.mark.parametrize("phase", ["pre", "post"])
@pytest.mark.parametrize("kind", ["full", "read-only"])
@pytest.mark.root("a private tmpfs in a mount namespace of its own")
def test_a_full_or_read_only_metrics_folder_is_a_warning(
    host: FakeHost, phase: str, kind: str
) -> None:
    """The metrics textfile's folder a full (or read-only) 64 KiB tmpfs: the run kills and
    ends as without metrics (0), the journal says the metrics were not written."""
    (member,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(member)
    folder = host.root / "metrics"
    folder.mkdir()
    config = host.root / "gpugate.toml"
    config.write_text(
        f'metrics_textfile = "{folder}/gpugate.prom"\nlock_dir = "{host.root}/locks"\n'
        "[pre]\nsigterm_grace_s = 1\nsigkill_wait_s = 1\n"
        "[post]\nsigterm_grace_s = 1\nsigkill_wait_s = 1\n"
    )

    def prepare() -> None:
        sh(f"mount -t tmpfs -o size=64k tmpfs {folder}")
        if kind == "full":
            sh(f"dd if=/dev/zero of={folder}/filler bs=4k 2>/dev/null || true")
        else:
            sh(f"mount -o remount,ro {folder}")

    def work() -> dict[str, Any]:
        code = main(
            [phase, UNIT, "--config", str(config)],
            driver_factory=lambda: host.memory,
            reporter_factory=lambda unit, phase, **_: host.reporter(phase),
            roots=host.roots,
        )
        reasons = [e.get("GPUGATE_REASON", "") for e in host.journal.events("warning")]
        return {"code": code, "warnings": reasons, "errors": len(host.journal.events("error"))}

    said = in_own_mounts(prepare, work)
    assert said == {"code": 0, "warnings": ["metrics-unwritable"], "errors": 0}, said
    assert not alive(member)
