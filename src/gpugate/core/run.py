"""One phase run as a stage machine: looking -> locking -> stopping -> waiting -> finishing, each
stage's `step()` returning its transition and the next stage; `RunState.enter` changes the stage."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

from gpugate.config.file import LoadedConfig
from gpugate.core.decide import Choice, Decision, decide, spared_for_good
from gpugate.core.discover import Discovery, Sought, discover
from gpugate.core.kill import Pinned, RespawnWatch, pin, terminate
from gpugate.core.outcome import (
    UNKILLABLE,
    BusyGpu,
    Held,
    Narration,
    Progress,
    RunSummary,
    Stage,
    Surroundings,
    Transition,
)
from gpugate.core.roles import Role, mps_served
from gpugate.core.shm_cleanup import ShmHost, ShmLedger, plan, remove, short_of_space
from gpugate.errors import (
    ExitCode,
    GateError,
    Interrupted,
    ManualRunRefused,
    NvmlUnavailable,
    outcome_code,
)
from gpugate.host.containers import stop_containers
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import MIB, Gpu, GpuDriver, NoGpus, NvmlDriver
from gpugate.host.scan import Deadline, HostShm, ProcessId, ProcFs, listening_sockets
from gpugate.host.shm import ShmArea, ShmKey
from gpugate.host.systemd import HostRoots, unit_of_cgroup
from gpugate.phase import Phase

TIMEOUT_MARGIN_S = 10  # asked of systemd beyond our own deadline, for the exit itself
MAX_ROUNDS = 5


@dataclass(frozen=True)
class RunScope:
    phase: Phase
    unit: str  # the unit, or the label standing for it (a Slurm job's)
    unit_cgroup: str  # every process in it dies (a Slurm job's cgroup for Slurm)
    # `gpugate run` by an account that is not root: only that account's processes die
    for_uid: int | None = None


@dataclass(frozen=True)
class RunDeps:
    """What the run reaches the host through: production's defaults, each a test's stand-in."""

    roots: HostRoots = field(default_factory=HostRoots)
    driver_factory: Callable[[], GpuDriver] = NvmlDriver  # opened by the run, closed after
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin
    clock: Callable[[], float] = time.monotonic
    shm_host: Callable[[list[ShmArea], Path], ShmHost] = HostShm  # (areas, proc root)


class RunState:
    """What the stages share; one discovery round (`find`); the stage (`enter`)."""

    def __init__(
        self,
        scope: RunScope,
        narrator: Narration,
        surroundings: Surroundings,
        deps: RunDeps,
        *,
        dry_run: bool,
    ) -> None:
        self.scope, self.narrator, self.surroundings = scope, narrator, surroundings
        self.deps, self.dry_run = deps, dry_run
        self.loaded: LoadedConfig = surroundings.loaded  # the unit's GPUs resolved
        self.config = self.loaded.config
        self.policy = self.config.policy(scope.phase)
        self.procfs = ProcFs(deps.roots.proc)  # cached only inside a round's oneshot()
        self.clock = deps.clock
        self.started = self.clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = RunSummary()
        self.found: set[ExitCode] = set()  # the outcomes met, of errors.RUN_OUTCOMES
        self.driver: GpuDriver = NoGpus()
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        self.signalled: dict[ProcessId, Choice] = {}
        self.ports = self.config.ports if scope.phase.traits.checks_ports else ()
        self.watch = RespawnWatch()
        # protected, sharers, or on no GPU of the unit: neither they nor their memory waited on
        self.spared_pids: set[int] = set()
        self.reported_faults: set[int] = set()
        # first roles, for roles.holder_role
        self.judged: dict[ProcessId, Role] = dict.fromkeys(
            surroundings.known_watchers(), Role.WATCHER
        )
        self.shm_ledger = ShmLedger()  # who held which /dev/shm file, from every discovery
        self.shm_areas: list[ShmArea] = []
        self.shm_labels: dict[int, str] = {}  # names for the PIDs
        self._progress = Progress()
        self._transitions: list[tuple[Stage, Transition]] = []
        self.locks = contextlib.ExitStack()  # the GPU locks, from locking to the run's end

    @property
    def progress(self) -> Progress:
        return self._progress

    @property
    def transitions(self) -> list[tuple[Stage, Transition]]:
        return list(self._transitions)

    def enter(self, stage: Stage | None, via: Transition | None = None) -> None:
        """The one way the stage changes; via: the edge left (None: the first); None: the end."""
        if via is not None:
            self._transitions.append((self._progress.stage, via))
        if stage is not None:
            self._progress = Progress(stage, last_busy=self._progress.last_busy)

    def note(self, **facts: Any) -> None:
        """The current stage's facts (Progress's fields); a stage among them is a TypeError."""
        self._progress = replace(self._progress, stage=self._progress.stage, **facts)

    def on_lock_wait(self, gpu: Gpu) -> None:
        self.note(lock_gpu=gpu)
        self.narrator.lock_wait(gpu, self.deadline - self.clock())

    def without_nvml(self, error: NvmlUnavailable | None = None) -> None:
        """The unit's cgroup alone, no GPU. error: NVML failed here (on_nvml_error = fail, or
        a second time: the run's error)."""
        if error is not None:
            if self.policy.on_nvml_error == "fail" or self.summary.degraded:
                raise error
            self.narrator.degraded(error, self.scope.phase.value)
        self.summary.degraded = True
        self.driver = NoGpus()

    def find(self) -> tuple[Discovery, Decision]:
        """One round: discovery and decision over one consistent reading of /proc."""
        wanted = None if self.summary.degraded else self.config.selection()  # degraded: no GPU
        with self.procfs.oneshot():
            found = discover(
                Sought(self.scope.unit, self.scope.unit_cgroup, wanted, self.loaded.source),
                driver=self.driver,
                procfs=self.procfs,
                roots=self.deps.roots,
                ports=self.ports,
                containers=self.config.containers,
                deadline=Deadline(self.deadline, self.clock),
            )
            decision = decide(
                found,
                self.config,
                self.scope.phase,
                self.procfs,
                self.judged,
                for_uid=self.scope.for_uid,
                shared=self.surroundings.shared_gpus(found) | mps_served(found, self.config),
            )
        self.shm_ledger.note(found.shm)
        self.shm_areas = found.shm_areas
        for choice in decision.choices:
            self.judged.setdefault(choice.holder.info.ident, choice.role)
            self.shm_labels[choice.holder.pid] = (
                f"PID {choice.holder.pid} ({choice.holder.info.comm}, {choice.role})"
            )
        return found, decision

    def report_faults(self, discovery: Discovery) -> None:
        """Faults on GPUs the unit does not own (its own fail the run in discover): once."""
        for fault in discovery.faults:
            if fault.index not in self.reported_faults:
                self.reported_faults.add(fault.index)
                self.narrator.fault_elsewhere(fault, self.scope.unit)

    def fresh(self, decision: Decision) -> list[Choice]:
        return [c for c in decision.targets if c.holder.info.ident not in self.signalled]

    def shm_label(self, pid: int) -> str:
        if pid in self.shm_labels:
            return self.shm_labels[pid]
        info = self.procfs.info(pid)
        if info is None:
            return f"PID {pid}"
        unit = unit_of_cgroup(info.cgroup or "/")
        return f"PID {pid} ({info.comm}, {unit})" if unit else f"PID {pid} ({info.comm})"


