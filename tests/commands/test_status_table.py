"""`gpugate status` for a person: the table's columns (role, time held, unknown MiB), cuts
that say so, quiet on a closed pipe, a warning where it cannot see, and --watch."""

from __future__ import annotations

import io
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpugate.front.cli import main
from gpugate.front.commands import status as status_command
from gpugate.front.commands.status import gpu_ranges, held_for, mib_shown, render_table, truncate
from tests.fakes import UNIT, FakeHost, as_nobody


def run_status(host: FakeHost, *args: str, config: bool = True) -> int:
    path = host.root / "c.toml"
    if config:
        path.write_text("")
    return main(
        ["status", *args, *(["--config", str(path)] if config else [])],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )


@pytest.mark.parametrize(
    ("indices", "shown"),
    [
        ([], ""),
        ([3], "3"),
        (list(range(8)), "0-7"),
        ([0, 1, 2, 3, 5], "0-3,5"),
        ([7, 0, 6, 1], "0-1,6-7"),
        ([0, 2, 4, 6], "0,2,4,6"),
    ],
)
def test_gpu_ranges(indices: list[int], shown: str) -> None:
    assert gpu_ranges(indices) == shown


@pytest.mark.parametrize(
    ("used", "shown"),
    [
        ({}, "-"),
        ({"0": None}, "unknown"),
        ({"0": None, "1": None}, "unknown"),
        ({"0": 4000}, "4000"),
        ({"0": 4000, "1": 1000}, "5000"),
        ({"0": 4000, "1": None}, "4000+?"),
        ({"0": 0}, "0"),
    ],
)
def test_mib_unknown_is_never_zero(used: dict[str, int | None], shown: str) -> None:
    assert mib_shown(used) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "?"), (0, "0s"), (59, "59s"), (61, "1m01s"), (3725, "1h02m"), (90000, "1d01h")],
)
def test_time_held(seconds: int | None, shown: str) -> None:
    assert held_for(seconds) == shown


@pytest.mark.parametrize("width", [1, 5, 10, 28])
def test_cut_marks_the_cut(width: int) -> None:
    long = "x" * 40
    assert len(truncate(long, width)) == width and truncate(long, width).endswith("…")
    assert truncate("short", 28) == "short"


def test_table_roles_ellipses_and_unknown_mib(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    (member,) = host.pool.holder(host.gpu_files(*range(8)))
    host.put_in_unit(member)
    host.memory.claim(member, set(range(8)), 1000)  # 1000 MiB on each
    (listed,) = host.pool.holder(host.gpu_files(2))
    host.memory.listed_without_memory[2] = [listed]  # NVML lists it, the driver gives no MiB
    (watcher,) = host.pool.holder(host.gpu_files(3))  # device files open, no NVML entry
    assert run_status(host, UNIT) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {
        int(line.split()[0]): line
        for line in lines
        if line.split()[:1] != [] and line.split()[0].isdigit() and len(line.split()) > 8
    }
    assert rows[member].split()[2] == "unit" and " 0-7 " in rows[member]
    assert " 8000 " in rows[member]
    assert rows[listed].split()[2] == "orphan" and " unknown " in rows[listed]
    assert rows[watcher].split()[2] == "watcher" and " - " in rows[watcher]


@pytest.mark.message
def test_table_cuts_long_unit_names_with_an_ellipsis() -> None:
    holder: dict[str, Any] = {
        "pid": 42,
        "user": "a-very-long-user-name",
        "unit": "inference-server-with-a-long-name@model-a.service",
        "state": "S",
        "gpus": [0, 2, 4, 6, 8, 10, 12],
        "control_devices": [],
        "used_mib": {"0": 5},
        "command": ["python3", "-m", "vllm"],
        "comm": "python3",
        "role": "other-unit",
        "orphan": False,
        "protected": False,
        "watcher": False,
        "seconds_held": 4000,
        "container": None,
    }
    data = {
        "gpus": [],
        "unit": "vllm.service",
        "unit_cgroup": "/x",
        "holders": [holder],
        "invisible": [],
        "unreadable_gpus": [],
    }
    row = render_table(data).splitlines()[-1]
    assert "a-very-lo… " in row and "inference-server-with-a-lon… " in row
    assert "0,2,4,6,8… " in row and "other unit" in row and "1h06m" in row


@pytest.mark.root("not root, status first warns that holders may be missing")
def test_status_into_a_closed_pipe_is_quiet(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    host.pool.holder(host.gpu_files(0))
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -c 10` that has read enough
    saved = os.dup(1)
    try:
        writer = os.fdopen(write_end, "w")
        monkeypatch.setattr(sys, "stdout", writer)
        assert run_status(host) == 0
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert capfd.readouterr().err == ""


@pytest.mark.message
@pytest.mark.root("drops to another user")
def test_status_as_non_root_warns_that_holders_may_be_missing(host: FakeHost) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    host.pool.holder(host.gpu_files(0))

    def status_as_nobody() -> dict[str, Any]:
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        result = run_status(host, config=False)  # the built-in config: no file to read
        return {"code": result, "stderr": sys.stderr.getvalue()}

    data = as_nobody(status_as_nobody)
    assert data["code"] == 0
    (warning,) = data["stderr"].splitlines()
    assert warning.startswith("gpugate: warning: not permitted to read the open files of")
    assert warning.endswith("are not shown; run as root")


def test_watch_redraws_until_interrupted(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host.pool.holder(host.gpu_files(0))
    draws: list[float] = []

    def sleep(seconds: float) -> None:
        draws.append(seconds)
        if len(draws) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("gpugate.front.commands.status.time.sleep", sleep)
    assert run_status(host, "--watch") == 0
    out = capsys.readouterr().out
    assert out.count("\x1b[H\x1b[J") == 3 and draws == [1, 1, 1]
    with pytest.raises(SystemExit) as exited:
        run_status(host, "--watch", "--json")
    assert exited.value.code == 64


def test_watch_rescans_show_new_holders_and_drop_gone_ones(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30: the looks between full scans rescan new PIDs and the known holders."""
    (first,) = host.pool.holder(host.gpu_files(0))
    later: list[int] = []
    draws: list[float] = []

    def sleep(seconds: float) -> None:
        draws.append(seconds)
        if len(draws) == 1:
            os.kill(first, 9)  # our own holder
            host.pool.popens[0].wait()
            later.extend(host.pool.holder(host.gpu_files(5)))
        elif len(draws) == 2:
            raise KeyboardInterrupt

    # Only the watch's own sleep (the holders' start waits on time.sleep as well).
    watch_time = SimpleNamespace(sleep=sleep, monotonic=time.monotonic, time=time.time)
    monkeypatch.setattr(status_command, "time", watch_time)
    assert run_status(host, "--watch") == 0
    frames = capsys.readouterr().out.split("\x1b[H\x1b[J")[1:]
    pids = [
        {int(line.split()[0]) for line in frame.splitlines() if line[:7].strip().isdigit()}
        for frame in frames
    ]
    assert first in pids[0] and later[0] not in pids[0]
    assert later[0] in pids[1] and first not in pids[1]
