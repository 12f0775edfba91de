"""`gpugate sweep`: each holder's owner, the journal's first-seen and gone entries across
sweeps (the state under lock_dir, also when it is hostile), the gauges, reaping only past
reap_after_s on unleased GPUs, and the [sweep] config errors."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from gpugate.config.schema import GateConfig
from gpugate.config.values import SWEEP_INTERVAL_S
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import HolderOwner, Owner, owner_of
from gpugate.errors import ConfigError, ExitCode
from gpugate.front.cli import main
from gpugate.front.commands.sweep import SWEEP_UNIT, reapable, remember, sweep
from gpugate.front.hook import HostAccess
from gpugate.front.install import DEFAULT_GPUGATE, TIMER, plan_shipped, with_header
from gpugate.host.containers import container_of_cgroup
from gpugate.host.nvml import Gpu, GpuProcess, GpuUsage
from gpugate.host.scan import ProcessId, ProcInfo
from gpugate.integrations.records import (
    MAX_ENTRIES,
    STATE_NAME,
    Seen,
    boot_time,
    locked_state,
    new_lease,
    read_state,
    write_lease,
    write_state,
)
from gpugate.report.journal import Reporter
from tests.fakes import FakeHost, RecordingJournal, RecordingNotifier, alive, raises_error

UNITS = Path(__file__).resolve().parents[2] / "units"
GPUS = [Gpu(i, f"GPU-{i:08x}-0000", i, "g", 1000) for i in range(4)]
DOCKER_ID = "ab" * 32


def proc(pid: int, cgroup: str, exe: str = "/usr/bin/python3") -> ProcInfo:
    return ProcInfo(
        pid=pid,
        start_time=100 + pid,
        comm="p",
        state="S",
        ppid=1,
        pgrp=pid,
        session=pid,
        tty_nr=0,
        kernel_thread=False,
        uid=0,
        cgroup=cgroup,
        cmdline=("p",),
        exe=exe,
    )


def looked(holders: list[Holder], listed: dict[int, list[int]] | None = None) -> Discovery:
    """A discovery without a unit, as the sweep's; NVML lists `listed` on each GPU."""
    listed = listed or {}
    usage = {
        gpu.index: GpuUsage(
            gpu,
            100 * len(listed.get(gpu.index, [])),
            tuple(GpuProcess(pid, 100) for pid in listed.get(gpu.index, [])),
        )
        for gpu in GPUS
    }
    return Discovery(
        unit="",
        unit_cgroup="/gpugate-sweep-no-unit",
        gpus=GPUS,
        owned=GPUS,
        usage=usage,
        holders={holder.pid: holder for holder in holders},
        self_chain=frozenset({999}),
        unreadable=[],
    )


def nvml_holder(info: ProcInfo, gpu: int = 0) -> Holder:
    holder = Holder(info, {Source.NVML, Source.DEVICE_FD}, {gpu}, used_mib={gpu: 100})
    holder.container = container_of_cgroup(info.cgroup)
    return holder


@pytest.mark.parametrize(
    ("cgroup", "exe", "owner"),
    [
        ("/system.slice/other.service", "/usr/bin/python3", Owner.UNIT),
        ("/system.slice/gpugate-run-x.service", "/usr/bin/python3", Owner.UNIT),
        ("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0", "/usr/bin/x", Owner.JOB),
        ("/system.slice/node1_slurmstepd.scope/job_7", "/usr/bin/x", Owner.JOB),
        (f"/system.slice/docker-{DOCKER_ID}.scope", "/usr/bin/python3", Owner.CONTAINER),
        (f"/machine.slice/libpod-{DOCKER_ID}.scope/container", "/usr/bin/x", Owner.CONTAINER),
        ("/system.slice/nvidia-persistenced.service", "/usr/bin/x", Owner.PROTECTED),
        ("/user.slice/user-0.slice/session-1.scope", "/usr/bin/nvidia-smi", Owner.PROTECTED),
        ("/user.slice/user-0.slice/session-1.scope", "/usr/bin/python3", Owner.NOBODY),
        ("/", "/usr/bin/python3", Owner.NOBODY),
        ("/init.scope", "/usr/bin/python3", Owner.NOBODY),
        # An account's own units take any name: never a unit, a job or a container.
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service",
            "/x",
            Owner.NOBODY,
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/system.slice/slurmstepd.scope/job_1",
            "/usr/bin/x",
            Owner.NOBODY,
        ),
        (f"/user.slice/user-1000.slice/docker-{DOCKER_ID}.scope", "/usr/bin/x", Owner.NOBODY),
    ],
)
def test_each_holder_has_one_owner(cgroup: str, exe: str, owner: Owner) -> None:
    holder = nvml_holder(proc(10, cgroup, exe))
    assert owner_of(holder, looked([holder], {0: [10]}), GateConfig()) is owner