class PhaseRun(RunState):
    """The machine over its state (as supervisor's Subprocess is)."""

    def run(self) -> RunSummary:
        """An error but a manual run's refusal is told to the surroundings, locks released; an
        interruption as the narrator words it."""
        try:
            self._run()
        except Interrupted as exc:
            worded = self.narrator.interrupted(exc, self.progress)
            if not self.dry_run:
                self.surroundings.after_error(worded, self.progress)
            raise worded from None
        except GateError as exc:
            if not self.dry_run and not isinstance(exc, ManualRunRefused):
                self.surroundings.after_error(exc, self.progress)
            raise
        return self.summary

    def _run(self) -> None:
        driver: GpuDriver = NoGpus()
        hung = self.surroundings.driver_hung_earlier()
        if hung is not None:
            # This start's pre waited its deadline on a driver that did not answer: asking
            # again would hang post too. The cgroup still dies.
            self.narrator.nvml_skipped(hung, self.scope.phase.value)
            self.without_nvml()
        else:
            try:
                driver = self.deps.driver_factory()
            except NvmlUnavailable as exc:
                self.without_nvml(exc)
        try:
            driver.answer_by(self.deadline)  # one that stops answering ends the run
            self.driver = driver
            with self.locks:
                self._go(Looking(announce=True))
        finally:
            driver.close()

    def _go(self, first: StageStep) -> None:
        self.enter(first.code)
        stage: StageStep | None = first
        while stage is not None:
            current = stage
            try:
                transition, stage = current.step(self)
            except NvmlUnavailable as exc:
                self.locks.close()  # released before the run goes on without NVML
                self.without_nvml(exc)
                announce = isinstance(current, Looking) and current.announce
                transition, stage = Transition.NVML_FAILED, Looking(announce=announce)
            self.enter(None if stage is None else stage.code, transition)


