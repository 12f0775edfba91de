"""One phase run, read top to bottom: discover and decide, lock, the kill rounds, the wait,
the killed's /dev/shm files, the lease. Its stage (looking -> locking -> stopping -> waiting ->
finishing) changes only in `PhaseRun.enter`; each stage's method returns the transition it took,
and `outcome.NEXT_STAGE` says where that leads."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gpugate.core import outcome
from gpugate.core.decide import Choice, Decision, decide, spared_for_good
from gpugate.core.discover import Discovery, DiscoveryQuery, discover
from gpugate.core.kill import Pinned, RespawnWatch, pin, terminate
from gpugate.core.outcome import Blocker, BusyGpu, Stage, Transition
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
from gpugate.host.shm import ShmArea
from gpugate.host.systemd import HostRoots, unit_of_cgroup
from gpugate.phase import Phase

TIMEOUT_MARGIN_S = 10  # asked of systemd beyond our own deadline, for the exit itself
MAX_ROUNDS = 5

# What turns up in the wait (an unknown PID on NVML's list, a held port, a respawn) is looked
# for with a new discovery. While parents of the killed are watched, success needs two clear
# looks in a row: a loop that respawns between two polls cannot end the run as a success.
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
PROGRESS_EVERY_S = 1.0
LOOK_AGAIN_EVERY_S = 0.2  # a rediscovery costs a pass over /proc: not at every poll


class RunScope(NamedTuple):
    """What one run is about, built once by its command and carried whole, and what it reaches
    the host through: production's defaults, each a test's stand-in."""

    phase: Phase
    unit: str  # the unit, or the label standing for it (a Slurm job's)
    # the cgroup whose processes all die (a Slurm job's for Slurm), located as the run starts
    locate_cgroup: Callable[[], str]
    # `gpugate run` by an account that is not root: only that account's processes die
    for_uid: int | None = None
    dry_run: bool = False
    roots: HostRoots = HostRoots()
    driver_factory: Callable[[], GpuDriver] = NvmlDriver  # opened by the run, closed after
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin
    clock: Callable[[], float] = time.monotonic
    shm_host: Callable[[Sequence[ShmArea], Path], ShmHost] = HostShm  # (areas, proc root)


class PhaseRun:
    """One run of a phase over its state (as supervisor's Subprocess is): `run()` once."""

    def __init__(
        self,
        scope: RunScope,
        unit_cgroup: str,  # scope's, located
        tell: Callable[[outcome.RunEvent], None],
        surroundings: outcome.Workload,
    ) -> None:
        self.scope, self.tell, self.surroundings = scope, tell, surroundings
        self.config = surroundings.loaded.config  # the unit's GPUs resolved
        self.policy = self.config.policy(scope.phase)
        self.procfs = ProcFs(scope.roots.proc)  # cached only inside a round's oneshot()
        self.clock = scope.clock
        self.started = self.clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = outcome.RunSummary()
        source = surroundings.loaded.source
        self.sought = DiscoveryQuery(scope.unit, unit_cgroup, self.config.selection(), source)
        self.found: set[ExitCode] = set()  # the outcomes met, of errors.RUN_OUTCOMES
        self.driver: GpuDriver = NoGpus()
        self.announced = False  # the run's first entry is said once, even if NVML fails after
        self.discovery: Discovery | None = None  # the last round's, and its decision
        self.decision = Decision([])
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        self.signalled: dict[ProcessId, Choice] = {}
        self.ports = self.config.ports if scope.phase.traits.checks_ports else ()
        self.watch = RespawnWatch()
        # protected, sharers, or on no GPU of the unit: neither they nor their memory waited on
        self.spared_pids: set[int] = set()
        self.reported_faults: set[int] = set()
        self.judged = dict.fromkeys(surroundings.known_watchers(), Role.WATCHER)  # first roles
        self.shm_ledger = ShmLedger()  # who held which /dev/shm file, from every discovery
        self.shm_labels: dict[int, str] = {}  # names for the PIDs
        self.progress = outcome.Progress()  # where the run is: the stage, its facts
        self.transitions: list[tuple[Stage, Transition]] = []  # the edges taken
        self.locks = contextlib.ExitStack()  # the GPU locks, from locking to the run's end

    def enter(self, stage: Stage | None, via: Transition | None = None) -> None:
        """The one way the stage changes; via: the edge left (None: the first); None: the end."""
        if via is not None:
            self.transitions.append((self.progress.stage, via))
        if stage is not None:
            self.progress = outcome.Progress(stage, last_busy=self.progress.last_busy)

    def note(self, **facts: Any) -> None:
        """The current stage's facts (Progress's fields); a stage among them is a TypeError."""
        self.progress = self.progress._replace(stage=self.progress.stage, **facts)

    def run(self) -> outcome.RunSummary:
        """An error but a manual run's refusal is told to the surroundings, locks released; an
        interruption says what the run was doing."""
        try:
            self._with_driver()
        except Interrupted as exc:
            worded = outcome.interrupted(exc.signal_name, self.progress)
            if not self.scope.dry_run:
                self.surroundings.after_error(worded, self.progress)
            raise worded from None
        except GateError as exc:
            if not self.scope.dry_run and not isinstance(exc, ManualRunRefused):
                self.surroundings.after_error(exc, self.progress)
            raise
        return self.summary

    def _with_driver(self) -> None:
        driver: GpuDriver = NoGpus()
        hung = self.surroundings.driver_hung_earlier()
        if hung is not None:
            # This start's pre waited its deadline on a driver that did not answer: asking
            # again would hang post too. The cgroup still dies.
            self.tell(outcome.NvmlSkipped(hung, self.scope.phase.value))
            self.without_nvml()
        else:
            try:
                driver = self.scope.driver_factory()
            except NvmlUnavailable as exc:
                self.without_nvml(exc)
        try:
            driver.answer_by(self.deadline)  # one that stops answering ends the run
            self.driver = driver
            with self.locks:
                self._stages()
        finally:
            driver.close()

    def _stages(self) -> None:
        steps = {
            Stage.LOOKING: self.looking,
            Stage.LOCKING: self.locking,
            Stage.STOPPING: self.stopping,
            Stage.WAITING: self.waiting,
            Stage.FINISHING: self.finishing,
        }
        stage: Stage | None = Stage.LOOKING
        self.enter(stage)
        while stage is not None:
            try:
                via = steps[stage]()
            except NvmlUnavailable as exc:
                self.locks.close()  # released before the run goes on without NVML
                self.without_nvml(exc)
                via = Transition.NVML_FAILED
            stage = outcome.NEXT_STAGE[via]
            self.enter(stage, via)

    def without_nvml(self, error: NvmlUnavailable | None = None) -> None:
        """The unit's cgroup alone, no GPU. error: NVML failed here (on_nvml_error = fail, or
        a second time: the run's error)."""
        if error is not None:
            if self.policy.on_nvml_error == "fail" or self.summary.degraded:
                raise error
            self.tell(outcome.Degraded(error, self.scope.phase.value))
        self.summary.degraded = True
        self.sought = self.sought._replace(wanted=None)  # no GPU
        self.driver = NoGpus()

    def looking(self) -> Transition:
        """Discover the holders, decide whom to kill."""
        discovery, decision = self.find_holders()  # the stage's only NVML use: before announcing
        self.summary.seconds_discover = self.clock() - self.started
        self.summary.owned = list(discovery.owned)
        # Before any kill: later rounds rediscover, and by then memory may already be freed.
        self.used_before = {g.index: discovery.usage[g.index].used_mib for g in discovery.owned}
        busy = tuple(
            BusyGpu(g, self.used_before[g.index], ())
            for g in discovery.owned
            if self.used_before[g.index] > self.config.free_mib
        )
        self.note(last_busy=busy)
        self.surroundings.before_kill(decision)  # one line, before any other
        if not self.announced:
            self.announced = True
            used = sum(self.used_before.values())
            self.tell(outcome.RunStarted(discovery, used, self.surroundings))
        self.report_faults(discovery)
        self.tell(outcome.BlindSpots(discovery))
        self.tell(outcome.Decided(decision))
        if decision.refused:
            self.surroundings.held_by_others(discovery.owned)
            self.summary.held = [Blocker.of(c) for c in decision.blockers]
            self.found.add(ExitCode.HELD_BY_OTHERS)
            return Transition.REFUSED
        if self.scope.dry_run:
            refused = self.surroundings.refuses_start(discovery.owned, dry_run=True)
            if decision.blockers or refused:
                self.found.add(ExitCode.HELD_BY_OTHERS)
            self.summary.would_kill = len(decision.targets)
            return Transition.DRY_RUN
        return Transition.FOUND

    def find_holders(self) -> tuple[Discovery, Decision]:
        """One round of discovery and decision on one reading of /proc: the run's latest."""
        with self.procfs.oneshot():
            found = discover(
                self.sought,
                driver=self.driver,
                procfs=self.procfs,
                roots=self.scope.roots,
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
        for choice in decision.choices:
            self.judged.setdefault(choice.holder.info.ident, choice.role)
            self.shm_labels[choice.holder.pid] = (
                f"PID {choice.holder.pid} ({choice.holder.info.comm}, {choice.role})"
            )
        self.discovery, self.decision = found, decision
        return found, decision

    def report_faults(self, discovery: Discovery) -> None:
        """Faults on GPUs the unit does not own (its own fail the run in discover): once."""
        for fault in discovery.faults:
            if fault.index not in self.reported_faults:
                self.reported_faults.add(fault.index)
                self.tell(outcome.FaultElsewhere(fault))

    def unsignalled(self, decision: Decision) -> list[Choice]:
        return [c for c in decision.targets if c.holder.info.ident not in self.signalled]

    def locking(self) -> Transition:
        """The per-GPU locks, held to the run's end: under them a start is refused or reserved."""
        owned = self.latest.owned
        # The unit's start/stop timeout may be shorter than our deadline: ask for all of it.
        self.tell(outcome.ExtendTimeout(self.deadline - self.clock() + TIMEOUT_MARGIN_S))
        # After a stop (state not required), a lock that cannot be made is said, not fatal.
        unlocked = None if self.scope.phase.traits.state_required else self.lock_not_taken
        self.locks.enter_context(
            gpu_locks(
                self.config.lock_dir,
                owned,
                self.deadline,
                on_wait=self.on_lock_wait,
                clock=self.clock,
                on_unlocked=unlocked,
            )
        )
        # Checked and taken in one turn on the locks: an overlapping pre waits for it.
        if self.surroundings.refuses_start(owned, dry_run=False):
            self.found.add(ExitCode.HELD_BY_OTHERS)
            return Transition.START_REFUSED
        self.surroundings.reserve(owned)
        return Transition.LOCKED

    @property
    def latest(self) -> Discovery:
        """The last round's discovery (looking made one before any other stage runs)."""
        assert self.discovery is not None
        return self.discovery

    def on_lock_wait(self, gpu: Gpu) -> None:
        self.note(lock_gpu=gpu)
        self.tell(outcome.LockWait(gpu, self.deadline - self.clock()))

    def lock_not_taken(self, path: object, cause: str) -> None:
        self.tell(outcome.LockNotTaken(path, cause))

    def stopping(self) -> Transition:
        """The kill rounds."""
        survivors = self.kill_rounds()
        blockers = self.decision.blockers
        if survivors:
            self.summary.held += [Blocker.of(c) for c in blockers]
            return Transition.SURVIVED
        if blockers:
            self.summary.held = [Blocker.of(c) for c in blockers]
            self.found.add(ExitCode.HELD_BY_OTHERS)
            self.tell(outcome.StillHeld())
            return Transition.STILL_HELD
        return Transition.STOPPED

    def kill_rounds(self) -> list[ProcessId]:
        """Kill the latest decision's targets, again while rediscovery finds more: the survivors."""
        kill_started = self.clock()
        discovery = self.latest
        if self.scope.phase.traits.stops_containers and discovery.unit_containers:
            # The unit's own containers stop through their runtime first (it records them as
            # stopped); the pinned signals follow for any process that outlived it.
            wanted = {c.holder.container.id for c in self.decision.targets if c.holder.container}
            containers = [c for c in discovery.unit_containers if c.id in wanted]
            self.tell(outcome.ContainerStopping(len(containers)))
            for stopped in stop_containers(containers, self.policy.sigterm_grace_s):
                self.tell(outcome.ContainerStopped(stopped))
        survivors: list[ProcessId] = []
        by_ident = self.signalled
        for round_number in range(1, MAX_ROUNDS + 1):
            fresh = self.unsignalled(self.decision)
            if not fresh:
                break
            self.summary.rounds += 1  # counted over the run: the wait may kill respawns too
            if round_number > 1:
                self.tell(outcome.Decided(Decision(fresh)))
            self.tell(outcome.Stopping(len(fresh), round_number))
            self.note(processes=len(fresh), round_number=round_number)
            by_ident.update((c.holder.info.ident, c) for c in fresh)
            with self.procfs.oneshot():
                self.watch.killed(fresh, by_ident, self.procfs, self_chain=self.latest.self_chain)
            result = terminate(
                [c.holder.info.ident for c in fresh],
                grace_s=self.policy.sigterm_grace_s,
                sigkill_wait_s=self.policy.sigkill_wait_s,
                deadline=self.deadline,
                procfs=self.procfs,  # outside any oneshot(): every check reads /proc afresh
                on_signal=lambda ident, sig: self.tell(outcome.SignalSent(by_ident[ident], sig)),
                on_sigkill_wait=lambda idents: self.on_stuck([by_ident[i] for i in idents]),
                pinner=self.scope.pinner,
                clock=self.clock,
            )
            self.summary.killed.extend(result.terminated + result.killed)
            survivors = result.survivors
            if survivors or self.clock() >= self.deadline:
                break
            self.report_faults(self.find_holders()[0])
        self.summary.seconds_kill += self.clock() - kill_started
        if survivors:
            survived = [self.signalled[ident] for ident in survivors]
            self.tell(outcome.Survived(survived))
            self.summary.held = [Blocker.of(choice, outcome.UNKILLABLE) for choice in survived]
            self.found.add(ExitCode.UNKILLABLE)
        return survivors

    def on_stuck(self, choices: list[Choice]) -> None:
        for choice in choices:
            stat = self.procfs.stat(choice.holder.pid)
            process_state = stat.state if stat else "?"
            self.tell(outcome.Stuck(choice, process_state, self.procfs.wchan(choice.holder.pid)))

    def waiting(self) -> Transition:
        """Wait for free GPUs and ports, killing what turns up meanwhile."""
        skipped = self.surroundings.not_to_wait_on(self.latest.owned)
        owned = [gpu for gpu in self.latest.owned if gpu not in skipped]
        if owned or self.ports:
            wait_started = self.clock()
            self.spared_pids = spared_for_good(self.decision)
            busy, ports, held = self.wait_settled(owned)
            self.summary.seconds_wait = self.clock() - wait_started
            self.summary.busy = busy
            for gpu in owned:
                freed = self.used_before.get(gpu.index, 0) - self.driver.usage(gpu).used_mib
                self.summary.freed_mib_by_gpu[gpu.index] = max(freed, 0)
            self.judge_wait(owned, busy, ports, held=held)
        return Transition.SETTLED

    def wait_settled(self, owned: list[Gpu]) -> tuple[list[BusyGpu], list[int], bool]:
        """Poll (5 ms backing off to 50 ms) until the GPUs and ports are free and no respawn is
        under way, or the deadline: the GPUs and ports still held, and whether any is."""
        clock, deadline = self.clock, self.deadline
        interval = FIRST_POLL_S
        next_progress = next_look = clock()
        clear_since: float | None = None
        while True:
            busy, ports, under_way = self.look(owned)
            watched = bool(self.watch.watched)
            now = clock()
            known = {i.pid for i in self.signalled} | self.spared_pids
            unexplained = any(pid not in known for item in busy for pid in item.pids)
            clear = not busy and not ports and not under_way
            if not clear:
                clear_since = None
            if clear and not watched:
                return busy, ports, False
            if (unexplained or ports or under_way or clear) and now >= next_look:
                next_look = now + LOOK_AGAIN_EVERY_S
                if self.look_again():
                    clear_since = None
                    continue
                if clear:
                    if clear_since is not None:
                        return busy, ports, False
                    clear_since = now
            if now >= deadline:
                return busy, ports, watched or not clear
            if now >= next_progress:
                self.waited_on(busy, deadline - now)
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(min(interval, max(deadline - now, 0)))
            interval = min(interval * 1.5, MAX_POLL_S)

    def look(self, owned: list[Gpu]) -> tuple[list[BusyGpu], list[int], list[int]]:
        """One poll: the busy GPUs (also the progress's), the held ports, respawns under way."""
        busy: list[BusyGpu] = []
        for gpu in owned:
            usage = self.driver.usage(gpu)
            spared = [p for p in usage.processes if p.pid in self.spared_pids]
            pids = tuple(p.pid for p in usage.processes if p.pid not in self.spared_pids)
            # What the spared (sharers, protected) hold is theirs, not the run's to wait for.
            used_mib = usage.used_mib - sum(p.used_mib or 0 for p in spared)
            if used_mib > self.config.free_mib or pids:
                busy.append(BusyGpu(gpu, usage.used_mib, pids))
        if busy:
            self.note(waiting_on=tuple(busy))
        self.note(last_busy=tuple(busy))
        ports = sorted(set(listening_sockets(self.scope.roots.proc, self.ports).values()))
        under_way = self.watch.pending(self.procfs) if self.watch.watched else []
        return busy, ports, under_way

    def look_again(self) -> bool:
        """During the wait: rediscover, and kill new targets (respawns) as in the kill rounds."""
        _, decision = self.find_holders()
        self.spared_pids |= spared_for_good(decision)
        fresh = self.unsignalled(decision)
        if not fresh:
            return False
        self.tell(outcome.Decided(Decision(fresh)))  # kill_rounds announces only its later rounds
        self.enter(Stage.STOPPING, Transition.RESPAWNED)
        survivors = self.kill_rounds()
        # Back to the wait, on the same deadline: a survivor's GPUs are still waited for.
        self.enter(Stage.WAITING, Transition.SURVIVED if survivors else Transition.STOPPED)
        return True

    def waited_on(self, busy: list[BusyGpu], left_s: float) -> None:
        if busy:
            self.tell(outcome.MemoryWait(busy, self.config.free_mib, left_s))
        self.tell(outcome.ExtendTimeout(left_s + TIMEOUT_MARGIN_S))

    def judge_wait(
        self, owned: list[Gpu], busy: list[BusyGpu], ports: list[int], *, held: bool
    ) -> None:
        """The wait's outcome: respawning, ports or memory still held, or all free."""
        tell, found, free_mib = self.tell, self.found, self.config.free_mib
        timeout_s = self.policy.wait_timeout_s
        respawners = self.watch.respawners(self.procfs.still_same)
        if held and respawners:
            tell(outcome.Respawning(respawners, timeout_s))
            found.add(ExitCode.RESPAWNING)
            return
        for respawner in respawners:
            tell(outcome.Respawned(respawner))
        failing = self.policy.on_timeout == "fail"
        if busy:
            tell(outcome.MemoryTimeout(busy, free_mib, timeout_s, failing))
        if ports:
            tell(outcome.PortsHeld(ports, timeout_s))
            found.add(ExitCode.HELD_BY_OTHERS)
        if not busy:
            if owned and not ports:
                tell(outcome.MemoryFreed(owned, free_mib, self.summary.seconds_wait))
        elif failing:
            found.add(ExitCode.MEMORY_TIMEOUT)

    def finishing(self) -> Transition:
        """The /dev/shm step, the exit code, the lease (locks held), the last entry."""
        # A refused run killed nothing: it has no /dev/shm files to remove.
        if self.transitions[-1][1] not in (Transition.REFUSED, Transition.START_REFUSED):
            self.clean_shm()
        self.summary.exit_code = outcome_code(self.found)
        # A lease first: one that cannot be written is the run's error (exit 73), never a
        # "success" and then an error. post's failed-pre reason comes last (systemctl status).
        lease_first = self.scope.phase.traits.takes_lease and not self.scope.dry_run
        if not lease_first:
            self.tell(outcome.Finished(self.summary))
        if not self.scope.dry_run:
            self.surroundings.after_run(self.summary)
        if lease_first:
            self.tell(outcome.Finished(self.summary))
        return Transition.FINISHED

    def clean_shm(self) -> None:
        """The killed's /dev/shm files (a dry run: those it would kill), once they are gone;
        then, before a start, the free space the next start needs."""
        host = self.scope.shm_host(self.latest.shm_areas, self.scope.roots.proc)
        label = self.shm_label
        freed = 0
        if self.policy.remove_shm:
            if self.scope.dry_run:  # DRY_RUN left looking for finishing: its decision's targets
                would_kill = {c.holder.pid for c in self.decision.targets}
                removals = plan(self.shm_ledger, would_kill, host, label)
                freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
            else:
                killed = {ident.pid for ident in self.signalled}
                removals = remove(self.shm_ledger, killed, host, label)
            self.tell(outcome.ShmFiles(removals))
        needed_mib = self.config.shm_min_free_mib
        if (
            needed_mib is None
            or not self.scope.phase.traits.before_start
            or outcome_code(self.found) is not ExitCode.OK
        ):
            return
        short = short_of_space(host, needed_mib * MIB, freed)
        if short is not None:
            by_key = host.holders().by_key if short.largest else {}
            holders = {key: sorted(pids) for key, pids in by_key.items()}
            self.tell(outcome.ShmShort(short, holders, label))
            self.found.add(ExitCode.SHM_SPACE)

    def shm_label(self, pid: int) -> str:
        if pid in self.shm_labels:
            return self.shm_labels[pid]
        info = self.procfs.info(pid)
        if info is None:
            return f"PID {pid}"
        unit = unit_of_cgroup(info.cgroup or "/")
        return f"PID {pid} ({info.comm}, {unit})" if unit else f"PID {pid} ({info.comm})"
