"""host/safe_files.py, atomic.py, locks.py and the metrics writer: the rule of who may change a
path, over owner/mode/folder combinations; every kind of path where a file is expected (FIFO,
socket, device, symbolic link, huge file) refused without reading it or blocking; and a
symbolic link planted in a folder another account may write never makes root create, write or
chmod its target (docs/hardening.md, rule 2)."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpugate.errors import ExitCode, NotRegularFile, StateUnwritable, TooLarge, UnsafeLink
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import Gpu
from gpugate.host.safe_files import (
    MAX_BYTES,
    Exposure,
    open_folder,
    read_capped,
    untrusted,
    write_atomically,
)
from gpugate.integrations.metrics import record_run, run_record

OTHER = 65534  # nobody: an account that is neither root nor the one running the tests
needs_root = pytest.mark.root("chown to another account")


def expected(entries: list[tuple[int, int]]) -> Exposure | None:
    """The rule, stated independently: entries from the file up to the top folder, each
    (uid, mode); the first that another account may change, else None."""
    trusted = {0, os.geteuid()}
    below_trusted = True
    for uid, mode in entries:
        if uid not in trusted:
            return Exposure.OWNER
        sticky = stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and below_trusted
        if mode & 0o002 and not sticky:
            return Exposure.WORLD_WRITABLE
        if mode & 0o020 and not sticky:
            return Exposure.GROUP_WRITABLE
    return None


OWNERS = st.sampled_from([0, OTHER])
FOLDER_MODES = st.sampled_from([0o755, 0o700, 0o775, 0o757, 0o777, 0o1777, 0o1775, 0o1755])
FILE_MODES = st.sampled_from([0o644, 0o600, 0o664, 0o666, 0o646, 0o400])


@needs_root
@settings(max_examples=60, deadline=None)
@given(
    folders=st.lists(st.tuples(OWNERS, FOLDER_MODES), min_size=1, max_size=3),
    file=st.tuples(OWNERS, FILE_MODES),
)
def test_untrusted_follows_the_rule(
    tmp_path_factory: pytest.TempPathFactory,
    folders: list[tuple[int, int]],
    file: tuple[int, int],
) -> None:
    base = tmp_path_factory.mktemp("trust")  # root's, under sticky /tmp: trusted
    current = base
    made = []
    for index, (uid, mode) in enumerate(folders):
        current = current / f"d{index}"
        current.mkdir()
        made.append((current, uid, mode | stat.S_IFDIR))
    target = current / "c.toml"
    target.write_text("gpus = 'all'\n")
    os.chown(target, file[0], -1)
    os.chmod(target, file[1])
    for path, uid, mode in made:
        os.chown(path, uid, -1)
        os.chmod(path, stat.S_IMODE(mode))
    chain = [(file[0], file[1] | stat.S_IFREG)] + [(uid, mode) for _, uid, mode in reversed(made)]
    found = untrusted(target)
    assert (found.problem if found else None) == expected(chain), (chain, found)
    if found is not None:
        assert found.of == str(target)
        assert found.path in {str(target), *(str(path) for path, _, _ in made)}


def test_the_test_folders_are_trusted(tmp_path: Path) -> None:
    """pytest's folders (root's or the runner's, under sticky /tmp) pass the rule, so the
    suite's configs in tmp_path are read as in production; a missing name directly in a sticky
    folder does not (another account could make it first)."""
    (tmp_path / "c.toml").write_text("")
    assert untrusted(tmp_path / "c.toml") is None
    assert untrusted(tmp_path / "not-yet" / "locks") is None
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    missing = untrusted(sticky / "not-yet")
    assert missing is not None and missing.problem is Exposure.WORLD_WRITABLE


@needs_root
def test_a_link_is_judged_as_written_and_as_resolved(tmp_path: Path) -> None:
    theirs = tmp_path / "home"
    theirs.mkdir()
    os.chown(theirs, OTHER, -1)
    root_file = tmp_path / "root.toml"
    root_file.write_text("")
    link = theirs / "c.toml"
    link.symlink_to(root_file)  # root's file, but a link the account may point elsewhere
    found = untrusted(link)
    assert found is not None and found.path == str(theirs) and found.problem is Exposure.OWNER
    good = tmp_path / "good.toml"
    good.symlink_to(theirs / "real.toml")
    (theirs / "real.toml").write_text("")
    assert untrusted(good) is not None  # resolves into the account's folder


def kinds(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()
    folder = tmp_path / "folder"
    folder.mkdir()
    link = tmp_path / "link"
    (tmp_path / "real").write_text("x = 1\n")
    link.symlink_to(tmp_path / "real")
    huge = tmp_path / "huge"
    with huge.open("wb") as handle:
        handle.truncate(MAX_BYTES + 1)
    return {
        "fifo": fifo,
        "socket": sock_path,
        "character-device": Path("/dev/null"),
        "folder": folder,
        "symlink": link,
        "huge": huge,
    }


def test_read_capped_refuses_every_kind_without_reading(tmp_path: Path) -> None:
    for kind, path in kinds(tmp_path).items():
        if kind == "huge":
            with pytest.raises(TooLarge):
                read_capped(path)
            continue
        with pytest.raises(NotRegularFile) as caught:
            read_capped(path)  # a FIFO with no writer would block a plain open
        assert caught.value.kind == kind
    assert read_capped(tmp_path / "real") == b"x = 1\n"


def test_locks_refuse_every_kind(tmp_path: Path) -> None:
    gpu = Gpu(0, "GPU-aaaa", 0, "stand-in", 80000)
    for kind, path in kinds(tmp_path).items():
        if kind in {"huge", "character-device"}:
            continue
        lock_dir = tmp_path / f"locks-{kind}"
        lock_dir.mkdir()
        path.rename(lock_dir / f"{gpu.uuid}.lock")
        with pytest.raises(StateUnwritable), gpu_locks(lock_dir, [gpu], deadline=0):
            pass


def plant(tmp_path: Path) -> tuple[Path, Path]:
    """A folder another account may write, and a root file outside it that must not change."""
    theirs = tmp_path / "exporter"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, OTHER, -1)
    victim = tmp_path / "victim.conf"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    return theirs, victim


def assert_untouched(victim: Path) -> None:
    assert victim.read_text() == "root's\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_atomic_write_replaces_a_planted_link_never_its_target(tmp_path: Path) -> None:
    theirs, victim = plant(tmp_path)
    (theirs / "gpugate.prom").symlink_to(victim)
    write_atomically(theirs / "gpugate.prom", "metrics\n")
    assert_untouched(victim)
    assert not (theirs / "gpugate.prom").is_symlink()
    assert stat.S_IMODE((theirs / "gpugate.prom").stat().st_mode) == 0o644
    assert [p.name for p in theirs.iterdir()] == ["gpugate.prom"]


def test_metrics_never_create_or_chmod_through_planted_links(tmp_path: Path) -> None:
    theirs, victim = plant(tmp_path)
    missing = tmp_path / "created-by-root"
    (theirs / "gpugate.prom.lock").symlink_to(missing)
    with pytest.raises(NotRegularFile):
        record_run(theirs / "gpugate.prom", run_record("pre", "vllm.service", ExitCode.OK, None))
    assert not missing.exists()
    (theirs / "gpugate.prom.lock").unlink()
    for name in ("gpugate.prom", "gpugate.prom.state"):
        (theirs / name).symlink_to(victim)
    record_run(theirs / "gpugate.prom", run_record("pre", "vllm.service", ExitCode.OK, None))
    assert_untouched(victim)
    assert "gpugate_runs_total" in (theirs / "gpugate.prom").read_text()


@needs_root
def test_a_linked_folder_in_an_untrusted_folder_is_never_followed(tmp_path: Path) -> None:
    theirs, _ = plant(tmp_path)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    (theirs / "textfile").symlink_to(elsewhere)
    os.lchown(theirs / "textfile", OTHER, -1)
    with pytest.raises(UnsafeLink):
        write_atomically(theirs / "textfile" / "gpugate.prom", "metrics\n")
    assert list(elsewhere.iterdir()) == []


def test_a_link_in_a_trusted_folder_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to("real")
    fd = open_folder(tmp_path / "alias" / "made")
    os.close(fd)
    assert (real / "made").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        open_folder(tmp_path / "file" / "x")


@needs_root
def test_an_exporters_folder_is_written_safely_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpugate.integrations.metrics import record_after_run

    theirs, victim = plant(tmp_path)  # Debian's /var/lib/prometheus is prometheus's
    (theirs / "gpugate.prom").symlink_to(victim)
    for phase in ("pre", "post"):
        record = run_record(phase, "vllm.service", ExitCode.OK, None)
        record_after_run(theirs / "gpugate.prom", record, stream=sys.stderr, on_failure=print)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(theirs) in err  # one warning, naming the folder
    assert_untouched(victim)
    assert "gpugate_runs_total" in (theirs / "gpugate.prom").read_text()


@needs_root
def test_the_state_probe_never_writes_through_a_planted_folder_link(tmp_path: Path) -> None:
    from gpugate.host.locks import check_writable

    theirs, _ = plant(tmp_path)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    (theirs / "textfile").symlink_to(elsewhere)
    with pytest.raises(StateUnwritable):
        check_writable(theirs / "textfile", "metrics")
    assert list(elsewhere.iterdir()) == []
    check_writable(theirs / "real", "metrics")  # made there, probed, left empty
    assert list((theirs / "real").iterdir()) == []