def test_a_holder_of_device_files_nvml_lists_nowhere_is_a_watcher() -> None:
    watcher = Holder(proc(11, "/"), {Source.DEVICE_FD}, {0, 1})
    server = nvml_holder(proc(12, "/"), gpu=1)
    discovery = looked([watcher, server], {1: [12]})
    assert owner_of(watcher, discovery, GateConfig()) is Owner.WATCHER
    assert owner_of(server, discovery, GateConfig()) is Owner.NOBODY


def reporter() -> tuple[Reporter, RecordingJournal]:
    journal = RecordingJournal()
    return Reporter(SWEEP_UNIT, "sweep", journal=journal, notifier=RecordingNotifier()), journal


def test_first_seen_once_then_gone_once_and_a_reused_pid_is_another_process() -> None:
    report, journal = reporter()
    server = HolderOwner(nvml_holder(proc(20, "/"), gpu=2), Owner.NOBODY)
    unit = HolderOwner(nvml_holder(proc(21, "/system.slice/vllm.service")), Owner.UNIT)
    first = remember([server, unit], {}, 1000.0, report)
    assert [e["GPUGATE_PID"] for e in journal.events("unowned_seen")] == ["20"]
    seen = journal.events("unowned_seen")[0]
    assert (seen["GPUGATE_GPU"], seen["GPUGATE_START_TIME"], seen["GPUGATE_USED_MIB"]) == (
        "2",
        "120",
        "100",
    )
    assert first == {ProcessId(20, 120): Seen(1000.0, (2,))}

    second = remember([server, unit], first, 1060.0, report)
    assert second == first  # since when: kept
    assert len(journal.events("unowned_seen")) == 1 and not journal.events("unowned_gone")

    reused = HolderOwner(nvml_holder(proc(20, "/")._replace(start_time=999), gpu=2), Owner.NOBODY)
    third = remember([reused], second, 1120.0, report)
    assert third == {ProcessId(20, 999): Seen(1120.0, (2,))}
    gone = journal.events("unowned_gone")
    assert [(e["GPUGATE_START_TIME"], e["GPUGATE_UNOWNED_S"]) for e in gone] == [("120", "120")]
    assert len(journal.events("unowned_seen")) == 2


def test_without_a_state_nothing_is_said() -> None:
    _, journal = reporter()
    server = HolderOwner(nvml_holder(proc(20, "/")), Owner.NOBODY)
    assert remember([server], {ProcessId(5, 5): Seen(1.0, (0,))}, 9.0, None)
    assert journal.entries == []


def ages(**since: float) -> dict[ProcessId, Seen]:
    return {ProcessId(int(pid[1:]), 100 + int(pid[1:])): Seen(t, ()) for pid, t in since.items()}


def reap_gpus(
    holdings: list[HolderOwner], seen: dict[ProcessId, Seen], **kwargs: object
) -> list[int]:
    discovery = looked([h.holder for h in holdings])
    leased = set(kwargs.pop("leased", set()))  # type: ignore[call-overload]
    found = reapable(discovery, holdings, seen, 1000.0, after_s=300, leased=leased)
    return [gpu.index for gpu in found]


def test_a_gpu_is_reaped_only_when_every_unowned_holder_there_is_old_enough() -> None:
    old = HolderOwner(nvml_holder(proc(1, "/"), gpu=0), Owner.NOBODY)
    young = HolderOwner(nvml_holder(proc(2, "/"), gpu=0), Owner.NOBODY)
    other = HolderOwner(nvml_holder(proc(3, "/"), gpu=1), Owner.NOBODY)
    assert reap_gpus([old, young, other], ages(p1=100, p2=900, p3=700)) == [1]
    assert reap_gpus([old, young, other], ages(p1=100, p2=700, p3=700)) == [0, 1]
    assert reap_gpus([old, other], ages(p1=700.5, p3=701)) == []


