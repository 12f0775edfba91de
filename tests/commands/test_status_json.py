"""`gpugate status --json` is an interface for fleet tools: its keys and types are pinned here,
and each one is documented in docs/status-json.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpugate.errors import ExitCode
from gpugate.front.cli import main
from gpugate.host.nvml import mig_key
from gpugate.host.scan import ProcFs
from gpugate.integrations.records import new_lease, write_lease
from tests.fakes import UNIT, UNIT_CGROUP, FakeHost

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "status-json.md"

TOP = {
    "version": int,
    "unit": (str, type(None)),
    "unit_cgroup": (str, type(None)),
    "config": str,
    "free_mib": int,
    "gpus": list,
    "holders": list,
    "invisible": list,
    "unreadable_gpus": list,
    "shm": list,
    "unit_shm": list,
    "leases": list,
}
GPU = {
    "index": int,
    "uuid": str,
    "minor": int,
    "name": str,
    "used_mib": int,
    "total_mib": int,
    "owned": bool,
    "leased_to": list,
    "shown": str,
    "mig_mode": bool,
    "mig": (dict, type(None)),
}
MIG = {
    "gpu": int,
    "gpu_uuid": str,
    "mig_index": int,
    "gpu_instance": int,
    "compute_instance": int,
    "profile": str,
    "pids": list,
}
HOLDER = {
    "pid": int,
    "start_time": int,
    "uid": (int, type(None)),
    "user": str,
    "unit": (str, type(None)),
    "cgroup": (str, type(None)),
    "state": str,
    "comm": str,
    "command": list,
    "command_cut": bool,
    "gpus": list,
    "ports": list,
    "used_mib": dict,
    "mps_server": bool,
    "mps_client": list,
    "control_devices": list,
    "sources": list,
    "role": (str, type(None)),
    "reason": (str, type(None)),
    "orphan": bool,
    "protected": bool,
    "watcher": bool,
    "seconds_held": (int, type(None)),
    "owner": str,
    "unowned_s": (int, type(None)),
    "container": (dict, type(None)),
    "shm": list,
    "shm_bytes": int,
}
INVISIBLE = {"gpu": int, "pid": int}
UNREADABLE = {"index": int, "uuid": (str, type(None)), "error": str}
SHM_AREA = {"path": str, "total_bytes": int, "free_bytes": int}
SHM_FILE = {"path": str, "bytes": (int, type(None))}
UNIT_SHM = {
    "unit": str,
    "pid": int,
    "path": str,
    "total_bytes": int,
    "used_bytes": int,
    "files": int,
}


def check(entry: dict[str, Any], schema: dict[str, Any]) -> None:
    assert set(entry) == set(schema)
    for key, kind in schema.items():
        assert isinstance(entry[key], kind), (key, entry[key])


def status(
    host: FakeHost, capsys: pytest.CaptureFixture[str], *unit: str, exit_code: int = 0
) -> dict[str, Any]:
    config = host.root / "c.toml"
    config.write_text(f'lock_dir = "{host.root / "locks"}"\n')
    code = main(
        ["status", *unit, "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    assert code == exit_code
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_keys_and_types_are_the_documented_ones(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    (member,) = host.pool.holder(host.gpu_files(1))
    host.put_in_unit(member)
    host.memory.claim(member, {1}, 4000)
    (orphan,) = host.pool.holder(host.gpu_files(2))
    host.memory.listed_without_memory[2] = [orphan]
    host.memory.listed_without_memory[3] = [2**22 + 7]  # a PID this /proc does not show

    data = status(host, capsys, UNIT)

    check(data, TOP)
    assert (data["version"], data["unit"], data["unit_cgroup"]) == (1, UNIT, UNIT_CGROUP)
    for gpu in data["gpus"]:
        check(gpu, GPU)
    for holder in data["holders"]:
        check(holder, HOLDER)
        assert all(isinstance(arg, str) for arg in holder["command"])
        assert all(isinstance(index, int) for index in holder["gpus"])
        for index, mib in holder["used_mib"].items():
            assert index.isdigit() and isinstance(mib, (int, type(None)))
        assert set(holder["sources"]) <= {"cgroup", "device-fd", "device-map", "nvml", "container"}
        assert holder["role"] in {"unit", "orphan", "other-unit", "protected", "unit-container"}
        assert holder["container"] is None
    by_pid = {holder["pid"]: holder for holder in data["holders"]}
    assert by_pid[member]["role"] == "unit" and by_pid[member]["used_mib"] == {"1": 4000}
    assert by_pid[orphan]["orphan"] is True and by_pid[orphan]["used_mib"] == {"2": None}
    assert (by_pid[member]["reason"], by_pid[orphan]["reason"]) == ("cgroup", "orphan")
    (invisible,) = data["invisible"]
    check(invisible, INVISIBLE)
    assert invisible == {"gpu": 3, "pid": 2**22 + 7}

    without_unit = status(host, capsys)
    assert (without_unit["unit"], without_unit["unit_cgroup"]) == (None, None)
    assert all(gpu["owned"] for gpu in without_unit["gpus"])
    assert {holder["role"] for holder in without_unit["holders"]} == {None}
    assert {holder["reason"] for holder in without_unit["holders"]} == {None}


def test_every_key_is_in_the_schema_doc() -> None:
    documented = set(re.findall(r"`([a-z_]+)`", SCHEMA_DOC.read_text()))
    schemas = (TOP, GPU, MIG, HOLDER, INVISIBLE, UNREADABLE, SHM_AREA, SHM_FILE, UNIT_SHM)
    missing = set().union(*schemas) - documented
    assert not missing, f"not documented in docs/status-json.md: {sorted(missing)}"


@pytest.mark.parametrize("lost", [{6}, {0}, {3, 6}, {7}])
def test_an_unreadable_gpu_keeps_every_other_row_and_holder(
    host: FakeHost, capsys: pytest.CaptureFixture[str], lost: set[int]
) -> None:
    holders = {i: host.pool.holder(host.gpu_files(i))[0] for i in range(8)}
    for index, pid in holders.items():
        host.memory.claim(pid, {index}, 1000 + index)
    host.memory.lost = set(lost)

    data = status(host, capsys, exit_code=int(ExitCode.GPU_UNREADABLE))

    check(data, TOP)
    assert [gpu["index"] for gpu in data["gpus"]] == [i for i in range(8) if i not in lost]
    for fault in data["unreadable_gpus"]:
        check(fault, UNREADABLE)
    assert [f["index"] for f in data["unreadable_gpus"]] == sorted(lost)
    assert all("lost" in f["error"] for f in data["unreadable_gpus"])
    by_pid = {holder["pid"]: holder for holder in data["holders"]}
    # every holder is shown; a lost GPU's holder from its device file, with no NVML memory
    for index, pid in holders.items():
        assert by_pid[pid]["gpus"] == [index]
        assert by_pid[pid]["sources"] == (["device-fd"] if index in lost else ["device-fd", "nvml"])

    main(
        ["status", "--config", str(host.root / "c.toml")],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    table = capsys.readouterr().out
    for index in lost:
        assert f"  {index}! ? " in table and "lost" in table
    for index in set(range(8)) - lost:
        assert f"  {index}  GPU-" in table
    assert all(str(pid) in table for pid in holders.values())


def test_a_failing_query_on_one_gpu_is_shown_on_its_row(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    host.memory.failing_usage = {2}
    data = status(host, capsys, UNIT, exit_code=int(ExitCode.GPU_UNREADABLE))
    (fault,) = data["unreadable_gpus"]
    assert fault["index"] == 2 and fault["uuid"] and fault["error"]
    assert 2 not in [gpu["index"] for gpu in data["gpus"]]


def test_each_gpu_shows_its_lease(host: FakeHost, capsys: pytest.CaptureFixture[str]) -> None:
    gpus = host.memory.gpus()
    write_lease(
        host.root / "locks",
        new_lease("a.service", gpus[0:4], share=False, started_by="alice (uid 1000)"),
    )
    write_lease(host.root / "locks", new_lease("b.service", gpus[3:5], share=True))
    data = status(host, capsys)
    assert [gpu["leased_to"] for gpu in data["gpus"]] == [
        ["a.service"],
        ["a.service"],
        ["a.service"],
        ["a.service", "b.service"],
        ["b.service"],
        [],
        [],
        [],
    ]
    by_unit = {lease["unit"]: lease for lease in data["leases"]}
    assert by_unit["a.service"]["started_by"] == "alice (uid 1000)"
    assert by_unit["a.service"]["gpus"] == [0, 1, 2, 3]
    assert by_unit["b.service"]["started_by"] is None


def test_one_look_reads_each_process_once(
    host: FakeHost, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: discovery and the JSON's rules (pre's decision, its application walks) share
    one reading of each process's facts."""
    reads: list[int] = []
    original = ProcFs._read

    def counted(self: ProcFs, pid: int, name: str) -> Any:
        if name == "cmdline":  # read once per full reading of a process's facts
            reads.append(pid)
        return original(self, pid, name)

    monkeypatch.setattr(ProcFs, "_read", counted)
    pids = host.pool.holder(host.gpu_files(1), children=2)  # an orphan application
    for pid in pids:
        host.memory.claim(pid, {1}, 1000)
    data = status(host, capsys, UNIT)
    assert {holder["pid"] for holder in data["holders"]} >= set(pids)
    assert {holder["reason"] for holder in data["holders"] if holder["pid"] in pids} == {"orphan"}
    assert reads and len(reads) == len(set(reads)), sorted(reads)


