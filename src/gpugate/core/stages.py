"""The phase run's stages: looking -> (locking -> stopping -> waiting ->) finishing. Each is
a small object made with what it needs; `step()` does the stage's work and returns the
transition it took (a code) and the next stage (None: the run is over). NVML failing in any
stage is the machine's transition back to looking, without NVML (core/run.py); the machine
enters each stage the step returns (RunState.enter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from gpugate.core.decide import Decision
from gpugate.core.discover import Discovery
from gpugate.core.outcome import BusyGpu, exit_code_for
from gpugate.core.run_state import TIMEOUT_MARGIN_S, RunState
from gpugate.core.shm_step import clean_shm
from gpugate.core.stage import Stage, Transition
from gpugate.core.stopping import kill_rounds
from gpugate.core.waiting import wait
from gpugate.host.locks import gpu_locks

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
        s.locks.enter_context(
            gpu_locks(s.config.lock_dir, owned, s.deadline, on_wait=s.on_lock_wait, clock=s.clock)
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
            return Transition.SURVIVED, Finishing(s, clean_shm=True)
        if decision.blockers:
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
