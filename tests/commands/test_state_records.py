"""Issue 26, rule 7: gpugate's own state never crashes it. A lease, failed-start record or metrics
state that does not parse to sane values (NaN, Infinity, huge numbers, wrong types, deep
nesting, megabytes, not a regular file) is named once with why and ignored: `pre`, `post` and
`status` go on with the rest, never exit 70. And every pass is bounded: the /proc scan stops
at the deadline, the /dev/shm walk has no recursion."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpugate.core.discover import Discovery
from gpugate.core.outcome import BlindSpots
from gpugate.core.run import RunScope
from gpugate.errors import BadRecord, ExitCode
from gpugate.front.cli import main
from gpugate.front.commands.status import unreadable_warning
from gpugate.host.scan import Deadline, scan_device_users
from gpugate.host.shm import MAX_WALK_DEPTH, ShmArea, inode_index, largest_files, regular_files
from gpugate.integrations.metrics import record_run
from gpugate.integrations.records import (
    Lease,
    failed_pre_from,
    failed_pre_of_this_start,
    failure_path,
    lease_from,
    new_lease,
    parse_record,
    read_leases,
    read_record,
    write_lease,
)
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.report.narrate import Narrator
from tests.fakes import UNIT, UNIT_CGROUP, FakeHost, alive, run_unit_phase

GOOD = {
    "unit": "other.service",
    "gpus": [0],
    "uuids": ["GPU-fa4e5a11-0000-0000-0000-000000000000"],
    "share": False,
    "since": 1700000000.5,
    "invocation_id": "abc",
    "pid": 42,
    "started_by": None,
}
# Members of the class: each a whole file's text, or a lease with one field made hostile.
HOSTILE_TEXTS = {
    "Infinity": "Infinity",
    "NaN": '{"unit": NaN}',
    "minus-infinity": "[-Infinity]",
    "overflow": '{"since": 1e999}',
    "huge-int": json.dumps({**GOOD, "pid": 10**400})[:-1] + "}",
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep-object": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "megabytes": json.dumps({**GOOD, "started_by": "x" * 3_000_000}),
    "not-utf8": b'{"unit": "\xff"}',
    "a-list": "[1, 2, 3]",
    "empty": "",
    "torn": '{"unit": "other.serv',
}
HOSTILE_FIELDS: dict[str, dict[str, Any]] = {
    "gpus-infinite": {"gpus": [float("inf")]},
    "gpus-nan": {"gpus": [float("nan")]},
    "gpus-huge": {"gpus": [10**18]},
    "gpus-bool": {"gpus": [True]},
    "gpus-a-string": {"gpus": "0"},
    "gpus-nested": {"gpus": [[[[0]]]]},
    "since-nan": {"since": float("nan")},
    "since-infinite": {"since": float("inf")},
    "since-negative": {"since": -1},
    "since-huge": {"since": 1e300},
    "since-a-string": {"since": "yesterday"},
    "share-a-string": {"share": "yes"},
    "pid-bool": {"pid": True},
    "pid-negative": {"pid": -5},
    "unit-a-number": {"unit": 5},
    "unit-null": {"unit": None},
    "uuids-objects": {"uuids": [{"a": 1}]},
    "uuids-many": {"uuids": ["GPU-x"] * 100_000},
    "invocation-a-list": {"invocation_id": ["x"]},
}


def lease_text(name: str) -> str | bytes:
    if name in HOSTILE_TEXTS:
        return HOSTILE_TEXTS[name]
    return json.dumps({**GOOD, **HOSTILE_FIELDS[name]})  # NaN, Infinity as Python writes them


ALL = sorted(HOSTILE_TEXTS) + sorted(HOSTILE_FIELDS)


def plant(locks: Path, name: str, text: str | bytes) -> Path:
    path = locks / "leases" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize("member", ALL)
def test_a_hostile_lease_is_named_with_why_and_ignored(host: FakeHost, member: str) -> None:
    locks = host.root / "locks"
    gpus = [g for g in host.memory.gpus() if g.index == 3]
    write_lease(locks, new_lease("good.service", gpus, share=False))
    bad = plant(locks, "other.service.json", lease_text(member))
    files = read_leases(locks)
    assert [lease.unit for lease in files.leases] == ["good.service"]
    assert list(files.unreadable) == [bad] and files.unreadable[bad]


def test_a_fifo_symlink_or_folder_is_not_read(host: FakeHost, tmp_path: Path) -> None:
    locks = host.root / "locks"
    (locks / "leases").mkdir(parents=True)
    os.mkfifo(locks / "leases" / "fifo.service.json")  # a read would block for ever
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**GOOD, "unit": "link.service"}))
    (locks / "leases" / "link.service.json").symlink_to(secret)
    (locks / "leases" / "dir.service.json").mkdir()
    done: list[Any] = []
    reader = threading.Thread(target=lambda: done.append(read_leases(locks)), daemon=True)
    reader.start()
    reader.join(10)
    assert done, "read_leases blocked on a FIFO"
    (files,) = done
    assert files.leases == [] and len(files.unreadable) == 3
    assert all(files.unreadable.values())  # each unread one, with its why


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=50),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
lease_like = st.fixed_dictionaries(
    {},
    optional={key: json_values for key in GOOD},
).map(lambda d: {**{k: v for k, v in GOOD.items() if k not in d}, **d})


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(json_values, lease_like))
def test_any_json_parses_to_a_sane_record_or_is_refused(data: Any) -> None:
    text = json.dumps(data)  # NaN and Infinity too, as Python writes them
    try:
        record = parse_record(text)
    except BadRecord:
        return
    for build in (lease_from, failed_pre_from):
        try:
            built = build(record)
        except BadRecord:
            continue
        for value in built._asdict().values():
            if isinstance(value, float):
                assert math.isfinite(value)
            if isinstance(value, int):
                assert abs(value) < 2**41
        if isinstance(built, Lease):
            time.strftime("%Y", time.localtime(built.since))  # what refusals print
            assert built.holder_text()


def run(host: FakeHost, phase: str, **kwargs: Any) -> Any:
    reporter = Reporter(UNIT, phase, journal=host.journal, notifier=host.notifier, echo=False)
    return run_unit_phase(
        RunScope(Phase(phase), UNIT, lambda: UNIT_CGROUP),
        kwargs.pop("loaded", host.config(gpus=[0, 1])),
        reporter,
        roots=host.roots,
        driver_factory=lambda: host.memory,
        **kwargs,
    )


@pytest.mark.parametrize("member", ["Infinity", "deep", "megabytes", "gpus-infinite", "since-nan"])
def test_pre_and_status_go_on_past_a_hostile_lease(
    host: FakeHost, member: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (member_pid,) = host.pool.holder(host.gpu_files(0))
    host.put_in_unit(member_pid)
    locks = host.root / "locks"
    gpus = [g for g in host.memory.gpus() if g.index == 5]
    write_lease(locks, new_lease("good.service", gpus, share=False))
    bad = plant(locks, "other.service.json", lease_text(member))

    summary = run(host, "pre", unit_state=lambda unit: "active")
    assert summary.exit_code is ExitCode.OK and not alive(member_pid)
    (warned,) = [
        e for e in host.journal.events("warning") if e["GPUGATE_REASON"] == "lease-unreadable"
    ]
    assert warned["MESSAGE"].startswith(str(bad))  # named, and gone on without it

    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{locks}"\n')
    code = main(
        ["status", "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(lease["unit"] for lease in json.loads(out)["leases"]) == ["good.service", UNIT]
    assert err.count(str(bad)) == 1  # one warning naming it


@pytest.mark.parametrize("member", ["Infinity", "deep", "overflow", "not-utf8", "a-list"])
def test_post_goes_on_past_a_hostile_failed_start_record(host: FakeHost, member: str) -> None:
    locks = host.root / "locks"
    path = failure_path(locks, UNIT)
    path.parent.mkdir(parents=True)
    text = HOSTILE_TEXTS[member]
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    (left,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(left)
    hook = {"INVOCATION_ID": "f00d", "SERVICE_RESULT": "exit-code"}
    said: list[tuple[Path, str]] = []
    assert failed_pre_of_this_start(locks, UNIT, hook, lambda p, why: said.append((p, why))) is None
    assert said and said[0][0] == path

    summary = run(host, "post", environ=hook)
    assert summary.exit_code is ExitCode.OK and not alive(left)
    warned = [
        e
        for e in host.journal.events("warning")
        if e["GPUGATE_REASON"] == "failed-start-unreadable"
    ]
    assert len(warned) == 1 and warned[0]["MESSAGE"].startswith(f"{path}: ")  # named


def test_a_hostile_metrics_state_restarts_the_counters(tmp_path: Path) -> None:
    hostile = ("Infinity", "[" * 100_000, '{"version": 1, "samples": {"x": [{"value": NaN}]}}')
    seen: list[dict[str, Any]] = []
    for text in (*hostile, '{"version": 1, "samples": []}'):
        (tmp_path / "m.prom.state").write_text(text)
        record_run(tmp_path / "m.prom", lambda samples: seen.append(dict(samples)))
    assert seen == [{}] * 4


def test_read_record_refuses_what_is_larger_than_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(" " * (65 * 1024) + "{}")
    with pytest.raises(BadRecord):
        read_record(path)


# -- bounded passes --------------------------------------------------------------------------


def test_the_fd_walk_stops_at_the_deadline(host: FakeHost) -> None:
    """A process holding tens of thousands of fds (millions on a real host) cannot hold a run
    past its deadline: what is left unread is named (cut_short), not waited for."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    many = min(hard, 70_000)
    if many < 5000:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: too few fds to hold")
    ready = host.root / "many-ready"
    script = (
        "import os, resource, sys, time\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({many}, {many}))\n"
        f"held = [os.open('/dev/null', os.O_RDONLY) for _ in range({many} - 64)]\n"
        f"gpu = open({str(host.gpu_files(2)[-1])!r}, 'rb')\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(3600)\n"
    )
    proc = host.pool.command([sys.executable, "-c", script])
    host.pool.until(ready.exists, "the process with many fds did not start", 60)
    prefix = os.path.join(os.fspath(host.dev), "nvidia")

    found = scan_device_users(Path("/proc"), prefix)
    assert proc.pid in found.users and proc.pid not in found.cut_short

    ticks = iter(range(10**9))
    # A clock that says the deadline passed after a few looks: every look is counted.
    cut = scan_device_users(Path("/proc"), prefix, deadline=Deadline(3, lambda: next(ticks)))
    assert cut.cut_short, "the scan read past its deadline"
    # A deadline already past: the scan stops at once, saying it was cut short.
    assert scan_device_users(
        Path("/proc"), prefix, deadline=Deadline(time.monotonic() - 1)
    ).cut_short


