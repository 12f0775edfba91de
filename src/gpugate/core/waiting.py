"""The waiting stage's work: wait for free GPUs and ports; what turns up meanwhile (a
respawn) is killed too, a transition back to stopping and again to waiting; then the wait's
outcome as facts."""

from __future__ import annotations

from dataclasses import dataclass

from gpugate.core.decide import Decision, spared_for_good
from gpugate.core.discover import Discovery
from gpugate.core.outcome import BusyGpu
from gpugate.core.run_state import TIMEOUT_MARGIN_S, RunState
from gpugate.core.stage import Stage, Transition
from gpugate.core.stopping import kill_rounds
from gpugate.core.wait import Settled, busy_gpus, wait_settled
from gpugate.host.nvml import Gpu
from gpugate.host.ports import listening_sockets


def wait(state: RunState, discovery: Discovery, decision: Decision) -> None:
    skipped = state.surroundings.not_to_wait_on(discovery.owned)
    owned = [gpu for gpu in discovery.owned if gpu not in skipped]
    if not owned and not state.ports:
        return
    wait_started = state.clock()
    state.spared_pids = spared_for_good(decision)
    settled = settle(state, owned)
    summary = state.summary
    summary.seconds_wait = state.clock() - wait_started
    summary.busy = settled.busy
    for gpu in owned:
        used_after = state.driver.usage(gpu).used_mib
        freed = max(state.used_before.get(gpu.index, 0) - used_after, 0)
        summary.freed_mib_by_gpu[gpu.index] = freed
    judge_wait(state, settled, owned)


def settle(state: RunState, owned: list[Gpu]) -> Settled:
    free_mib = state.config.free_mib
    narrator = state.narrator

    def on_progress(busy: list[BusyGpu], left: float) -> None:
        if busy:
            narrator.memory_wait(busy, free_mib, left)
        narrator.extend_timeout(left + TIMEOUT_MARGIN_S)

    return wait_settled(
        RunProbes(state, owned),
        deadline=state.deadline,
        on_progress=on_progress,
        clock=state.clock,
    )


@dataclass(frozen=True)
class RunProbes:
    """The wait's looks (core.wait.WaitProbes) at this run's GPUs, ports and killed."""

    state: RunState
    owned: list[Gpu]

    def busy_gpus(self) -> list[BusyGpu]:
        s = self.state
        return s.note_busy(busy_gpus(s.driver, self.owned, s.config.free_mib, s.spared_pids))

    def busy_ports(self) -> list[int]:
        s = self.state
        return sorted(set(listening_sockets(s.deps.roots.proc, s.ports).values()))

    def pending(self) -> list[int]:
        return self.state.watch.pending(self.state.procfs)

    def look_again(self) -> bool:
        return look_again(self.state)

    def known_pids(self) -> set[int]:
        return {i.pid for i in self.state.signalled} | self.state.spared_pids

    def watching(self) -> bool:
        return bool(self.state.watch.watched)


def judge_wait(state: RunState, settled: Settled, owned: list[Gpu]) -> None:
    """The wait's outcome: respawning, ports or memory still held, or all free."""
    busy, timeout_s = settled.busy, state.policy.wait_timeout_s
    narrator, facts, free_mib = state.narrator, state.facts, state.config.free_mib
    respawners = state.watch.respawners(state.procfs.still_same)
    if settled.held and respawners:
        narrator.respawning(respawners, timeout_s)
        facts.respawning = True
        return
    for respawner in respawners:
        narrator.respawned(respawner)
    failing = state.policy.on_timeout == "fail"
    for item in busy:
        narrator.memory_timeout(item, free_mib, timeout_s, failing=failing)
    if settled.ports:
        narrator.ports_held(settled.ports, timeout_s)
        facts.held_by_others = True
    if not busy:
        if owned and not settled.ports:
            narrator.memory_freed(owned, free_mib, state.summary.seconds_wait)
    elif failing:
        facts.memory_busy = True


def look_again(state: RunState) -> bool:
    """During the wait: rediscover, and kill new targets (respawns) as in the kill rounds."""
    discovery, decision = state.find()
    state.spared_pids |= spared_for_good(decision)
    fresh = state.fresh(decision)
    if not fresh:
        return False
    state.narrator.choices(Decision(fresh))  # kill_rounds announces only its later rounds
    state.enter(Stage.STOPPING, Transition.RESPAWNED)
    _, _, survivors = kill_rounds(state, discovery, decision)
    if survivors:
        state.facts.survivors = True
        state.narrator.survived(len(survivors))
    # Back to the wait, on the same deadline: a survivor's GPUs are still waited for.
    state.enter(Stage.WAITING, Transition.SURVIVED if survivors else Transition.STOPPED)
    return True
