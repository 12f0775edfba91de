"""The kill rounds: the targets signalled (pidfd-pinned), rediscovered and signalled again
while new ones appear (forks), bounded in rounds and by the deadline. The stopping stage and
the wait (a respawn) both use them."""

from __future__ import annotations

from gpugate.core.decide import Choice, Decision
from gpugate.core.discover import Discovery
from gpugate.core.kill import terminate
from gpugate.core.run_state import RunState
from gpugate.host.containers import stop_containers
from gpugate.host.procfs import ProcessId

MAX_ROUNDS = 5


def kill_rounds(
    state: RunState, discovery: Discovery, decision: Decision
) -> tuple[Discovery, Decision, list[ProcessId]]:
    """Kill the targets; rediscover and repeat while new ones appear (forks)."""
    kill_started = state.clock()
    if state.scope.phase.traits.stops_containers and discovery.unit_containers:
        stop_unit_containers(state, discovery, decision)
    survivors: list[ProcessId] = []
    for round_number in range(1, MAX_ROUNDS + 1):
        fresh = state.fresh(decision)
        if not fresh:
            break
        survivors = kill_round(state, discovery, fresh, round_number)
        if survivors or state.clock() >= state.deadline:
            break
        discovery, decision = state.find()
        state.report_faults(discovery)
    state.summary.seconds_kill += state.clock() - kill_started
    for ident in survivors:
        state.narrator.survivor(state.signalled[ident])
    return discovery, decision, survivors


def kill_round(
    state: RunState, discovery: Discovery, fresh: list[Choice], round_number: int
) -> list[ProcessId]:
    by_ident = state.signalled
    state.summary.rounds += 1  # counted over the run: the wait may kill respawns too
    if round_number > 1:
        state.narrator.choices(Decision(fresh))
    state.narrator.stopping(len(fresh), round_number)
    state.note(processes=len(fresh), round_number=round_number)
    by_ident.update((c.holder.info.ident, c) for c in fresh)
    with state.procfs.oneshot():
        state.watch.killed(fresh, by_ident, state.procfs, self_chain=discovery.self_chain)
    policy = state.policy
    result = terminate(
        [c.holder.info.ident for c in fresh],
        grace_s=policy.sigterm_grace_s,
        sigkill_wait_s=policy.sigkill_wait_s,
        deadline=state.deadline,
        procfs=state.procfs,  # outside any oneshot(): every check reads /proc afresh
        on_signal=lambda ident, signum: state.narrator.signal_sent(by_ident[ident], signum),
        on_sigkill_wait=lambda idents: on_stuck(state, [by_ident[i] for i in idents]),
        pinner=state.deps.pinner,
        clock=state.clock,
    )
    state.summary.killed.extend(result.terminated + result.killed)
    return result.survivors


def stop_unit_containers(state: RunState, discovery: Discovery, decision: Decision) -> None:
    """The unit's own containers stop through their runtime first (it records them as
    stopped); the pinned signals then follow for any process that outlived it."""
    wanted = {c.holder.container.id for c in decision.targets if c.holder.container}
    containers = [c for c in discovery.unit_containers if c.id in wanted]
    state.narrator.container_stopping(len(containers))
    for result in stop_containers(containers, state.policy.sigterm_grace_s):
        state.narrator.container_stopped(result)


def on_stuck(state: RunState, choices: list[Choice]) -> None:
    for choice in choices:
        stat = state.procfs.stat(choice.holder.pid)
        process_state = stat.state if stat else "?"
        state.narrator.stuck(choice, process_state, state.procfs.wchan(choice.holder.pid))