DEEP = 1500  # deeper than Python's recursion limit (os.walk recursed, up to 3.11)


def test_the_shm_walk_has_no_recursion_and_a_depth_bound(tmp_path: Path) -> None:
    area_path = tmp_path / "shm"
    area_path.mkdir()
    area = ShmArea(str(area_path), area_path.stat().st_dev)
    try:
        make_deep(area_path, DEEP)
        (area_path / "psm_top").write_bytes(b"y" * 100_000)
        near = area_path
        for _ in range(MAX_WALK_DEPTH):
            near = near / "n"
            near.mkdir()
        (near / "near").write_bytes(b"z")
        names = {Path(path).name for path, _ in regular_files(area)}
        assert names == {"psm_top", "near"}
        assert len(inode_index([area])) == 2
        assert [f.path for _, f in largest_files([area], 1)] == [str(area_path / "psm_top")]
    finally:
        remove_deep(area_path / "d")  # pytest's own cleanup (shutil.rmtree) recurses too


def make_deep(top: Path, depth: int) -> None:
    """top/d/d/.../d/far, by fds (the path is longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("far", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    os.close(fd)


def remove_deep(top: Path) -> None:
    """What make_deep made, however far it got, from the far end, by fds."""
    if not top.exists():
        return
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    for name in os.listdir(fds[-1]):
        os.unlink(name, dir_fd=fds[-1])
    for parent, child in zip(reversed(fds[:-1]), reversed(fds[1:])):
        os.close(child)
        os.rmdir("d", dir_fd=parent)
    os.close(fds[0])
    top.rmdir()


@pytest.mark.message
def test_what_the_deadline_left_unread_is_said(host: FakeHost) -> None:
    left = list(range(100, 125))
    discovery = Discovery(
        unit=UNIT,
        unit_cgroup=UNIT_CGROUP,
        gpus=[],
        owned=[],
        usage={},
        holders={},
        self_chain=frozenset(),
        unreadable=[],
        cut_short=left,
    )
    narrator = Narrator(
        Reporter(UNIT, "pre", journal=host.journal, notifier=host.notifier, echo=False)
    )
    narrator.tell(BlindSpots(discovery))
    (warned,) = host.journal.events("warning")
    assert warned["GPUGATE_REASON"] == "scan-cut-short"
    assert warned["MESSAGE"].startswith("the open files of 25 process(es) (PID 100, 101,")
    assert ", …)" in warned["MESSAGE"] and "may be missed" in warned["MESSAGE"]
    said = unreadable_warning(discovery)
    assert said is not None and said.startswith("gpugate: warning: the open files of 25")