StageStep = Union["Looking", "Locking", "Stopping", "Waiting", "Finishing"]
Step = tuple[Transition, Optional[StageStep]]


@dataclass(frozen=True)
class Looking:
    """Discovery and decision (announce: not again after NVML failed once it was made)."""

    announce: bool
    code: Stage = Stage.LOOKING

    def step(self, s: RunState) -> Step:
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
            s.narrator.run_started(
                discovery,
                s.loaded.source,
                sum(s.used_before.values()),
                gpu_source=s.surroundings.gpu_source,
                gpu_source_warns=s.surroundings.gpu_source_warns,
            )
        s.report_faults(discovery)
        s.narrator.blind_spots(discovery)
        s.narrator.choices(decision)
        if decision.refused:
            s.surroundings.held_by_others(discovery.owned)
            s.narrator.refused()
            s.summary.held = [Held.of(c) for c in decision.blockers]
            s.found.add(ExitCode.HELD_BY_OTHERS)
            return Transition.REFUSED, Finishing(clean_shm=False)
        if s.dry_run:
            refused = s.surroundings.refuses_start(discovery.owned, dry_run=True)
            if decision.blockers or refused:
                s.found.add(ExitCode.HELD_BY_OTHERS)
            would_kill = frozenset(c.holder.pid for c in decision.targets)
            s.summary.would_kill = len(decision.targets)
            return Transition.DRY_RUN, Finishing(clean_shm=True, would_kill=would_kill)
        return Transition.FOUND, Locking(discovery, decision)


@dataclass(frozen=True)
class Locking:
    """The per-GPU locks, held to the run's end; under them a start is refused or reserved."""

    discovery: Discovery
    decision: Decision
    code: Stage = Stage.LOCKING

    def step(self, s: RunState) -> Step:
        owned = self.discovery.owned
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
            s.found.add(ExitCode.HELD_BY_OTHERS)
            return Transition.START_REFUSED, Finishing(clean_shm=False)
        s.surroundings.reserve(owned)
        return Transition.LOCKED, Stopping(self.discovery, self.decision)


@dataclass(frozen=True)
class Stopping:
    discovery: Discovery
    decision: Decision
    code: Stage = Stage.STOPPING

    def step(self, s: RunState) -> Step:
        discovery, decision, survivors = kill_rounds(s, self.discovery, self.decision)
        if survivors:
            s.summary.held += [Held.of(c) for c in decision.blockers]
            return Transition.SURVIVED, Finishing(clean_shm=True)
        if decision.blockers:
            s.summary.held = [Held.of(c) for c in decision.blockers]
            s.found.add(ExitCode.HELD_BY_OTHERS)
            s.narrator.still_held()
            return Transition.STILL_HELD, Finishing(clean_shm=True)
        return Transition.STOPPED, Waiting(discovery, decision)


