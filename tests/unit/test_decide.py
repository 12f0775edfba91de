"""The decision rules over synthetic process tables, including property tests: for any table,
nothing outside the unit's GPUs and cgroup, nothing protected, nothing of another active unit
(unless allowed), never gpugate, its ancestors or PID 1, and, of the rest of an application,
never a login or pane shell, a terminal's host (sshd, tmux or screen server), a process split
from a live group leader left out, or another user's process; and a daemonized server's whole
tree is always taken."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpugate.config.schema import GateConfig
from gpugate.core.decide import Decision, Verdict, decide
from gpugate.core.discover import Discovery, Holder, Source
from gpugate.core.roles import Role, in_cgroup
from gpugate.host.nvml import Gpu
from gpugate.host.scan import ProcInfo
from gpugate.phase import Phase

UNIT_CG = "/system.slice/vllm.service"
CGROUPS = [
    UNIT_CG,
    UNIT_CG + "/sub",
    "/user.slice/user-0.slice/session-1.scope",
    "/user.slice/user-1000.slice/user@1000.service/app.slice/x.service",
    "/system.slice/other.service",
    "/system.slice/nvidia-persistenced.service",
    "/system.slice/docker-abc.scope",
    "/",
    "/init.scope",
]
GPUS = [Gpu(i, f"GPU-{i:08x}-0000", i, "g", 1000) for i in range(8)]


@dataclass
class Table:
    procs: dict[int, ProcInfo] = field(default_factory=dict)

    def info(self, pid: int) -> ProcInfo | None:
        return self.procs.get(pid)

    def children(self, pid: int) -> list[int]:
        return [p.pid for p in self.procs.values() if p.ppid == pid and p.pid != pid]


def proc(
    pid: int,
    ppid: int,
    cgroup: str,
    *,
    session: int = 0,
    pgrp: int = 0,
    uid: int = 0,
    exe: str = "/usr/bin/python3",
    tty: int = 0,
) -> ProcInfo:
    return ProcInfo(
        pid=pid,
        start_time=100 + pid,
        comm="p",
        state="S",
        ppid=ppid,
        pgrp=pgrp or pid,
        session=session or 1,
        tty_nr=tty,
        kernel_thread=False,
        uid=uid,
        cgroup=cgroup,
        cmdline=("p",),
        exe=exe,
    )


def discovery(
    table: Table,
    holders: dict[int, Holder],
    owned: list[int],
    self_chain: frozenset[int] = frozenset({999}),
) -> Discovery:
    return Discovery(
        unit="vllm.service",
        unit_cgroup=UNIT_CG,
        gpus=GPUS,
        owned=[GPUS[i] for i in owned],
        usage={},
        holders=holders,
        self_chain=self_chain,
        unreadable=[],
    )


def test_other_unit_blocks_and_refuses_everything() -> None:
    table = Table(
        {
            10: proc(10, 1, "/system.slice/other.service"),
            20: proc(20, 1, "/user.slice/user-0.slice/session-1.scope"),
        }
    )
    holders = {
        10: Holder(table.procs[10], {Source.NVML}, {0}),
        20: Holder(table.procs[20], {Source.DEVICE_FD}, {1}),
    }
    decision = decide(discovery(table, holders, [0, 1]), GateConfig(), Phase.PRE, table)
    assert decision.refused
    assert [c.holder.pid for c in decision.blockers] == [10]
    allowed = decide(
        discovery(table, holders, [0, 1]), GateConfig(kill_other_units=True), Phase.PRE, table
    )
    assert {c.holder.pid for c in allowed.targets} == {10, 20}


def test_app_tree_stops_at_session_leader_pgrp_change_and_foreign_gpus() -> None:
    scope = "/user.slice/user-0.slice/session-1.scope"
    table = Table(
        {
            50: proc(50, 1, scope, session=50, pgrp=50),  # sshd session / login shell
            51: proc(51, 50, scope, session=50, pgrp=51),  # server, its own job group
            52: proc(52, 51, scope, session=50, pgrp=51),  # engine core
            53: proc(53, 52, scope, session=50, pgrp=51),  # worker on GPU 0
            54: proc(54, 51, scope, session=50, pgrp=51),  # resource tracker
            55: proc(55, 50, scope, session=50, pgrp=55),  # another job of the same shell
        }
    )
    holders = {53: Holder(table.procs[53], {Source.DEVICE_FD}, {0})}
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    assert {c.holder.pid for c in decision.targets} == {51, 52, 53, 54}
    # A worker of the same application on a GPU the unit does not own: no expansion.
    holders[54] = Holder(table.procs[54], {Source.DEVICE_FD}, {5})
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    assert {c.holder.pid for c in decision.targets} == {53}


def test_app_tree_from_ssh_sessions_never_takes_sshd() -> None:
    scope = "/user.slice/user-1000.slice/session-4.scope"
    table = Table(
        {
            30: proc(30, 1, scope, session=30, pgrp=30),  # sshd: user [priv], root
            31: proc(31, 30, scope, session=30, pgrp=30, uid=1000),  # sshd: user@notty
            32: proc(32, 31, scope, session=32, pgrp=32, uid=1000),  # bash -c 'vllm serve'
            33: proc(33, 32, scope, session=32, pgrp=32, uid=1000),  # API server
            34: proc(34, 33, scope, session=32, pgrp=32, uid=1000),  # worker
            40: proc(40, 1, scope, session=40, pgrp=40),  # sshd: user [priv]
            41: proc(41, 40, scope, session=40, pgrp=40, uid=1000),  # sshd: user@pts/0
            42: proc(42, 41, scope, session=42, pgrp=42, uid=1000, tty=34816),  # login shell
            43: proc(43, 42, scope, session=42, pgrp=43, uid=1000, tty=34816),  # its job
            44: proc(44, 43, scope, session=42, pgrp=43, uid=1000, tty=34816),  # worker
        }
    )
    for holder, expected in ((34, {32, 33, 34}), (44, {43, 44})):
        holders = {holder: Holder(table.procs[holder], {Source.DEVICE_FD}, {0})}
        decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
        assert {c.holder.pid for c in decision.targets} == expected
    # Without the monitor's group check, the user's sshd process would be taken.
    del table.procs[30]
    holders = {34: Holder(table.procs[34], {Source.DEVICE_FD}, {0})}
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    assert {c.holder.pid for c in decision.targets} == {31, 32, 33, 34}


def test_app_tree_never_crosses_to_another_user_nor_takes_a_supervisor() -> None:
    scope = "/user.slice/user-0.slice/session-5.scope"
    table = Table(
        {
            50: proc(50, 1, scope, session=50, pgrp=50),  # root's launcher (su, sudo)
            51: proc(51, 50, scope, session=50, pgrp=50, uid=1000),  # the server, as a user
            52: proc(52, 51, scope, session=50, pgrp=50, uid=1000),  # its worker
            60: proc(60, 1, scope, session=60, pgrp=60),  # a supervisor of two daemons
            61: proc(61, 60, scope, session=61, pgrp=61),  # daemon 1 (the stale server)
            62: proc(62, 61, scope, session=61, pgrp=61),  # its worker
            63: proc(63, 60, scope, session=63, pgrp=63),  # daemon 2
        }
    )
    for holder, expected in ((52, {51, 52}), (62, {61, 62})):
        holders = {holder: Holder(table.procs[holder], {Source.DEVICE_FD}, {0})}
        decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
        assert {c.holder.pid for c in decision.targets} == expected
    # A launcher of one daemon that only waits on it is the application's.
    del table.procs[63]
    holders = {62: Holder(table.procs[62], {Source.DEVICE_FD}, {0})}
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    assert {c.holder.pid for c in decision.targets} == {60, 61, 62}


def test_app_tree_never_takes_a_launcher_that_hosts_a_terminal_elsewhere() -> None:
    """A launcher whose child on the way up is in its own session and job, but which also has a
    child leading a session on a terminal, is a terminal's host (an sshd, a tmux server, a
    Jupyter server with a terminal open): the app tree stops below it, whatever cgroup that
    terminal is in. Hypothesis's shrunk falsifying example of the property test below."""
    scope = "/user.slice/user-0.slice/session-1.scope"
    for pane_cgroup in (UNIT_CG, scope):
        table = Table(
            {
                1: proc(1, 0, "/init.scope", session=1, pgrp=1),
                2: proc(2, 1, scope, session=2, pgrp=2),  # hosts 13's terminal
                4: proc(4, 2, scope, session=2, pgrp=2),  # the holder, in 2's session and job
                13: proc(13, 2, pane_cgroup, session=13, pgrp=13, tty=34816),  # a pane's shell
            }
        )
        holders = {4: Holder(table.procs[4], {Source.NVML}, {0})}
        decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
        assert {c.holder.pid for c in decision.targets} == {4}