def test_mig_slices_are_rows_of_their_own(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    host.memory.mig = {0: [(1, 0, 20000), (2, 0, 20000)]}
    (on_two,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(on_two, {mig_key(0, 1)}, 300)
    write_lease(host.root / "locks", new_lease("b.service", host.memory.gpus()[2:3], share=False))
    data = status(host, capsys)
    by_index = {gpu["index"]: gpu for gpu in data["gpus"]}
    check(by_index[0], GPU)
    assert by_index[0]["mig_mode"] is True and by_index[0]["mig"] is None
    assert by_index[0]["used_mib"] == 300
    one, two = by_index[mig_key(0, 0)], by_index[mig_key(0, 1)]
    for gpu in (one, two):
        check(gpu, GPU)
        check(gpu["mig"], MIG)
    assert (two["shown"], two["used_mib"], two["total_mib"]) == ("0/2/0", 300, 20000)
    assert two["mig"]["pids"] == [on_two] and one["mig"]["pids"] == []
    assert two["leased_to"] == ["b.service"] and one["leased_to"] == []
    [holder] = [h for h in data["holders"] if h["pid"] == on_two]
    assert set(holder["gpus"]) == {0, mig_key(0, 1)}  # the device file's GPU, NVML's slice
    assert holder["used_mib"] == {str(mig_key(0, 1)): 300}
    # the table: slices under their GPU, the holder's GPUs as GPU/GI/CI
    main(
        ["status", "--config", str(host.root / "c.toml")],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    table = capsys.readouterr().out.splitlines()
    first = [line.split()[0] for line in table[1:5]]
    assert first == ["0", "-", "-", "1"]
    assert table[3].split()[1] == two["uuid"]
    row = next(line for line in table if line.split()[:1] == [str(on_two)])
    assert "0,0/2/0" in row.split()
