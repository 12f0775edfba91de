"""Issue 26, rule 3: only what the killed could write goes. A /dev/shm file is removed only where
a killed process held it open for reading or writing (not only through O_PATH) or mapped it,
and that process's account could have removed it itself (owner, mode, groups, the sticky
folder). Over fdinfo flag combinations, /proc/PID/status texts, owners, modes and groups (the
kernel itself is the oracle: a child with those credentials tries), and real processes holding
real files through a phase run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpugate.core.outcome import RunSummary
from gpugate.core.shm_cleanup import Kept, ShmLedger, could_remove, plan
from gpugate.errors import ExitCode
from gpugate.host.shm import (
    O_PATH,
    Credentials,
    FileFacts,
    ShmFile,
    ShmKey,
    fd_opens_file,
    parse_status,
)
from tests.fakes import FakeHost, alive

needs_root = pytest.mark.root("drops to other accounts")
UID, GID, GROUP = 64021, 64021, 64022  # accounts no one on the machine has
OTHER_FLAGS = [0o0, 0o1, 0o2, 0o100, 0o200, 0o400, 0o2000, 0o4000, 0o40000, 0o100000, 0o2000000]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(OTHER_FLAGS), max_size=5), st.booleans(), st.integers(0, 64))
@example([0o2], False, 5)  # O_RDWR
@example([0o2000000], True, 7)  # O_PATH | O_CLOEXEC: what open(..., O_PATH) leaves
def test_an_o_path_fd_is_never_evidence(flags: list[int], path: bool, mnt: int) -> None:
    value = 0
    for flag in flags:
        value |= flag
    value |= O_PATH if path else 0
    text = f"pos:\t0\nflags:\t{value:07o}\nmnt_id:\t{mnt}\nino:\t42\n"
    assert fd_opens_file(text) is not path


@pytest.mark.parametrize("text", ["", "pos:\t0\n", "flags:\tzz\n", "flags:\t\n", "flags: 9\n"])
def test_unreadable_flags_are_no_evidence(text: str) -> None:
    assert not fd_opens_file(text)


def test_the_real_kernel_flags_read_as_expected(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"x")
    for flags, opens in [(os.O_RDONLY, True), (os.O_RDWR, True), (os.O_WRONLY, True)]:
        fd = os.open(target, flags)
        try:
            assert fd_opens_file(Path(f"/proc/self/fdinfo/{fd}").read_text()) is opens
        finally:
            os.close(fd)
    fd = os.open(target, O_PATH)
    try:
        assert not fd_opens_file(Path(f"/proc/self/fdinfo/{fd}").read_text())
    finally:
        os.close(fd)


def status_text(uid: int, gid: int, groups: list[int], caps: int) -> str:
    return (
        "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\n"
        f"Uid:\t{uid}\t0\t0\t0\nGid:\t{gid}\t0\t0\t0\n"
        f"Groups:\t{' '.join(map(str, groups))} \nCapInh:\t0000000000000000\n"
        f"CapPrm:\t{caps:016x}\nCapEff:\t{caps:016x}\n"
    )


@given(
    st.integers(0, 2**32 - 2),
    st.integers(0, 2**32 - 2),
    st.lists(st.integers(0, 2**32 - 2), max_size=5),
    st.integers(0, 2**41 - 1),
)
def test_status_gives_the_real_credentials(
    uid: int, gid: int, groups: list[int], caps: int
) -> None:
    """Real uid and gid (the first column), groups, and root's privilege only as uid 0 with
    CAP_DAC_OVERRIDE and CAP_FOWNER in effect; effective ids of 0 give nothing."""
    found = parse_status(status_text(uid, gid, groups, caps))
    assert found is not None
    assert (found.uid, found.gid, found.groups) == (uid, gid, frozenset(groups))
    assert found.privileged == (uid == 0 and caps & 0b1010 == 0b1010)


@pytest.mark.parametrize("text", ["", "Uid:\tx\n", "Uid:\t1\t1\t1\t1\n", "Gid:\t1\n"])
def test_a_status_without_ids_gives_none(text: str) -> None:
    assert parse_status(text) is None


def kernel_allows(who: Credentials, file: Path) -> bool:
    """What a child with WHO's credentials manages: write the file (its owner may chmod it
    first) and unlink its name."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = False
        try:
            os.setgroups(sorted(who.groups))
            os.setresgid(who.gid, who.gid, who.gid)
            os.setresuid(who.uid, who.uid, who.uid)
            try:
                os.close(os.open(file, os.O_WRONLY))
            except PermissionError:
                os.chmod(file, 0o600)  # only the owner may
                os.close(os.open(file, os.O_WRONLY))
            os.unlink(file)
            ok = True
        except OSError:
            pass
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.fixture(scope="module")
def playground() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="gpugate-rule3-", dir="/dev/shm"))
    folder.chmod(0o755)  # every account may reach what is below
    yield folder
    shutil.rmtree(folder)