def test_protected_by_unit_or_executable() -> None:
    table = Table(
        {
            10: proc(10, 1, "/system.slice/nvidia-persistenced.service"),
            11: proc(11, 1, "/", exe="/usr/bin/nv-hostengine"),
            12: proc(12, 1, UNIT_CG, exe="/usr/bin/nvidia-smi"),
        }
    )
    holders = {
        pid: Holder(info, {Source.DEVICE_FD}, set(range(8))) for pid, info in table.procs.items()
    }
    decision = decide(discovery(table, holders, list(range(8))), GateConfig(), Phase.PRE, table)
    assert not decision.targets and not decision.blockers
    assert {c.role for c in decision.spared} == {Role.PROTECTED}


@st.composite
def tables(draw: st.DrawFn) -> tuple[Table, dict[int, Holder], list[int], frozenset[int]]:
    count = draw(st.integers(2, 25))
    table = Table()
    for pid in range(2, count + 2):
        ppid = draw(st.sampled_from([1, *range(2, pid)]))
        parent = table.procs.get(ppid)
        session = draw(st.sampled_from([pid, parent.session if parent else 1]))
        leader = session == pid
        table.procs[pid] = proc(
            pid,
            ppid,
            draw(st.sampled_from(CGROUPS)),
            session=session,
            # setsid makes a process lead its group too
            pgrp=pid if leader else draw(st.sampled_from([pid, parent.pgrp if parent else 1])),
            uid=draw(st.sampled_from([0, 1000])),
            exe=draw(st.sampled_from(["/usr/bin/python3", "/usr/bin/nvidia-persistenced"])),
            tty=draw(st.sampled_from([0, 34816])) if leader else (parent.tty_nr if parent else 0),
        )
    table.procs[1] = proc(1, 0, "/init.scope", session=1, pgrp=1)
    holders: dict[int, Holder] = {}
    for pid, info in table.procs.items():
        gpus = draw(st.sets(st.integers(0, 7), max_size=3))
        in_unit = in_cgroup(info.cgroup, UNIT_CG)
        if gpus or in_unit or draw(st.booleans()):
            sources = {Source.CGROUP} if in_unit else set()
            holders[pid] = Holder(info, sources | ({Source.NVML} if gpus else set()), set(gpus))
    owned = sorted(draw(st.sets(st.integers(0, 7), min_size=1)))
    self_chain = frozenset(draw(st.sets(st.sampled_from(sorted(table.procs)), max_size=3)))
    return table, holders, owned, self_chain


