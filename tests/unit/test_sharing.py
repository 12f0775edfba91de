"""GPUs shared on purpose (docs/what-gets-killed.md, "GPUs shared on purpose"): on a GPU the
run shares, another running workload's process is a sharer (spared, never a refusal, also
where it straddles), orphans there are still killed, and an unshared GPU keeps the whole-GPU
rule; the wait is for the memory no spared process accounts for."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from gpugate.config.schema import GateConfig
from gpugate.core.decide import Rule, Verdict, decide
from gpugate.core.discover import Holder, Source
from gpugate.core.roles import Role
from gpugate.errors import ExitCode
from gpugate.phase import Phase
from tests.fakes import FakeHost
from tests.unit.test_decide import Table, discovery, proc, tables

OTHER = "/system.slice/other.service"
POD = "/kubepods.slice/kubepods-besteffort.slice/cri-containerd-" + "a" * 64 + ".scope"
JOB = "/system.slice/node1_slurmstepd.scope/job_7/step_0/user/task_0"
LOGIN = "/user.slice/user-1000.slice/session-4.scope"


def holders_on(table: Table, gpus: dict[int, set[int]]) -> dict[int, Holder]:
    return {pid: Holder(table.procs[pid], {Source.NVML}, set(on)) for pid, on in gpus.items()}


def verdicts(shared: frozenset[int], owned: list[int], gpus: dict[int, set[int]], table: Table):  # type: ignore[no-untyped-def]
    found = discovery(table, holders_on(table, gpus), owned)
    decision = decide(found, GateConfig(), Phase.PRE, table, shared=shared)
    return decision, {c.holder.pid: (c.verdict, c.rule) for c in decision.choices}


def test_another_workloads_process_on_a_shared_gpu_is_a_sharer() -> None:
    for cgroup in (OTHER, POD, JOB):
        table = Table({10: proc(10, 1, cgroup), 20: proc(20, 1, LOGIN)})
        decision, chosen = verdicts(frozenset({0}), [0], {10: {0}, 20: {0}}, table)
        assert chosen[10] == (Verdict.SPARE, Rule.SHARER), cgroup
        assert chosen[20] == (Verdict.KILL, Rule.ORPHAN)  # the orphan there is still freed
        assert not decision.refused and not decision.blockers


def test_a_sharer_straddling_gpus_the_run_does_not_own_is_still_left_alone() -> None:
    table = Table({10: proc(10, 1, OTHER)})
    decision, chosen = verdicts(frozenset({0}), [0], {10: {0, 5}}, table)
    assert chosen[10] == (Verdict.SPARE, Rule.SHARER)
    assert not decision.refused


def test_an_unshared_gpu_keeps_the_whole_gpu_rule() -> None:
    table = Table({10: proc(10, 1, OTHER)})
    for shared, owned, on in (
        (frozenset(), [0], {0}),  # nothing shared
        (frozenset({1}), [0, 1], {0}),  # shared elsewhere
        (frozenset({0}), [0, 1], {0, 1}),  # on a shared and an unshared GPU of the run
    ):
        decision, chosen = verdicts(shared, owned, {10: on}, table)
        assert chosen[10] == (Verdict.BLOCK, Rule.OTHER_UNIT), (shared, owned, on)
        assert decision.refused


def test_a_sharer_is_never_killed_even_with_kill_other_units() -> None:
    table = Table({10: proc(10, 1, OTHER)})
    found = discovery(table, holders_on(table, {10: {0}}), [0])
    decision = decide(
        found, GateConfig(kill_other_units=True), Phase.PRE, table, shared=frozenset({0})
    )
    assert [c.rule for c in decision.choices] == [Rule.SHARER]
    assert not decision.targets


def test_a_process_listening_on_the_runs_port_is_no_sharer() -> None:
    table = Table({10: proc(10, 1, OTHER)})
    holder = Holder(table.procs[10], {Source.NVML, Source.PORT}, {0}, ports={8000})
    decision = decide(
        discovery(table, {10: holder}, [0]), GateConfig(), Phase.PRE, table, shared=frozenset({0})
    )
    assert decision.refused


@settings(max_examples=200, deadline=None)
@given(data=tables(), phase=st.sampled_from([Phase.PRE, Phase.POST]), bits=st.integers(0, 255))
def test_no_other_workloads_process_on_shared_gpus_is_ever_a_target_or_blocker(
    data: tuple[Table, dict[int, Holder], list[int], frozenset[int]], phase: Phase, bits: int
) -> None:
    table, holders, owned, self_chain = data
    shared = frozenset(i for i in owned if bits >> i & 1)
    found = discovery(table, holders, owned, self_chain)
    for kill_other in (False, True):
        decision = decide(
            found, GateConfig(kill_other_units=kill_other), phase, table, shared=shared
        )
        for choice in decision.choices:
            on_owned = choice.holder.using & set(owned)
            if (
                choice.role is Role.OTHER_UNIT
                and on_owned
                and on_owned <= shared
                and not choice.holder.ports
                and choice.rule is not Rule.APP_TREE
            ):
                assert choice.verdict is Verdict.SPARE and choice.rule is Rule.SHARER


def test_the_wait_is_for_memory_no_spared_process_accounts_for(host: FakeHost) -> None:
    """A protected process holding memory (an MPS server, say) does not make pre wait; memory
    that no process accounts for (a driver leak) still does."""
    (server,) = host.pool.holder(host.gpu_files(0))
    host.memory.claim(server, {0}, 30000)
    protected = [os.readlink(f"/proc/{server}/exe")]
    loaded = host.config(gpus=[0], protected_executables=protected, pre={"wait_timeout_s": 2.0})
    summary = host.run_phase(
        "pre", loaded, host.reporter("pre"), driver_factory=lambda: host.memory
    )
    assert summary.exit_code is ExitCode.OK
    assert os.path.exists(f"/proc/{server}")
    host.memory.leaked_mib[0] = 30000
    summary = host.run_phase(
        "pre", loaded, host.reporter("pre"), driver_factory=lambda: host.memory
    )
    assert summary.exit_code is not ExitCode.OK


def test_a_unit_with_share_gpus_shares_every_gpu_it_owns(host: FakeHost) -> None:
    from gpugate.core.run import RunScope
    from gpugate.integrations.unit import UnitContext
    from gpugate.report.journal import Reporter
    from tests.fakes import UNIT, UNIT_CGROUP, RecordingJournal

    table = Table({10: proc(10, 1, OTHER)})
    found = discovery(table, holders_on(table, {10: {2}}), [2, 3])
    for share, expected in ((True, {2, 3}), (False, set())):
        loaded = host.config(gpus=[2, 3], share_gpus=share)
        context = UnitContext(os.environ)
        scope = RunScope(Phase.PRE, UNIT, lambda: UNIT_CGROUP, roots=host.roots)
        reporter = Reporter(UNIT, "pre", journal=RecordingJournal(), echo=False)
        surroundings = context.surroundings(scope, loaded, reporter)
        assert surroundings.shared_gpus(found) == expected