IDS = st.sampled_from([0, UID, UID + 1])
GIDS = st.sampled_from([0, GID, GROUP])
MODES = st.sampled_from([0o600, 0o644, 0o640, 0o660, 0o666, 0o602, 0o400, 0o000, 0o620])
FOLDER_MODES = st.sampled_from([0o1777, 0o777, 0o775, 0o1775, 0o755, 0o1733, 0o733, 0o770])


@needs_root
@settings(max_examples=250, deadline=None)
@given(IDS, GIDS, MODES, IDS, GIDS, FOLDER_MODES, st.frozensets(GIDS, max_size=2))
@example(0, 0, 0o600, 0, 0, 0o1777, frozenset())  # root's 0600 file in /dev/shm
@example(UID, GID, 0o600, 0, 0, 0o1777, frozenset())  # the account's own segment
@example(0, 0, 0o666, 0, 0, 0o1777, frozenset())  # root's, writable by all: not unlinkable
def test_could_remove_is_what_the_kernel_lets_the_account_do(
    playground: Path,
    file_uid: int,
    file_gid: int,
    mode: int,
    folder_uid: int,
    folder_gid: int,
    folder_mode: int,
    groups: frozenset[int],
) -> None:
    folder = Path(tempfile.mkdtemp(dir=playground))
    target = folder / "psm_x"
    target.write_bytes(b"x")
    os.chown(target, file_uid, file_gid)
    target.chmod(mode)
    os.chown(folder, folder_uid, folder_gid)
    folder.chmod(folder_mode)
    who = Credentials(UID, GID, groups)
    facts = FileFacts(
        str(target), 4096, 1, file_uid, file_gid, mode, folder_uid, folder_gid, folder_mode
    )
    try:
        assert could_remove(who, facts) == kernel_allows(who, target)
    finally:
        shutil.rmtree(folder)


def test_root_with_its_capabilities_may_and_the_ledger_needs_an_opened_holder() -> None:
    root = Credentials(0, 0, frozenset(), privileged=True)
    facts = FileFacts("/dev/shm/x", 1, 1, 1000, 1000, 0o600, 0, 0, 0o1777)
    assert could_remove(root, facts)
    assert not could_remove(Credentials(0, 0, frozenset()), facts)  # capabilities dropped
    key = ShmKey(1, 2)
    ledger = ShmLedger()
    ledger.note({10: [ShmFile(key, ("/dev/shm/x",), opened=False, holder=root)]})
    ledger.note({11: [ShmFile(key, ("/dev/shm/x",), opened=True, holder=root)]})

    class Facts:
        def facts(self, file: ShmFile) -> FileFacts:
            return facts

    (only_path,) = plan(ledger, {10}, Facts(), str)  # type: ignore[arg-type]
    assert only_path.kept is Kept.ALSO_HELD  # 11, not killed, holds it
    (both,) = plan(ledger, {10, 11}, Facts(), str)  # type: ignore[arg-type]
    assert both.kept is None and both.holders == (10, 11)
    ledger = ShmLedger()
    ledger.note({10: [ShmFile(key, ("/dev/shm/x",), opened=False, holder=root)]})
    (alone,) = plan(ledger, {10}, Facts(), str)  # type: ignore[arg-type]
    assert alone.kept is Kept.PATH_ONLY


# Real processes: open the files as root, then become the account, then hold them.
HOLDER = textwrap.dedent(
    """
    import mmap, os, sys, time
    ready, uid, gid, groups, specs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    kept = []
    for spec in specs:
        kind, _, path = spec.partition(":")
        if kind == "path":
            kept.append(os.open(path, os.O_PATH))
        elif kind == "rw":
            kept.append(os.open(path, os.O_RDWR))
        elif kind == "ro":
            kept.append(os.open(path, os.O_RDONLY))
        elif kind == "map":
            fd = os.open(path, os.O_RDWR)
            kept.append(mmap.mmap(fd, 4096))
            os.close(fd)
        elif kind == "dev":
            kept.append(os.open(path, os.O_RDONLY))
    signal = open(ready + ".part", "w")  # opened as root: written once the account holds
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    signal.write("ok")
    signal.close()
    time.sleep(3600)
    """
)