@dataclass(frozen=True)
class Waiting:
    discovery: Discovery
    decision: Decision
    code: Stage = Stage.WAITING

    def step(self, s: RunState) -> Step:
        """For free GPUs and ports, killing what turns up meanwhile; then its outcome."""
        skipped = s.surroundings.not_to_wait_on(self.discovery.owned)
        owned = [gpu for gpu in self.discovery.owned if gpu not in skipped]
        if owned or s.ports:
            wait_started = s.clock()
            s.spared_pids = spared_for_good(self.decision)
            busy, ports, held = wait_settled(s, owned)
            s.summary.seconds_wait = s.clock() - wait_started
            s.summary.busy = busy
            for gpu in owned:
                freed = s.used_before.get(gpu.index, 0) - s.driver.usage(gpu).used_mib
                s.summary.freed_mib_by_gpu[gpu.index] = max(freed, 0)
            judge_wait(s, owned, busy, ports, held=held)
        return Transition.SETTLED, Finishing(clean_shm=True)


@dataclass(frozen=True)
class Finishing:
    """The shm step, the exit code, the surroundings' records (locks held), the last entry."""

    clean_shm: bool
    would_kill: frozenset[int] | None = None  # a dry run: the PIDs it would have killed
    code: Stage = Stage.FINISHING

    def step(self, s: RunState) -> Step:
        if self.clean_shm:
            clean_shm(s, self.would_kill)
        s.summary.exit_code = outcome_code(s.found)
        # A lease first: one that cannot be written is the run's error (exit 73), never a
        # "success" and then an error. post's failed-pre reason comes last (systemctl status).
        lease_first = s.scope.phase.traits.takes_lease and not s.dry_run
        if not lease_first:
            s.narrator.finished(s.summary)
        if not s.dry_run:
            s.surroundings.after_run(s.summary)
        if lease_first:
            s.narrator.finished(s.summary)
        return Transition.FINISHED, None


def kill_rounds(
    state: RunState, discovery: Discovery, decision: Decision
) -> tuple[Discovery, Decision, list[ProcessId]]:
    """Kill the targets; rediscover and repeat while new ones appear (forks); the survivors."""
    kill_started = state.clock()
    if state.scope.phase.traits.stops_containers and discovery.unit_containers:
        # The unit's own containers stop through their runtime first (it records them as
        # stopped); the pinned signals follow for any process that outlived it.
        wanted = {c.holder.container.id for c in decision.targets if c.holder.container}
        containers = [c for c in discovery.unit_containers if c.id in wanted]
        state.narrator.container_stopping(len(containers))
        for stopped in stop_containers(containers, state.policy.sigterm_grace_s):
            state.narrator.container_stopped(stopped)
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
    if survivors:
        state.summary.held = [Held.of(state.signalled[ident], UNKILLABLE) for ident in survivors]
        state.found.add(ExitCode.UNKILLABLE)
        state.narrator.survived(len(survivors))
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


def on_stuck(state: RunState, choices: list[Choice]) -> None:
    for choice in choices:
        stat = state.procfs.stat(choice.holder.pid)
        process_state = stat.state if stat else "?"
        state.narrator.stuck(choice, process_state, state.procfs.wchan(choice.holder.pid))


def judge_wait(
    state: RunState, owned: list[Gpu], busy: list[BusyGpu], ports: list[int], *, held: bool
) -> None:
    """The wait's outcome: respawning, ports or memory still held, or all free."""
    narrator, found, free_mib = state.narrator, state.found, state.config.free_mib
    timeout_s = state.policy.wait_timeout_s
    respawners = state.watch.respawners(state.procfs.still_same)
    if held and respawners:
        narrator.respawning(respawners, timeout_s)
        found.add(ExitCode.RESPAWNING)
        return
    for respawner in respawners:
        narrator.respawned(respawner)
    failing = state.policy.on_timeout == "fail"
    for item in busy:
        narrator.memory_timeout(item, free_mib, timeout_s, failing=failing)
    if ports:
        narrator.ports_held(ports, timeout_s)
        found.add(ExitCode.HELD_BY_OTHERS)
    if not busy:
        if owned and not ports:
            narrator.memory_freed(owned, free_mib, state.summary.seconds_wait)
    elif failing:
        found.add(ExitCode.MEMORY_TIMEOUT)


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
    # Back to the wait, on the same deadline: a survivor's GPUs are still waited for.
    state.enter(Stage.WAITING, Transition.SURVIVED if survivors else Transition.STOPPED)
    return True


