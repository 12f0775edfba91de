"""The sweep's owners that do not depend on timing (issue 47): a device holder NVML lists
nowhere is a watcher whatever the GPUs' memory says (a late free, a leak); the reap acts only on
evidence of memory; an attended logind session's holder is `session`, a closed one's `nobody`;
unowned time counts on the boot clock; the sweep's errors and warnings are journal entries;
a slice's holder is named by its slice alone."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from gpugate.config.schema import GateConfig
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import HolderOwner, Owner, holds_memory, owner_of
from gpugate.errors import ExitCode
from gpugate.front.commands.sweep import reapable, remember, tracked
from gpugate.host.logind import Logind, SessionState, session_of_cgroup
from gpugate.host.nvml import GpuProcess, GpuUsage, mig_key
from gpugate.host.scan import ProcessId
from gpugate.integrations.records import STATE_NAME, Seen, boot_time
from gpugate.report.journal import Reporter
from tests.commands.test_sweep import GPUS, front, metric, nvml_holder, proc, sweep_config
from tests.fakes import FakeHost, RecordingJournal, RecordingNotifier, alive

SESSION_CG = "/user.slice/user-1000.slice/session-7.scope"


def usage_of(
    listed: dict[int, list[tuple[int, int | None]]],
    unlisted: dict[int, int] | None = None,
    *,
    complete: bool = True,
) -> dict[int, GpuUsage]:
    """Each GPU: NVML's (PID, MiB) list, plus memory it lists for no process (a late free, a
    leak); complete=False: a driver that cannot list processes."""
    unlisted = unlisted or {}
    usage = {}
    for gpu in GPUS:
        procs = tuple(GpuProcess(pid, mib) for pid, mib in listed.get(gpu.index, []))
        used = sum(mib or 0 for _, mib in listed.get(gpu.index, [])) + unlisted.get(gpu.index, 0)
        usage[gpu.index] = GpuUsage(gpu, used, procs if complete else (), processes_listed=complete)
    return usage


def looked(holders: list[Holder], usage: dict[int, GpuUsage]) -> Discovery:
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


def device_holder(pid: int, *gpus: int, cgroup: str = "/", mapped: tuple[int, ...] = ()) -> Holder:
    sources = {Source.DEVICE_FD} | ({Source.DEVICE_MAP} if mapped else set())
    return Holder(proc(pid, cgroup), sources, set(gpus), mapped=set(mapped))


ALL = tuple(range(len(GPUS)))
SERVER = [(50, 4000)]  # vllm on GPU 0, listed with its memory


@pytest.mark.parametrize(
    ("gpus", "unlisted"),
    [
        (ALL, {2: 20000}),  # nvtop on every GPU while the driver frees a killed server late
        (ALL, {1: 100, 2: 20000, 3: 7}),  # several GPUs at once
        (ALL, {3: 30000}),  # a driver leak, no process at all
        ((3,), {3: 30000}),  # a monitor of the leaking GPU alone, 0 MiB of its own
        ((1,), {}),  # a monitor of one idle GPU
        ((0,), {}),  # a monitor of vllm's GPU: memory all vllm's
        ((0, 3), {0: 500, 3: 30000}),  # both: vllm's GPU and the leak
    ],
)
def test_a_device_holder_nvml_lists_nowhere_is_a_watcher_whatever_the_memory_says(
    gpus: tuple[int, ...], unlisted: dict[int, int]
) -> None:
    watcher = device_holder(11, *gpus)
    server = nvml_holder(proc(50, "/system.slice/vllm.service"), gpu=0)
    server.used_mib = {0: 4000}
    discovery = looked([watcher, server], usage_of({0: SERVER}, unlisted))
    assert owner_of(watcher, discovery, GateConfig()) is Owner.WATCHER
    holdings = [HolderOwner(watcher, Owner.WATCHER), HolderOwner(server, Owner.UNIT)]
    seen = remember(holdings, {}, 0.0, None)
    assert seen == {}
    assert reapable(discovery, holdings, seen, 1e6, after_s=60, leased=set()) == []


@pytest.mark.parametrize(
    ("holder", "key", "memory"),
    [
        # it maps a GPU's memory (CUDA maps /dev/nvidiaN), NVML lists it nowhere: nobody, with memory
        (device_holder(12, 0, 1, mapped=(1,)), 1, True),
        (device_holder(12, 0, 1, mapped=(1,)), 0, False),
        (device_holder(12, 2, mapped=(2,)), 2, True),
    ],
)
def test_a_holder_mapping_a_gpus_memory_is_nobodys_and_its_memory_is_evidence(
    holder: Holder, key: int, memory: bool
) -> None:
    discovery = looked([holder], usage_of({}, {key: 900}))
    assert owner_of(holder, discovery, GateConfig()) is Owner.NOBODY
    assert holds_memory(holder, key, discovery) is memory


def test_nvml_listing_with_memory_is_evidence_listing_with_none_too_with_zero_not() -> None:
    with_mib = nvml_holder(proc(20, "/"), gpu=2)
    unknown = nvml_holder(proc(21, "/"), gpu=2)
    unknown.used_mib = {2: None}
    zero = nvml_holder(proc(22, "/"), gpu=2)
    zero.used_mib = {2: 0}
    discovery = looked([with_mib, unknown, zero], usage_of({2: [(20, 100), (21, None)]}))
    assert [holds_memory(h, 2, discovery) for h in (with_mib, unknown, zero)] == [
        True,
        True,
        False,
    ]


def test_where_nvml_cannot_list_processes_device_files_are_the_evidence_and_no_one_watches() -> (
    None
):
    monitor = device_holder(13, 0, 1, 2)
    discovery = looked([monitor], usage_of({}, {1: 500}, complete=False))
    assert owner_of(monitor, discovery, GateConfig()) is Owner.NOBODY
    assert all(holds_memory(monitor, key, discovery) for key in (0, 1, 2))
    assert not holds_memory(monitor, 3, discovery)


def ages(*pids: int, since: float = 0.0) -> dict[ProcessId, Seen]:
    return {ProcessId(pid, 100 + pid): Seen(since, ()) for pid in pids}


def test_a_gpu_whose_unowned_holders_have_no_memory_there_is_never_reaped() -> None:
    """A holder listed with 0 MiB beside one with memory: in doubt, the GPU is not reaped;
    alone, the one with memory makes it reapable; a mapper too."""
    server = nvml_holder(proc(30, "/"), gpu=1)
    zero = nvml_holder(proc(31, "/"), gpu=1)
    zero.used_mib = {1: 0}
    mapper = device_holder(32, 2, mapped=(2,))
    discovery = looked([server, zero, mapper], usage_of({1: [(30, 100), (31, 0)]}))
    owners = {h.pid: owner_of(h, discovery, GateConfig()) for h in (server, zero, mapper)}
    assert set(owners.values()) == {Owner.NOBODY}
    seen = ages(30, 31, 32)
    both = [HolderOwner(h, Owner.NOBODY) for h in (server, zero, mapper)]
    found = reapable(discovery, both, seen, 1000.0, after_s=60, leased=set())
    assert [gpu.index for gpu in found] == [2]
    alone = [HolderOwner(h, Owner.NOBODY) for h in (server, mapper)]
    found = reapable(discovery, alone, seen, 1000.0, after_s=60, leased=set())
    assert [gpu.index for gpu in found] == [1, 2]
    only_zero = [HolderOwner(zero, Owner.NOBODY)]
    assert reapable(discovery, only_zero, seen, 1000.0, after_s=60, leased=set()) == []


def session_file(folder: Path, session: str, text: str, mode: int = 0o644, uid: int = 0) -> None:
    path = folder / session
    path.write_text(text)
    os.chown(path, uid, 0)
    path.chmod(mode)


LOGIND = (
    "# This is private data. Do not parse.\nUID=1000\nUSER=alice\nACTIVE={active}\n"
    "IS_DISPLAY=0\nSTATE={state}\nREMOTE=1\nSCOPE=session-7.scope\n"
)


@pytest.mark.root("chown: the state file of a session must be root's")
@pytest.mark.parametrize(
    ("text", "mode", "uid", "owner"),
    [
        (LOGIND.format(active=1, state="active"), 0o644, 0, Owner.SESSION),
        (LOGIND.format(active=0, state="online"), 0o644, 0, Owner.SESSION),
        # logged out, a tmux server left in the session's scope (KillUserProcesses=no)
        (LOGIND.format(active=0, state="closing"), 0o644, 0, Owner.NOBODY),
        (None, 0o644, 0, Owner.NOBODY),  # no file: logind knows no such session
        # what root did not write, or cannot read as logind's: in doubt, attended
        (LOGIND.format(active=0, state="closing"), 0o644, 1000, Owner.SESSION),
        (LOGIND.format(active=0, state="closing"), 0o664, 0, Owner.SESSION),
        ("STATE=closing\n" + "X=y\n" * 5000, 0o644, 0, Owner.SESSION),
        ("garbage", 0o644, 0, Owner.SESSION),
    ],
)
def test_an_attended_sessions_holder_is_the_sessions_a_closed_ones_nobodys(
    tmp_path: Path, text: str | None, mode: int, uid: int, owner: Owner
) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    if text is not None:
        session_file(sessions, "7", text, mode, uid)
    holder = nvml_holder(proc(40, SESSION_CG + "/tmux-spawn-1.scope"), gpu=1)
    discovery = looked([holder], usage_of({1: [(40, 100)]}))
    assert owner_of(holder, discovery, GateConfig(), Logind(sessions)) is owner


@pytest.mark.parametrize(
    ("cgroup", "session"),
    [
        ("/user.slice/user-1000.slice/session-7.scope", "7"),
        ("/user.slice/user-0.slice/session-c12.scope/sub", "c12"),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/session-7.scope", None),
        ("/system.slice/session-7.scope", None),
        ("/user.slice/session-7.scope", None),
        ("/user.slice/user-1000.slice/session-.scope", None),
        ("/", None),
        (None, None),
    ],
)
def test_a_session_is_named_by_the_scope_pid1_made_not_by_a_users_own_unit(
    cgroup: str | None, session: str | None
) -> None:
    assert session_of_cgroup(cgroup) == session


def test_a_missing_sessions_folder_says_nothing_either_way(tmp_path: Path) -> None:
    assert Logind(tmp_path / "none").state("7") is SessionState.UNKNOWN


def test_an_attended_sessions_gpu_is_not_reaped_unless_the_operator_says_so() -> None:
    attended = nvml_holder(proc(41, SESSION_CG), gpu=1)
    left = nvml_holder(proc(42, "/"), gpu=1)
    discovery = looked([attended, left], usage_of({1: [(41, 100), (42, 100)]}))
    holdings = [HolderOwner(attended, Owner.SESSION), HolderOwner(left, Owner.NOBODY)]
    seen = remember(holdings, {}, 0.0, None)
    assert list(seen) == [left.info.ident]
    assert reapable(discovery, holdings, seen, 1000.0, after_s=60, leased=set()) == []
    kinds = tracked(True)
    seen = remember(holdings, {}, 0.0, None, kinds)
    found = reapable(discovery, holdings, seen, 1000.0, after_s=60, leased=set(), kinds=kinds)
    assert [gpu.index for gpu in found] == [1]


def test_a_slice_holder_is_named_by_its_slice_alone() -> None:
    journal = RecordingJournal()
    reporter = Reporter(
        "gpugate-sweep.service", "sweep", journal=journal, notifier=RecordingNotifier()
    )
    slice_key = mig_key(0, 1)
    orphan = Holder(proc(43, "/"), {Source.NVML, Source.DEVICE_FD}, {0, slice_key})
    orphan.used_mib = {slice_key: 5000}
    seen = remember([HolderOwner(orphan, Owner.NOBODY)], {}, 0.0, reporter)
    (entry,) = journal.events("unowned_seen")
    assert entry["GPUGATE_GPU"] == str(slice_key)
    assert seen[orphan.info.ident].gpus == (slice_key,)


# With real processes on the fake host.


def test_the_reap_spares_watchers_during_a_leak_and_takes_the_orphan_with_memory(
    host: FakeHost,
) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    (nvtop,) = host.pool.holder(host.gpu_files(*range(8)))
    (monitor,) = host.pool.holder(host.gpu_files(5))  # nvitop --only 5
    host.memory.leaked_mib[5] = 30000
    config = sweep_config(host, "reap_after_s = 60")
    assert sweep_at(host, config, 1000.0) == ExitCode.OK
    seen = {e["GPUGATE_PID"] for e in host.journal.events("unowned_seen")}
    assert seen == {str(server)}
    assert metric(host, "gpugate_unowned_processes", gpu="5") == 0
    assert metric(host, "gpugate_gpu_memory_mib", gpu="5", owner="unlisted") == 30000
    assert sweep_at(host, config, 1061.0) == ExitCode.OK
    assert not alive(server) and alive(nvtop) and alive(monitor)
    killed = {e["GPUGATE_PID"] for e in host.journal.events("signal_sent")}
    assert killed == {str(server)}
    assert sweep_at(host, config, 1200.0) == ExitCode.OK  # the leak stays: nothing to reap
    assert alive(nvtop) and alive(monitor)
    assert {e["GPUGATE_PID"] for e in host.journal.events("signal_sent")} == killed


def test_watchers_stay_watchers_while_a_killed_holder_is_freed_late(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(4))
    host.memory.claim(server, {4}, 20000)
    host.memory.release_lag_s = 3600.0  # the driver frees its memory late: longer than the test
    (nvtop,) = host.pool.holder(host.gpu_files(*range(8)))
    os.kill(server, signal.SIGKILL)  # killed by a start's pre, say
    host.pool.popens[0].wait(timeout=10)
    config = sweep_config(host, "reap_after_s = 60")
    for step in range(4):
        assert sweep_at(host, config, 1000.0 + 61 * step) == ExitCode.OK
        assert metric(host, "gpugate_gpu_memory_mib", gpu="4", owner="unlisted") == 20000
    assert alive(nvtop)
    assert not host.journal.events("unowned_seen") and not host.journal.events("signal_sent")
    assert all(metric(host, "gpugate_unowned_processes", gpu=str(i)) == 0 for i in range(8))


def sweep_at(host: FakeHost, config: Path, boot: float, wall: float | None = None) -> int:
    from gpugate.front.commands.sweep import sweep

    return sweep(
        config, front(host), clock=lambda: boot if wall is None else wall, boot_clock=lambda: boot
    )


def test_a_wall_clock_step_reaps_nothing(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    config = sweep_config(host, "reap_after_s = 120")
    assert sweep_at(host, config, 500.0, wall=1_000_000.0) == ExitCode.OK
    # NTP steps the wall clock by an hour between two sweeps a minute apart
    assert sweep_at(host, config, 560.0, wall=1_003_660.0) == ExitCode.OK
    assert alive(server)
    assert metric(host, "gpugate_unowned_seconds", gpu="2") == 60
    assert metric(host, "gpugate_sweep_timestamp_seconds") == 1_003_660
    assert sweep_at(host, config, 621.0, wall=1_003_721.0) == ExitCode.OK
    assert not alive(server)  # 121 s on the boot clock


def test_a_state_from_the_wall_clock_is_refused_with_a_warning_and_every_holder_is_new(
    host: FakeHost,
) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    from tests.fakes import start_time_of

    locks = host.root / "locks"
    locks.mkdir()
    old = {"pid": server, "start_time": start_time_of(server), "since": 1.7e9, "gpus": [2]}
    (locks / STATE_NAME).write_text(json.dumps({"version": 1, "unowned": [old]}))
    config = sweep_config(host, "reap_after_s = 60")
    assert sweep_at(host, config, 500.0) == ExitCode.OK
    (warning,) = host.journal.events("warning")
    assert warning["GPUGATE_REASON"] == "sweep-state-refused"
    assert warning["SYSLOG_IDENTIFIER"] == "gpugate" and warning["PRIORITY"] == "4"
    assert [e["GPUGATE_PID"] for e in host.journal.events("unowned_seen")] == [str(server)]
    assert json.loads((locks / STATE_NAME).read_text())["version"] == 2
    assert sweep_at(host, config, 540.0) == ExitCode.OK
    assert alive(server) and len(host.journal.events("warning")) == 1
    assert sweep_at(host, config, 561.0) == ExitCode.OK
    assert not alive(server)


def test_a_since_from_another_boot_starts_again(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    config = sweep_config(host, "reap_after_s = 60")
    assert sweep_at(host, config, 5000.0) == ExitCode.OK
    assert sweep_at(host, config, 30.0) == ExitCode.OK  # the state outlived a reboot
    assert alive(server)
    assert sweep_at(host, config, 89.0) == ExitCode.OK
    assert alive(server)
    assert sweep_at(host, config, 91.0) == ExitCode.OK
    assert not alive(server)


def test_a_config_error_is_the_sweeps_journal_entry(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    config = host.root / "bad.toml"
    config.write_text("[sweep]\nreap_after_s = 5\n")
    assert sweep_at(host, config, 100.0) == ExitCode.CONFIG
    (error,) = host.journal.events("error")
    assert error["GPUGATE_UNIT"] == "gpugate-sweep.service" and error["GPUGATE_PHASE"] == "sweep"
    assert error["GPUGATE_EXIT_CODE"] == str(int(ExitCode.CONFIG))
    assert error["SYSLOG_IDENTIFIER"] == "gpugate" and "MESSAGE_ID" in error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sweep.reap_after_s" in err


def test_a_state_not_written_is_a_journal_warning(host: FakeHost) -> None:
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    in_the_way = host.root / "locks" / STATE_NAME
    in_the_way.mkdir(parents=True)
    (in_the_way / "x").write_text("a folder where the state goes")
    config = sweep_config(host)
    assert sweep_at(host, config, 100.0) == ExitCode.OK
    reasons = [e["GPUGATE_REASON"] for e in host.journal.events("warning")]
    assert "sweep-state-unwritten" in reasons


def test_the_boot_clock_is_the_kernels() -> None:
    first = boot_time()
    assert 0 < first <= boot_time()


def test_the_reaps_run_keeps_the_sweeps_watchers_on_a_gpu_whose_memory_is_not_all_listed(
    host: FakeHost,
) -> None:
    """The reaped GPU also has memory NVML lists for nobody: pre's own test would call nvtop
    an orphan straddling every GPU (exit 22); the sweep's watcher stays one, the orphan goes."""
    (server,) = host.pool.holder(host.gpu_files(2))
    host.memory.claim(server, {2}, 4000)
    host.memory.leaked_mib[2] = 3000  # more than free_mib
    (nvtop,) = host.pool.holder(host.gpu_files(*range(8)))
    config = host.root / "sweep.toml"
    config.write_text(
        f'lock_dir = "{host.root / "locks"}"\n'
        "[pre]\nsigterm_grace_s = 0.5\nsigkill_wait_s = 0.5\nwait_timeout_s = 2.0\n"
        "[sweep]\nreap_after_s = 60\n"
    )
    assert sweep_at(host, config, 1000.0) == ExitCode.OK
    code = sweep_at(host, config, 1061.0)
    assert code == ExitCode.MEMORY_TIMEOUT  # the leak stays: the reap says so, refuses nothing
    assert not alive(server) and alive(nvtop)
    spared = {e["GPUGATE_PID"]: e["GPUGATE_REASON"] for e in host.journal.events("process_spared")}
    assert spared[str(nvtop)] == "watcher"