def _terminal_host_beside_the_holder() -> tuple[
    Table, dict[int, Holder], list[int], frozenset[int]
]:
    """The shrunk falsifying example hypothesis found (stored in a local example database):
    2 hosts 13's terminal and launched the holder 4 in its own session and job."""
    scope = "/user.slice/user-0.slice/session-1.scope"
    table = Table(
        {
            1: proc(1, 0, "/init.scope", session=1, pgrp=1),
            2: proc(2, 1, scope, session=2, pgrp=2),
            4: proc(4, 2, scope, session=2, pgrp=2),
            13: proc(13, 2, UNIT_CG, session=13, pgrp=13, tty=34816),
        }
    )
    holders = {
        4: Holder(table.procs[4], {Source.NVML}, {0}),
        13: Holder(table.procs[13], {Source.CGROUP}, set()),
    }
    return table, holders, [0], frozenset()


@settings(max_examples=300, deadline=None)
@given(data=tables(), phase=st.sampled_from([Phase.PRE, Phase.POST]), kill_other=st.booleans())
@example(data=_terminal_host_beside_the_holder(), phase=Phase.PRE, kill_other=False)
def test_never_chooses_outside_the_units_gpus_and_cgroup(
    data: tuple[Table, dict[int, Holder], list[int], frozenset[int]], phase: Phase, kill_other: bool
) -> None:
    table, holders, owned, self_chain = data
    config = GateConfig(kill_other_units=kill_other)
    found = discovery(table, holders, owned, self_chain)
    decision = decide(found, config, phase, table)
    for choice in decision.targets:
        info = choice.holder.info
        in_unit = in_cgroup(info.cgroup, UNIT_CG)
        assert info.pid != 1 and info.pid not in self_chain
        assert choice.role is not Role.PROTECTED
        assert info.exe not in config.protected_executables
        assert "nvidia-persistenced.service" not in (info.cgroup or "")
        if not in_unit:
            assert not (choice.holder.using - set(owned)), "takes a GPU the unit does not own"
            if choice.role is Role.OTHER_UNIT:
                assert kill_other
            if not choice.holder.using & set(owned):
                assert Source.APP_TREE in choice.holder.sources
                _assert_no_host(info, table, decision)
    for choice in decision.blockers:
        straddles = bool(choice.holder.using - set(owned))
        if choice.role is Role.OTHER_UNIT:
            assert straddles or not kill_other
        else:
            assert choice.role is Role.ORPHAN
            assert straddles or phase is Phase.POST
    targets = {c.holder.pid for c in decision.targets}
    assert len(targets) == len(decision.targets)
    assert all(c.verdict is Verdict.KILL for c in decision.targets)