def test_never_a_leased_gpu_nor_one_a_unit_job_or_container_runs_on() -> None:
    old = HolderOwner(nvml_holder(proc(1, "/"), gpu=0), Owner.NOBODY)
    seen = ages(p1=0)
    assert reap_gpus([old], seen, leased={GPUS[0].uuid.lower()}) == []
    for kind in (Owner.UNIT, Owner.JOB, Owner.CONTAINER):
        beside = HolderOwner(nvml_holder(proc(9, "/system.slice/x.service"), gpu=0), kind)
        assert reap_gpus([old, beside], seen) == [], kind
    for kind in (Owner.PROTECTED, Owner.WATCHER):
        beside = HolderOwner(nvml_holder(proc(9, "/"), gpu=0), kind)
        assert reap_gpus([old, beside], seen) == [0], kind
        assert reap_gpus([beside], seen) == [], kind  # nothing unowned: nothing to reap


def test_the_state_round_trips_and_keeps_at_most_the_oldest_entries(tmp_path: Path) -> None:
    many = {ProcessId(pid, pid): Seen(float(pid), (pid % 8,)) for pid in range(1, 600)}
    with locked_state(tmp_path) as (folder_fd, state):
        assert state.unowned == {} and state.refused is None
        write_state(folder_fd, many)
    with locked_state(tmp_path) as (_, state):
        assert state.refused is None
        assert len(state.unowned) == MAX_ENTRIES
        assert max(ident.pid for ident in state.unowned) == MAX_ENTRIES
    assert (tmp_path / STATE_NAME).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"version": 3, "unowned": []}',
        '{"version": 2, "unowned": {}}',
        '{"version": 2, "unowned": [{"pid": 0, "start_time": 1, "since": 1, "gpus": []}]}',
        '{"version": 2, "unowned": [{"pid": 5, "start_time": 1, "since": NaN, "gpus": []}]}',
        '{"version": 2, "unowned": [{"pid": 5, "start_time": true, "since": 1, "gpus": []}]}',
        '{"version": 2, "unowned": [{"pid": 5, "start_time": 1, "since": 1, "gpus": [-1]}]}',
        '{"version": 2, "unowned": ["x"]}',
        '{"version": 2, "unowned": [' + ",".join(["{}"] * (MAX_ENTRIES + 1)) + "]}",
        "[" * 100000,
    ],
)
def test_a_state_gpugate_did_not_write_is_refused_whole(tmp_path: Path, text: str) -> None:
    (tmp_path / STATE_NAME).write_text(text)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        state = read_state(fd)
    finally:
        os.close(fd)
    assert state.unowned == {} and state.refused


def test_a_link_fifo_or_huge_file_in_its_place_is_not_followed_read_or_blocked_on(
    tmp_path: Path,
) -> None:
    target = tmp_path / "elsewhere"
    target.write_text(
        '{"unowned":[{"drained":false,"gpus":[0],"pid":7,"since":1.0,"start_time":7}]}'
    )
    state_dir = tmp_path / "locks"
    state_dir.mkdir()
    for make in (
        lambda p: p.symlink_to(target),
        os.mkfifo,
        lambda p: p.write_bytes(b" " * (1 << 20)),
    ):
        path = state_dir / STATE_NAME
        if path.exists() or path.is_symlink():
            path.unlink()
        make(path)
        with locked_state(state_dir) as (folder_fd, state):
            assert state.unowned == {} and state.refused
            write_state(folder_fd, {})
        assert not path.is_symlink() and path.is_file()
    assert json.loads(target.read_text())["unowned"][0]["pid"] == 7  # the link's target kept