def clean_shm(state: RunState, would_kill: frozenset[int] | None = None) -> None:
    """The killed's /dev/shm files (a dry run: those it would kill), once they are gone; then,
    before a start, the free space the next start needs."""
    host = state.deps.shm_host(state.shm_areas, state.deps.roots.proc)
    label = state.shm_label
    freed = 0
    if state.policy.remove_shm:
        if would_kill is not None:
            removals = plan(state.shm_ledger, would_kill, host, label)
            freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
        else:
            killed = {ident.pid for ident in state.signalled}
            removals = remove(state.shm_ledger, killed, host, label)
        state.narrator.shm_files(removals)
    needed_mib = state.config.shm_min_free_mib
    if (
        needed_mib is None
        or not state.scope.phase.traits.before_start
        or outcome_code(state.found) is not ExitCode.OK
    ):
        return
    short = short_of_space(host, needed_mib * MIB, freed)
    if short is not None:
        holders: dict[ShmKey, list[int]] = {}
        if short.largest:
            holders = {key: sorted(pids) for key, pids in host.holders().by_key.items()}
        state.narrator.shm_short(short, holders, label)
        state.found.add(ExitCode.SHM_SPACE)


# What turns up in the wait (an unknown PID on NVML's list, a held port, a respawn) is looked
# for with a new discovery. While parents of the killed are watched, success needs two clear
# looks in a row: a loop that respawns between two polls cannot end the run as a success.

FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
PROGRESS_EVERY_S = 1.0
LOOK_AGAIN_EVERY_S = 0.2  # a rediscovery costs a pass over /proc: not at every poll


def look(state: RunState, owned: list[Gpu]) -> tuple[list[BusyGpu], list[int], list[int]]:
    """One poll: the busy GPUs (also the progress's), the held ports, respawns under way."""
    busy: list[BusyGpu] = []
    for gpu in owned:
        usage = state.driver.usage(gpu)
        spared = [p for p in usage.processes if p.pid in state.spared_pids]
        pids = tuple(p.pid for p in usage.processes if p.pid not in state.spared_pids)
        # What the spared (sharers, protected) hold is theirs, not the run's to wait for.
        used_mib = usage.used_mib - sum(p.used_mib or 0 for p in spared)
        if used_mib > state.config.free_mib or pids:
            busy.append(BusyGpu(gpu, usage.used_mib, pids))
    if busy:
        state.note(waiting_on=tuple(busy))
    state.note(last_busy=tuple(busy))
    ports = sorted(set(listening_sockets(state.deps.roots.proc, state.ports).values()))
    under_way = state.watch.pending(state.procfs) if state.watch.watched else []
    return busy, ports, under_way


def waited_on(state: RunState, busy: list[BusyGpu], left_s: float) -> None:
    if busy:
        state.narrator.memory_wait(busy, state.config.free_mib, left_s)
    state.narrator.extend_timeout(left_s + TIMEOUT_MARGIN_S)


def wait_settled(state: RunState, owned: list[Gpu]) -> tuple[list[BusyGpu], list[int], bool]:
    """Poll (5 ms backing off to 50 ms) until the GPUs and ports are free and no respawn is
    under way, or the deadline: the GPUs and ports still held, and whether any is."""
    clock, deadline = state.clock, state.deadline
    interval = FIRST_POLL_S
    next_progress = next_look = clock()
    clear_since: float | None = None
    while True:
        busy, ports, under_way = look(state, owned)
        watched = bool(state.watch.watched)
        now = clock()
        known = {i.pid for i in state.signalled} | state.spared_pids
        unexplained = any(pid not in known for item in busy for pid in item.pids)
        clear = not busy and not ports and not under_way
        if not clear:
            clear_since = None
        if clear and not watched:
            return busy, ports, False
        if (unexplained or ports or under_way or clear) and now >= next_look:
            next_look = now + LOOK_AGAIN_EVERY_S
            if look_again(state):
                clear_since = None
                continue
            if clear:
                if clear_since is not None:
                    return busy, ports, False
                clear_since = now
        if now >= deadline:
            return busy, ports, watched or not clear
        if now >= next_progress:
            waited_on(state, busy, deadline - now)
            next_progress = now + PROGRESS_EVERY_S
        time.sleep(min(interval, max(deadline - now, 0)))
        interval = min(interval * 1.5, MAX_POLL_S)
