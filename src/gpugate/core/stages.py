"""The phase run's stages and their work: looking -> (locking -> stopping -> waiting ->)
finishing. Each is a small object made with what it needs; `step()` does the stage's work and
returns the transition it took (a code) and the next stage (None: the run is over). NVML
failing in any stage is the machine's transition back to looking, without NVML (core/run.py);
the machine enters each stage the step returns (RunState.enter). Below the stages: the kill
rounds, the wait, and the finishing stage's shm step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from gpugate.core.decide import Choice, Decision, spared_for_good
from gpugate.core.discover import Discovery
from gpugate.core.kill import terminate
from gpugate.core.outcome import BusyGpu, Stage, Transition, exit_code_for
from gpugate.core.run_state import TIMEOUT_MARGIN_S, RunState
from gpugate.core.shm_cleanup import ShmHost, plan, remove, short_of_space
from gpugate.errors import ExitCode
from gpugate.host.containers import stop_containers
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import MIB, Gpu, GpuDriver
from gpugate.host.procfs import ProcessId
from gpugate.host.scan import listening_sockets
from gpugate.host.shm import ShmKey
from gpugate.host.systemd import unit_of_cgroup

Step = tuple[Transition, Optional["StageStep"]]


class StageStep(Protocol):
    @property
    def code(self) -> Stage: ...

    def step(self) -> Step: ...


@dataclass(frozen=True)
class Looking:
    """Discovery and decision; the run's first entry (announce: not again after NVML failed
    once it was made)."""

    state: RunState
    announce: bool
    code: Stage = Stage.LOOKING

    def step(self) -> Step:
        s = self.state
        discovery, decision = s.find()  # the only NVML use in this stage: before announcing
        s.summary.seconds_discover = s.clock() - s.started
        s.summary.owned = list(discovery.owned)
        # Before any kill: later rounds rediscover, and by then memory may already be freed.
        s.used_before = {g.index: discovery.usage[g.index].used_mib for g in discovery.owned}
        busy = tuple(
            BusyGpu(g, s.used_before[g.index], ())
            for g in discovery.owned
            if s.used_before[g.index] > s.config.free_mib
        )
        s.note(last_busy=busy)
        s.surroundings.before_kill(decision)  # one line, before any other
        if self.announce:
            self.announce_run(discovery)
        s.report_faults(discovery)
        s.narrator.blind_spots(discovery)
        s.narrator.choices(decision)
        return self.next_stage(discovery, decision)

    def next_stage(self, discovery: Discovery, decision: Decision) -> Step:
        s = self.state
        if decision.refused:
            s.surroundings.held_by_others(discovery.owned)
            s.narrator.refused()
            from gpugate.core.held import blockers_held  # noqa: PLC0415 (GPUs kept)

            s.summary.held = blockers_held(decision.blockers)
            s.facts.held_by_others = True
            return Transition.REFUSED, Finishing(s, clean_shm=False)
        if s.dry_run:
            refused = s.surroundings.refuses_start(discovery.owned, dry_run=True)
            s.facts.held_by_others = bool(decision.blockers) or refused
            would_kill = frozenset(c.holder.pid for c in decision.targets)
            s.summary.would_kill = len(decision.targets)
            return Transition.DRY_RUN, Finishing(s, clean_shm=True, would_kill=would_kill)
        return Transition.FOUND, Locking(s, discovery, decision)

    def announce_run(self, discovery: Discovery) -> None:
        s = self.state
        s.narrator.run_started(
            discovery,
            s.loaded.source,
            sum(s.used_before.values()),
            gpu_source=s.surroundings.gpu_source,
            gpu_source_warns=s.surroundings.gpu_source_warns,
        )


@dataclass(frozen=True)
class Locking:
    """The per-GPU locks, held until the run is over; under them the surroundings may
    refuse the start, else reserve what it will hold."""

    state: RunState
    discovery: Discovery
    decision: Decision
    code: Stage = Stage.LOCKING

    def step(self) -> Step:
        s, owned = self.state, self.discovery.owned
        # The unit's start/stop timeout may be shorter than our deadline: ask for all of it.
        s.narrator.extend_timeout(s.deadline - s.clock() + TIMEOUT_MARGIN_S)
        # After a stop (state not required), a lock that cannot be made is said, not fatal.
        unlocked = None if s.scope.phase.traits.state_required else s.narrator.lock_not_taken
        s.locks.enter_context(
            gpu_locks(
                s.config.lock_dir,
                owned,
                s.deadline,
                on_wait=s.on_lock_wait,
                clock=s.clock,
                on_unlocked=unlocked,
            )
        )
        # Checked and taken in one turn on the locks: an overlapping pre waits for it.
        if s.surroundings.refuses_start(owned, dry_run=False):
            s.facts.held_by_others = True
            return Transition.START_REFUSED, Finishing(s, clean_shm=False)
        s.surroundings.reserve(owned)
        return Transition.LOCKED, Stopping(s, self.discovery, self.decision)


@dataclass(frozen=True)
class Stopping:
    state: RunState
    discovery: Discovery
    decision: Decision
    code: Stage = Stage.STOPPING

    def step(self) -> Step:
        s = self.state
        discovery, decision, survivors = kill_rounds(s, self.discovery, self.decision)
        if survivors:
            s.facts.survivors = True
            s.narrator.survived(len(survivors))
            from gpugate.core.held import blockers_held, survivors_held  # noqa: PLC0415 (GPUs kept)

            s.summary.held = survivors_held(s.signalled[ident] for ident in survivors)
            s.summary.held += blockers_held(decision.blockers)
            return Transition.SURVIVED, Finishing(s, clean_shm=True)
        if decision.blockers:
            from gpugate.core.held import blockers_held  # noqa: PLC0415 (GPUs kept)

            s.summary.held = blockers_held(decision.blockers)
            s.facts.held_by_others = True
            s.narrator.still_held()
            return Transition.STILL_HELD, Finishing(s, clean_shm=True)
        return Transition.STOPPED, Waiting(s, discovery, decision)


@dataclass(frozen=True)
class Waiting:
    state: RunState
    discovery: Discovery
    decision: Decision
    code: Stage = Stage.WAITING

    def step(self) -> Step:
        wait(self.state, self.discovery, self.decision)
        return Transition.SETTLED, Finishing(self.state, clean_shm=True)


@dataclass(frozen=True)
class Finishing:
    """The shm step, the exit code, the surroundings' records (still under the locks) and
    the run's last entry."""

    state: RunState
    clean_shm: bool
    would_kill: frozenset[int] | None = None  # a dry run: the PIDs it would have killed
    code: Stage = Stage.FINISHING

    def step(self) -> Step:
        s = self.state
        if self.clean_shm:
            clean_shm(s, None if self.would_kill is None else set(self.would_kill))
        s.summary.exit_code = exit_code_for(s.facts)
        if s.dry_run:
            s.narrator.finished(s.summary)
            return Transition.FINISHED, None
        # A lease first: one that cannot be written is the run's error (exit 73), never a
        # "success" and then an error. post's failed-pre reason comes last (systemctl status).
        lease_first = s.scope.phase.traits.takes_lease
        if not lease_first:
            s.narrator.finished(s.summary)
        s.surroundings.after_run(s.summary)
        if lease_first:
            s.narrator.finished(s.summary)
        return Transition.FINISHED, None