@pytest.mark.parametrize(
    ("table", "field", "problem"),
    [
        ("reap_after_s = 30", "sweep.reap_after_s", "SWEEP_BELOW_INTERVAL"),
        ("reap_after_s = 59.9", "sweep.reap_after_s", "SWEEP_BELOW_INTERVAL"),
        ("drain_after_s = 0", "sweep.drain_after_s", "SWEEP_BELOW_INTERVAL"),
        ("reap_after_s = -5", "sweep.reap_after_s", "SWEEP_BELOW_INTERVAL"),
        ('reap_after_s = "600"', "sweep.reap_after_s", "CONFIG_WRONG_TYPE"),
        ("reap_after_s = 1e12", "sweep.reap_after_s", "CONFIG_INVALID"),
        ("reap_after = 600", "sweep.reap_after", "CONFIG_UNKNOWN_KEY"),
    ],
)
def test_sweep_config_errors_name_the_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, field: str, problem: str
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'lock_dir = "{tmp_path / "locks"}"\n[sweep]\n{table}\n')
    from gpugate.integrations.config_files import load_config

    with raises_error(ConfigError) as raised:
        load_config(None, config)
    assert raised.value.field == field  # type: ignore[attr-defined]
    assert raised.value.source == str(config)  # type: ignore[attr-defined]
    assert main(["sweep", "--config", str(config)]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(config) in err and field in err


def test_reap_at_the_interval_is_taken() -> None:
    config = GateConfig.model_validate({"sweep": {"reap_after_s": SWEEP_INTERVAL_S}})
    assert config.sweep.reap_after_s == SWEEP_INTERVAL_S and config.sweep.drain_after_s is None


def test_the_shipped_units_are_what_install_writes_and_the_interval_is_the_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpugate.front import install

    monkeypatch.setattr(install, "PACKAGED_DIR", tmp_path / "packaged")
    planned = plan_shipped(TIMER, tmp_path, [str(DEFAULT_GPUGATE)], installing=True)
    assert [c.path.name for c in planned] == ["gpugate-sweep.service", "gpugate-sweep.timer"]
    for change in planned:
        assert change.content == with_header((UNITS / change.path.name).read_text())
    timer = (UNITS / "gpugate-sweep.timer").read_text()
    assert re.search(rf"^OnUnitActiveSec={SWEEP_INTERVAL_S}$", timer, re.M)


# With real processes on the fake host: every test process is in this machine's own cgroup,
# outside any unit (nobody's), unless it holds device files only (a watcher).


def sweep_config(host: FakeHost, reap: str = "") -> Path:
    config = host.root / "sweep.toml"
    config.write_text(
        f'lock_dir = "{host.root / "locks"}"\n'
        f'metrics_textfile = "{host.root / "metrics" / "gpugate.prom"}"\n'
        "[pre]\nsigterm_grace_s = 1.0\nsigkill_wait_s = 1.0\nwait_timeout_s = 20.0\n"
        f"[sweep]\n{reap}\n"
    )
    return config


def front(host: FakeHost, slurmd: str = "inactive") -> HostAccess:
    return HostAccess(
        driver_factory=lambda: host.memory,
        reporter_factory=lambda unit, phase, **_: Reporter(
            unit, phase, journal=host.journal, notifier=host.notifier, echo=False
        ),
        roots=host.roots,
        unit_state=lambda unit: slurmd if unit == "slurmd.service" else "active",
    )


def at(seconds: float) -> dict[str, Callable[[], float]]:
    """The sweep's two clocks: wall (the timestamp) and boot time (unowned time), both here."""
    return {"clock": lambda: seconds, "boot_clock": lambda: seconds}


def metric(host: FakeHost, name: str, **labels: str) -> float:
    text = (host.root / "metrics" / "gpugate.prom").read_text()
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name} {labels} not in the textfile")