def _assert_no_host(info: ProcInfo, table: Table, decision: Decision) -> None:
    """What the rest of an application may never hold, in kernel facts."""
    taken = {c.holder.pid for c in decision.targets}
    children = [table.procs[pid] for pid in table.children(info.pid)]
    if info.pid == info.session and info.tty_nr:
        # A shell on a terminal that put a child in a job (process group) of its own.
        assert not any(c.session == info.session and c.pgrp != info.pgrp for c in children), (
            f"job-control shell {info.pid} taken"
        )
    assert not any(c.pid == c.session and c.tty_nr for c in children), (
        f"terminal host {info.pid} (sshd, tmux or screen server) taken"
    )
    leader = table.procs.get(info.pgrp)
    if any(c.pid in taken and c.session != info.session for c in children):
        # A launcher of a new session (sshd's user process) whose group leader stays.
        assert leader is None or leader.pid == info.pid or leader.pid in taken, (
            f"{info.pid} split from its group leader {info.pgrp}"
        )
    seeds = [c.holder.info for c in decision.targets if Source.APP_TREE not in c.holder.sources]
    assert any(s.uid == info.uid and s.cgroup == info.cgroup for s in seeds), (
        f"{info.pid} taken from another user or cgroup"
    )


@st.composite
def daemons(draw: st.DrawFn) -> tuple[Table, dict[int, Holder], int]:
    """A daemonized server (its own session, no terminal, adopted by PID 1) with a random tree
    in its session and group, one holder in it, next to a login shell and its jobs."""
    scope = "/user.slice/user-1000.slice/session-3.scope"
    table = Table({1: proc(1, 0, "/init.scope", session=1, pgrp=1)})
    table.procs[10] = proc(10, 1, scope, session=10, pgrp=10, uid=1000, tty=34816)  # shell
    table.procs[11] = proc(11, 10, scope, session=10, pgrp=11, uid=1000, tty=34816)  # its job
    top = 20
    table.procs[top] = proc(top, 1, scope, session=top, pgrp=top, uid=1000)
    count = draw(st.integers(1, 15))
    for pid in range(top + 1, top + 1 + count):
        ppid = draw(st.sampled_from(range(top, pid)))
        table.procs[pid] = proc(pid, ppid, scope, session=top, pgrp=top, uid=1000)
    holder_pid = draw(st.sampled_from(range(top, top + 1 + count)))
    holders = {holder_pid: Holder(table.procs[holder_pid], {Source.DEVICE_FD}, {0})}
    return table, holders, top


@settings(max_examples=200, deadline=None)
@given(data=daemons())
def test_a_daemonized_servers_whole_tree_is_taken(
    data: tuple[Table, dict[int, Holder], int],
) -> None:
    table, holders, top = data
    decision = decide(discovery(table, holders, [0]), GateConfig(), Phase.PRE, table)
    taken = {c.holder.pid for c in decision.targets}
    assert taken == {pid for pid in table.procs if pid >= top}