# The stopping stage's work, the kill rounds (the wait's too, for a respawn): the targets
# signalled (pidfd-pinned), rediscovered and signalled again while new ones appear (forks),
# bounded in rounds and by the deadline.


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


# The waiting stage's work: wait for free GPUs and ports; what turns up meanwhile (a respawn)
# is killed too, a transition back to stopping and again to waiting; then the wait's outcome
# as facts.


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
        from gpugate.core.held import survivors_held  # noqa: PLC0415 (GPUs kept)

        state.summary.held = survivors_held(state.signalled[ident] for ident in survivors)
        state.facts.survivors = True
        state.narrator.survived(len(survivors))
    # Back to the wait, on the same deadline: a survivor's GPUs are still waited for.
    state.enter(Stage.WAITING, Transition.SURVIVED if survivors else Transition.STOPPED)
    return True


# The finishing stage's shm step: the shared memory of the killed (a dry run: of those it
# would kill) once they are gone; then, before a start, the free space the next start needs.


def clean_shm(state: RunState, would_kill: set[int] | None = None) -> None:
    deps = state.deps
    host = deps.shm_host(state.shm.areas, deps.roots.proc)
    freed = 0
    if state.policy.remove_shm:
        label = functools.partial(shm_label, state)
        if would_kill is not None:
            removals = plan(state.shm.ledger, would_kill, host, label)
            freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
        else:
            killed = {ident.pid for ident in state.signalled}
            removals = remove(state.shm.ledger, killed, host, label)
        state.narrator.shm_files(removals)
    check_shm_space(state, host, freed)


def check_shm_space(state: RunState, host: ShmHost, freed: int) -> None:
    needed_mib = state.config.shm_min_free_mib
    if (
        needed_mib is None
        or not state.scope.phase.traits.before_start
        or exit_code_for(state.facts) is not ExitCode.OK
    ):
        return
    short = short_of_space(host, needed_mib * MIB, freed)
    if short is None:
        return
    holders: dict[ShmKey, list[int]] = {}
    if short.largest:
        for key, pids in host.holders().by_key.items():
            holders[key] = sorted(pids)
    state.narrator.shm_short(short, holders, functools.partial(shm_label, state))
    state.facts.shm_short = True