@pytest.fixture
def shm(host: FakeHost) -> Path:
    folder = host.dev / "shm"
    folder.mkdir()
    folder.chmod(0o1777)  # as /dev/shm is
    return folder


def hold_as(host: FakeHost, uid: int, gid: int, groups: str, *specs: str) -> int:
    ready = host.root / f"held-{len(host.pool.popens)}"
    argv = [sys.executable, "-c", HOLDER, str(ready), str(uid), str(gid), groups, *specs]
    proc = host.pool.command(argv)
    deadline = time.monotonic() + 15
    part = Path(f"{ready}.part")
    while not (part.exists() and part.read_text() == "ok"):
        assert time.monotonic() < deadline and proc.poll() is None, "the holder did not start"
        time.sleep(0.01)
    host.memory.claim(proc.pid, {0}, 20000)
    return proc.pid


def make(path: Path, uid: int, gid: int, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"s" * 4096)
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def run(host: FakeHost, dry_run: bool = False) -> RunSummary:
    return host.run_phase(
        "pre",
        host.config(gpus=[0, 1, 2, 3]),
        host.reporter("pre"),
        driver_factory=lambda: host.memory,
        dry_run=dry_run,
    )


def kept(host: FakeHost) -> dict[str, str]:
    return {e["GPUGATE_SHM_PATH"]: e["GPUGATE_REASON"] for e in host.journal.events("shm_kept")}


def removed(host: FakeHost) -> set[str]:
    return {e["GPUGATE_SHM_PATH"] for e in host.journal.events("shm_removed")}


@needs_root
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_orphan_holding_roots_file_through_o_path_is_killed_and_the_file_stays(
    host: FakeHost, shm: Path, dry_run: bool
) -> None:
    """Issue 26's case: root's 0600 /dev/shm/root-cache, held by a stale orphan through O_PATH,
    and beside it the orphan's own segment, open for reading and writing: that one goes."""
    roots_file = make(shm / "root-cache", 0, 0, 0o600)
    own = make(shm / "psm_own", UID, GID, 0o600)
    mapped = make(shm / "psm_mapped", UID, GID, 0o600)
    pid = hold_as(
        host,
        UID,
        GID,
        "",
        f"dev:{host.dev / 'nvidia0'}",
        f"path:{roots_file}",
        f"rw:{own}",
        f"map:{mapped}",
    )
    assert run(host, dry_run).exit_code is ExitCode.OK
    assert alive(pid) is dry_run
    assert roots_file.read_bytes() == b"s" * 4096
    assert kept(host) == {str(roots_file): "shm-path-only"}
    assert removed(host) == {str(own), str(mapped)}
    assert own.exists() is dry_run and mapped.exists() is dry_run


@needs_root
def test_what_the_account_could_not_remove_stays(host: FakeHost, shm: Path) -> None:
    """Held open for writing, but another account's: root's 0666 file in the sticky folder
    (any account may write it, only root may unlink it), root's 0644 file read, another
    account's group-writable file. In a folder that is not sticky and the account may write,
    what it may write goes: a 0666 file, a file of a supplementary group's with g+w."""
    sticky_roots = make(shm / "shared-0666", 0, 0, 0o666)
    read_only = make(shm / "root-0644", 0, 0, 0o644)
    others = make(shm / "bob-0660", UID + 1, GROUP, 0o660)
    open_folder = shm / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    writable = make(open_folder / "shared-0666", 0, 0, 0o666)
    by_group = make(open_folder / "group-0660", UID + 1, GROUP, 0o660)
    not_group = make(open_folder / "group-0640", UID + 1, GROUP, 0o640)
    pid = hold_as(
        host,
        UID,
        GID,
        str(GROUP),
        f"dev:{host.dev / 'nvidia0'}",
        *(f"rw:{p}" for p in (sticky_roots, others, writable, by_group)),
        f"ro:{read_only}",
        f"ro:{not_group}",
    )
    assert run(host).exit_code is ExitCode.OK
    assert not alive(pid)
    stays = {sticky_roots, read_only, others, not_group}
    assert kept(host) == {str(p): "shm-not-theirs" for p in stays}
    assert all(p.exists() for p in stays)
    assert removed(host) == {str(writable), str(by_group)}
    assert not writable.exists() and not by_group.exists()
