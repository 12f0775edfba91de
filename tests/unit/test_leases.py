"""GPU leases: written atomically, read back, overlap decided by UUID, stale when the lease's
unit no longer runs (real processes in a stand-in cgroup tree stand for a running unit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpugate.host.systemd import unit_active_state
from gpugate.integrations.records import (
    check_leases,
    lease_path,
    leases_by_gpu,
    new_lease,
    read_leases,
    release_lease,
    write_lease,
)
from tests.fakes import FakeHost


def gpus(host: FakeHost, *indices: int):  # type: ignore[no-untyped-def]
    return [g for g in host.memory.gpus() if g.index in indices]


def test_lease_round_trip_and_atomic_replace(host: FakeHost, tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    first = new_lease("a.service", gpus(host, 0, 1), share=False, invocation_id="abc")
    write_lease(locks, first)
    path = lease_path(locks, "a.service")
    assert path.is_file()
    second = new_lease("a.service", gpus(host, 2), share=True)
    write_lease(locks, second)
    files = read_leases(locks)
    assert [lease.unit for lease in files.leases] == ["a.service"]
    assert files.leases[0].gpus == (2,) and files.leases[0].share
    # nothing but the lease itself is left in the folder: no temporary files
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.service.json"]
    release_lease(locks, "a.service")
    release_lease(locks, "a.service")  # none held: nothing to do
    assert not path.exists()
    assert read_leases(locks).leases == []


def test_a_torn_or_foreign_file_is_reported_not_trusted(host: FakeHost, tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    write_lease(locks, new_lease("a.service", gpus(host, 0), share=False))
    (locks / "leases" / "b.service.json").write_text('{"unit": "b.serv')
    renamed = json.loads(lease_path(locks, "a.service").read_text())
    (locks / "leases" / "c.service.json").write_text(json.dumps(renamed))  # names a.service
    files = read_leases(locks)
    assert [lease.unit for lease in files.leases] == ["a.service"]
    assert sorted(p.name for p in files.unreadable) == ["b.service.json", "c.service.json"]
    # a crash between mkstemp and rename leaves only a dot-file, which is not a lease
    (locks / "leases" / ".d.service.x.tmp").write_text("{")
    assert [lease.unit for lease in read_leases(locks).leases] == ["a.service"]


@pytest.mark.parametrize(
    ("theirs", "mine", "overlap"),
    [((0, 1, 2, 3), (2, 3, 4, 5), (2, 3)), ((0,), (0,), (0,)), ((7,), (0, 7), (7,))],
)
@pytest.mark.parametrize("state", ["active", "activating", "reloading", None])
def test_live_lease_on_overlapping_gpus_is_a_conflict(
    host: FakeHost,
    tmp_path: Path,
    *,
    theirs: tuple[int, ...],
    mine: tuple[int, ...],
    overlap: tuple[int, ...],
    state: str | None,
) -> None:
    locks = tmp_path / "locks"
    write_lease(locks, new_lease("a.service", gpus(host, *theirs), share=False))
    check = check_leases(
        locks, "b.service", gpus(host, *mine), share=False, unit_state=lambda _: state
    )
    assert [(lease.unit, [g.index for g in on]) for lease, on in check.conflicts] == [
        ("a.service", list(overlap))
    ]
    assert "a.service" in check.refusal() and f"GPU {overlap[0]}" in check.refusal()
    assert not check.stale


@pytest.mark.parametrize("state", ["inactive", "failed", "deactivating", "not-found"])
def test_lease_of_a_unit_that_stopped_is_stale(host: FakeHost, tmp_path: Path, state: str) -> None:
    locks = tmp_path / "locks"
    write_lease(locks, new_lease("a.service", gpus(host, 0, 1), share=False))
    check = check_leases(locks, "b.service", gpus(host, 1), share=False, unit_state=lambda _: state)
    assert not check.conflicts
    assert [(lease.unit, s) for lease, s in check.stale] == [("a.service", state)]


def test_disjoint_own_and_shared_leases_do_not_conflict(host: FakeHost, tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    write_lease(locks, new_lease("a.service", gpus(host, 0, 1), share=False))
    write_lease(locks, new_lease("b.service", gpus(host, 4), share=True))
    write_lease(locks, new_lease("c.service", gpus(host, 5), share=False))
    active = lambda _: "active"  # noqa: E731
    assert not check_leases(
        locks, "d.service", gpus(host, 2, 3), share=False, unit_state=active
    ).conflicts
    assert not check_leases(
        locks, "a.service", gpus(host, 0), share=False, unit_state=active
    ).conflicts
    both = check_leases(locks, "d.service", gpus(host, 4), share=True, unit_state=active)
    assert not both.conflicts and [lease.unit for lease, _ in both.shared] == ["b.service"]
    # sharing needs both sides: a sharer cannot join a unit that does not share, nor the reverse
    assert check_leases(locks, "d.service", gpus(host, 5), share=True, unit_state=active).conflicts
    assert check_leases(locks, "d.service", gpus(host, 4), share=False, unit_state=active).conflicts
    assert leases_by_gpu(read_leases(locks).leases)[gpus(host, 4)[0].uuid.lower()] == ["b.service"]


def test_unit_state_without_systemd_follows_its_cgroup(host: FakeHost) -> None:
    (proc,) = host.pool.holder([])
    assert unit_active_state("vllm.service", host.cgroup_root, ask_systemd=False) == "inactive"
    host.put_in_unit(proc)
    assert unit_active_state("vllm.service", host.cgroup_root, ask_systemd=False) == "active"
    assert unit_active_state("other.service", host.cgroup_root, ask_systemd=False) == "inactive"


def test_lease_written_by_a_process_that_then_crashes_survives(
    host: FakeHost, tmp_path: Path
) -> None:
    locks = tmp_path / "locks"
    code = (
        "import sys, os; from pathlib import Path; from gpugate.integrations.records import new_lease, write_lease;"
        "from gpugate.host.nvml import Gpu;"
        "write_lease(Path(sys.argv[1]), new_lease('a.service', [Gpu(3, 'GPU-fa4e5a11-0000-0000-0000-000000000003', 3, 'x', 1)], share=False));"
        "os.abort()"
    )
    proc = host.pool.command([sys.executable, "-c", code, str(locks)])
    assert proc.wait(timeout=30) != 0
    (lease,) = read_leases(locks).leases
    assert lease.unit == "a.service" and lease.gpus == (3,)


def test_a_lease_records_who_started_a_hand_run_and_old_files_stay_readable(
    host: FakeHost, tmp_path: Path
) -> None:
    locks = tmp_path / "locks"
    lease = new_lease("h.service", gpus(host, 0), share=False, started_by="bob (uid 1001)")
    write_lease(locks, lease)
    (read,) = read_leases(locks).leases
    assert read.started_by == "bob (uid 1001)"
    old = {"unit": "o.service", "gpus": [1], "uuids": ["GPU-1"], "share": False, "since": 1.0}
    (lease_path(locks, "o.service")).write_text(json.dumps(old))
    by_unit = {lease.unit: lease for lease in read_leases(locks).leases}
    assert by_unit["o.service"].started_by is None
    assert by_unit["o.service"].holder_text().startswith("o.service ")  # an old file: its unit
