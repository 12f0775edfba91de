"""gpugate's own state (locks, leases, failed-start records, metrics) that cannot be written is
exit 73 with one line naming the folder and the cause, found before anything is killed: a
full file system, a read-only one, a file where a folder should be, for each state folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, StateUnwritable
from gpugate.host.state_dirs import check_writable
from tests.fakes import FakeHost, alive

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
    "from gpugate.host.state_dirs import check_writable\n"
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
def test_a_full_or_read_only_file_system_is_exit_73(
    tmp_path: Path, options: str, fill: bool, cause: str
) -> None:
    said = in_private_tmpfs(tmp_path, options, fill, PROBE)
    code, _, message = said.partition(" ")
    assert code == "73", said
    assert message.startswith(f"{tmp_path / 'fs' / 'sub'}: ") and message.endswith(cause)
    assert "\n" not in message


def test_space_freed_is_writable_again(tmp_path: Path) -> None:
    code = (
        "from gpugate.host.state_dirs import check_writable\n"
        "from gpugate.errors import StateUnwritable\n"
        "(FOLDER / 'sub').mkdir()\n"
        "try:\n"
        "    check_writable(FOLDER / 'sub', 'GPU locks')\n"
        "except StateUnwritable as exc:\n"
        "    print('full:', exc.message)\n"
        "(FOLDER / 'filler').unlink()\n"
        "check_writable(FOLDER / 'sub', 'GPU locks')\n"
        "print('freed: ok', sorted(p.name for p in (FOLDER / 'sub').iterdir()))\n"
    )
    # The folder is made before the filler: a full tmpfs has no inode-free page for mkdir.
    said = in_private_tmpfs(tmp_path, "rw", True, code).splitlines()
    assert said[0].startswith("full: ") and "No space left on device" in said[0], said
    assert said[1] == "freed: ok []", "the probe leaves nothing behind"


@pytest.mark.parametrize("below", ["", "deeper"])
def test_a_file_where_a_folder_should_be(tmp_path: Path, below: str) -> None:
    (tmp_path / "leases").write_text("")
    folder = tmp_path / "leases" / below if below else tmp_path / "leases"
    with pytest.raises(StateUnwritable) as raised:
        check_writable(folder, "GPU leases")
    assert raised.value.exit_code is ExitCode.STATE_UNWRITABLE
    assert (raised.value.path, raised.value.what) == (folder, "GPU leases")


@pytest.mark.parametrize(
    ("phase", "blocked", "what"),
    [
        ("pre", "locks/leases", "GPU leases"),
        ("pre", "locks/failed", "failed-start records"),
        ("pre", "textfile", "metrics"),
        ("post", "textfile", "metrics"),
        ("pre", "locks", "GPU locks"),
        ("post", "locks", "GPU locks"),
    ],
)
def test_nothing_is_killed_when_state_cannot_be_written(
    host: FakeHost, phase: str, blocked: str, what: str
) -> None:
    """Each state folder a phase writes, a file in its way: the run ends before the kill."""
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


def test_a_lease_that_cannot_be_written_stops_pre_before_the_kill(host: FakeHost) -> None:
    """The probe passes (the folder is fine) but the lease itself cannot be put in place: pre
    writes its lease before the kill, so the orphan lives and the run ends 73, not 70."""
    (orphan,) = host.pool.holder(host.gpu_files(0))
    (host.root / "locks" / "leases" / "vllm.service.json").mkdir(parents=True)
    with pytest.raises(StateUnwritable) as raised:
        host.run_phase(
            "pre", host.config(gpus=[0]), host.reporter("pre"), driver_factory=lambda: host.memory
        )
    assert raised.value.message.startswith(
        f"{host.root}/locks/leases/vllm.service.json: cannot write the GPU lease there: "
    )
    assert alive(orphan)
    assert host.journal.events("signal_sent") == []