def test_a_second_sweep_says_nothing_new_and_reaping_waits_for_its_time(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    (watcher,) = host.pool.holder(host.gpu_files(0, 1))
    config = sweep_config(host)

    assert sweep(config, front(host), **at(1000.0)) == ExitCode.OK
    assert [e["GPUGATE_PID"] for e in host.journal.events("unowned_seen")] == [str(server)]
    assert metric(host, "gpugate_gpu_memory_mib", gpu="2", owner="nobody") == 4000
    assert metric(host, "gpugate_gpu_memory_mib", gpu="2", owner="unit") == 0
    assert metric(host, "gpugate_unowned_processes", gpu="2") == 1
    assert metric(host, "gpugate_unowned_processes", gpu="0") == 0
    assert metric(host, "gpugate_sweep_timestamp_seconds") == 1000

    assert sweep(config, front(host), **at(1090.0)) == ExitCode.OK
    assert len(host.journal.events("unowned_seen")) == 1
    assert metric(host, "gpugate_unowned_seconds", gpu="2") == 90

    config = sweep_config(host, "reap_after_s = 120")
    assert sweep(config, front(host), **at(1100.0)) == ExitCode.OK
    assert alive(server) and not host.journal.events("signal_sent")

    assert sweep(config, front(host), **at(1121.0)) == ExitCode.OK
    assert not alive(server) and alive(watcher)
    killed = host.journal.events("holder_found")
    assert [(e["GPUGATE_PID"], e["GPUGATE_REASON"]) for e in killed] == [(str(server), "orphan")]
    assert {e["GPUGATE_UNIT"] for e in killed} == {SWEEP_UNIT}

    assert sweep(config, front(host), **at(1180.0)) == ExitCode.OK
    gone = host.journal.events("unowned_gone")
    assert [e["GPUGATE_PID"] for e in gone] == [str(server)]
    assert metric(host, "gpugate_gpu_memory_mib", gpu="2", owner="nobody") == 0


def test_a_leased_gpu_is_reported_not_reaped(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    gpu = host.memory.gpus()[2]
    write_lease(host.root / "locks", new_lease("other.service", [gpu], share=False))
    config = sweep_config(host, "reap_after_s = 60")
    assert sweep(config, front(host), **at(1000.0)) == ExitCode.OK
    assert sweep(config, front(host), **at(2000.0)) == ExitCode.OK
    assert alive(server)
    assert not host.journal.events("signal_sent")
    assert len(host.journal.events("unowned_seen")) == 1


def test_status_shows_the_owner_and_time_unowned(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    config = sweep_config(host)
    assert sweep(config, front(host), boot_clock=lambda: boot_time() - 5) == ExitCode.OK
    code = main(
        ["status", "--json", "--config", str(config)],
        driver_factory=lambda: host.memory,
        roots=host.roots,
    )
    assert code == ExitCode.OK
    (holder,) = json.loads(capsys.readouterr().out)["holders"]
    assert holder["owner"] == "nobody"
    assert isinstance(holder["unowned_s"], int) and holder["unowned_s"] > 0


@pytest.mark.message
def test_where_slurmd_runs_the_node_is_drained_once_past_drain_after_s(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = host.root / "bin"
    bin_dir.mkdir()
    args = host.root / "scontrol.args"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {args}\n')
    scontrol.chmod(0o755)
    from gpugate.host import safe_files

    monkeypatch.setattr(safe_files, "SYSTEM_DIRS", (str(bin_dir),))
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    config = sweep_config(host, "drain_after_s = 60")

    assert sweep(config, front(host, slurmd="inactive"), **at(900.0)) == ExitCode.OK
    assert sweep(config, front(host, slurmd="inactive"), **at(2000.0)) == ExitCode.OK
    assert not args.exists(), "no slurmd: never drained"
    (host.root / "locks" / STATE_NAME).unlink()
    assert sweep(config, front(host, slurmd="active"), **at(1000.0)) == ExitCode.OK
    assert sweep(config, front(host, slurmd="active"), **at(1059.0)) == ExitCode.OK
    assert not args.exists()
    assert sweep(config, front(host, slurmd="active"), **at(1061.0)) == ExitCode.OK
    words = args.read_text().splitlines()
    assert words[:3] == ["update", f"NodeName={socket.gethostname().split('.')[0]}", "State=DRAIN"]
    assert words[3].startswith("Reason=gpugate: GPU 2 ") and words[3].endswith(f"PID {server}")
    args.unlink()
    assert sweep(config, front(host, slurmd="active"), **at(1200.0)) == ExitCode.OK
    assert not args.exists(), "drained once for a holder, not at every sweep"
    assert alive(server), "a drain kills nothing"


def test_install_sweep_writes_its_units_and_uninstall_takes_back_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpugate.front import install
    from gpugate.front.install import Action

    monkeypatch.setattr(install, "PACKAGED_DIR", tmp_path / "packaged")
    systemd = tmp_path / "system"
    command = ["/usr/bin/gpugate"]
    planned = install.plan_shipped(install.TIMER, systemd, command, installing=True)
    assert [(c.path.name, c.action) for c in planned] == [
        ("gpugate-sweep.service", Action.WRITE),
        ("gpugate-sweep.timer", Action.WRITE),
    ]
    install.apply(planned, reload=lambda: False)
    again = install.plan_shipped(install.TIMER, systemd, command, installing=True)
    assert {c.action for c in again} == {Action.UNCHANGED}
    timer = systemd / "gpugate-sweep.timer"
    timer.write_text(timer.read_text() + "# mine\n")
    removed = install.plan_shipped(install.TIMER, systemd, command, installing=False)
    assert [(c.path.name, c.action) for c in removed] == [
        ("gpugate-sweep.service", Action.REMOVE),
        ("gpugate-sweep.timer", Action.KEEP),
    ]
    assert [
        c.action for c in install.plan_shipped(install.TIMER, systemd, command, installing=True)
    ] == [
        Action.UNCHANGED,
        Action.KEEP,
    ]
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    for name in ("gpugate-sweep.service", "gpugate-sweep.timer"):
        (packaged / name).write_text("packaged")
    assert install.plan_shipped(install.TIMER, systemd, command, installing=True) == []


def test_install_sweep_dry_run_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpugate.front import install

    monkeypatch.setattr(install, "PACKAGED_DIR", tmp_path / "packaged")
    code = main(["install", "--sweep", "--dry-run", "--systemd-dir", str(tmp_path / "system")])
    assert code == ExitCode.OK
    assert not (tmp_path / "system").exists()
    assert "ExecStart=" in capsys.readouterr().out
    assert main(["uninstall", "--sweep", "--systemd-dir", str(tmp_path / "system")]) == 0
    assert main(["install", "--sweep", "vllm.service"]) == ExitCode.USAGE
    assert main(["install", "--sweep", "--containers"]) == ExitCode.USAGE


def test_a_reap_kills_orphans_whatever_pre_kill_orphans_says(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(5))
    host.memory.claim(server, {5}, 1500)
    config = sweep_config(host, "reap_after_s = 60")
    config.write_text(config.read_text().replace("[pre]\n", "[pre]\nkill_orphans = false\n"))
    assert sweep(config, front(host), **at(1000.0)) == ExitCode.OK
    assert alive(server)
    assert sweep(config, front(host), **at(1060.0)) == ExitCode.OK
    assert not alive(server)


def test_install_nri_writes_its_service_and_uninstall_takes_back_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpugate install --nri` (issue 49): gpugate-nri.service running `gpugate nri`, written
    once, kept where edited, none where the package carries it; the options exclude each
    other."""
    from gpugate.front import install
    from gpugate.front.install import Action

    monkeypatch.setattr(install, "PACKAGED_DIR", tmp_path / "packaged")
    systemd = tmp_path / "system"
    planned = install.plan_shipped(
        install.NRI_SERVICE, systemd, ["/usr/bin/gpugate"], installing=True
    )
    assert [(c.path.name, c.action) for c in planned] == [("gpugate-nri.service", Action.WRITE)]
    install.apply(planned, reload=lambda: False)
    assert "ExecStart=/usr/bin/gpugate nri\n" in (systemd / "gpugate-nri.service").read_text()
    again = install.plan_shipped(
        install.NRI_SERVICE, systemd, ["/usr/bin/gpugate"], installing=True
    )
    assert [c.action for c in again] == [Action.UNCHANGED]
    service = systemd / "gpugate-nri.service"
    service.write_text(service.read_text() + "# mine\n")
    removed = install.plan_shipped(
        install.NRI_SERVICE, systemd, ["/usr/bin/gpugate"], installing=False
    )
    assert [c.action for c in removed] == [Action.KEEP]
    (tmp_path / "packaged").mkdir()
    (tmp_path / "packaged" / "gpugate-nri.service").write_text("packaged")
    assert (
        install.plan_shipped(install.NRI_SERVICE, systemd, ["/usr/bin/gpugate"], installing=True)
        == []
    )
    code = main(["install", "--nri", "--dry-run", "--systemd-dir", str(tmp_path / "other")])
    assert code == ExitCode.OK and not (tmp_path / "other").exists()
    assert main(["install", "--nri", "--sweep"]) == ExitCode.USAGE
    assert main(["install", "--nri", "vllm.service"]) == ExitCode.USAGE
    assert main(["uninstall", "--nri", "--containers"]) == ExitCode.USAGE