def shm_label(state: RunState, pid: int) -> str:
    if pid in state.shm.labels:
        return state.shm.labels[pid]
    info = state.procfs.info(pid)
    if info is None:
        return f"PID {pid}"
    unit = unit_of_cgroup(info.cgroup or "/")
    return f"PID {pid} ({info.comm}, {unit})" if unit else f"PID {pid} ({info.comm})"


# The wait's loop: poll NVML until every owned GPU is at or below the free level and
# lists no process, the unit's ports are free, and no respawn is under way. Polls start at 5 ms
# and back off to 50 ms, so the exit follows the driver's release closely without spinning;
# progress is reported about once a second. What turns up during the wait (a respawned holder:
# NVML lists a PID not seen, a port is listened on again, a watched parent starts the killed
# child's executable again) is looked for with a new discovery, at most every LOOK_AGAIN_EVERY_S,
# and killed by the caller as in the kill rounds. The look runs when NVML lists a PID not known, a
# port is held, or a respawn is under way. While parents of killed holders are watched (a respawn
# may come from them), success needs two looks in a row, LOOK_AGAIN_EVERY_S apart, that find
# nothing: a respawned holder that NVML does not list yet is caught, and a loop that respawns
# between two polls cannot end the run as a success.


FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
PROGRESS_EVERY_S = 1.0
LOOK_AGAIN_EVERY_S = 0.2  # a rediscovery costs a pass over /proc: not at every poll


def busy_gpus(
    driver: GpuDriver, gpus: Sequence[Gpu], free_mib: int, ignored_pids: Collection[int]
) -> list[BusyGpu]:
    busy: list[BusyGpu] = []
    for gpu in gpus:
        usage = driver.usage(gpu)
        pids = tuple(p.pid for p in usage.processes if p.pid not in ignored_pids)
        if usage.used_mib > free_mib or pids:
            busy.append(BusyGpu(gpu, usage.used_mib, pids))
    return busy


@dataclass
class Settled:
    busy: list[BusyGpu]  # GPUs still used at the deadline
    ports: list[int]  # the unit's ports still listened on at the deadline
    pending: list[int]  # respawned children at the deadline
    stable: bool = True  # False: parents are watched and no two looks in a row found it clear

    @property
    def held(self) -> bool:
        return bool(self.busy or self.ports or self.pending or not self.stable)


class WaitProbes(Protocol):
    """What the wait looks at, each time it looks."""

    def busy_gpus(self) -> list[BusyGpu]:
        """The GPUs still above free_mib."""

    def busy_ports(self) -> list[int]:
        """The unit's ports something still listens on."""

    def pending(self) -> list[int]:
        """Respawns under way below a watched parent."""

    def look_again(self) -> bool:
        """Rediscover and kill what is found (True: something was)."""

    def known_pids(self) -> Collection[int]:
        """The PIDs the run signalled or spared: NVML may still list them."""

    def watching(self) -> bool:
        """Whether parents of the killed are watched (for respawns)."""


def wait_settled(
    probes: WaitProbes,
    *,
    deadline: float,
    on_progress: Callable[[list[BusyGpu], float], None] = lambda busy, left: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Settled:
    """Poll until the GPUs and ports are free and no respawn is under way, or the deadline.
    look_again rediscovers and kills what it finds (True when it found something); when it
    runs, and why two clear looks are needed while parents are watched: the module's doc."""
    interval = FIRST_POLL_S
    next_progress = clock()
    next_look = clock()
    clear_since: float | None = None
    while True:
        busy = probes.busy_gpus()
        ports = probes.busy_ports()
        watched = probes.watching()
        under_way = probes.pending() if watched else []
        now = clock()
        known = probes.known_pids()
        unexplained = any(pid not in known for item in busy for pid in item.pids)
        clear = not busy and not ports and not under_way
        if not clear:
            clear_since = None
        if clear and not watched:
            return Settled(busy, ports, under_way)
        if (unexplained or ports or under_way or clear) and now >= next_look:
            next_look = now + LOOK_AGAIN_EVERY_S
            if probes.look_again():
                clear_since = None
                continue
            if clear:
                if clear_since is not None:
                    return Settled(busy, ports, under_way)
                clear_since = now
        if now >= deadline:
            return Settled(busy, ports, under_way, stable=not watched and clear)
        if now >= next_progress:
            on_progress(busy, deadline - now)
            next_progress = now + PROGRESS_EVERY_S
        sleep(min(interval, max(deadline - now, 0)))
        interval = min(interval * 1.5, MAX_POLL_S)
