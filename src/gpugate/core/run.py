"""One pre, post, prolog or epilog run: find -> decide -> lock -> kill rounds -> wait -> finish.

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too. NVML failing (at the start or mid-run)
with `on_nvml_error = "warn"` degrades the same run to the unit's cgroup alone: same deadline,
same summary. What the run says goes through `Narration` (worded in gpugate.report); what the unit's
surroundings add (leases, the manual-run guard) comes through `Surroundings`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpugate.config.models import GpuSelection, LoadedConfig
from gpugate.core.decide import Choice, Decision, decide, spared_for_good
from gpugate.core.discover import Discovery, discover
from gpugate.core.kill import Pinned, terminate
from gpugate.core.narration import Narration
from gpugate.core.outcome import BusyGpu, RunFacts, RunSummary, exit_code_for
from gpugate.core.respawn import RespawnWatch
from gpugate.core.roles import Role
from gpugate.core.shm_cleanup import ShmHost, ShmLedger, plan, remove, short_of_space
from gpugate.core.surroundings import Surroundings
from gpugate.core.wait import Settled, busy_gpus, wait_settled
from gpugate.errors import ExitCode, NvmlUnavailable
from gpugate.host.containers import stop_containers
from gpugate.host.locks import gpu_locks
from gpugate.host.nvml import Gpu, GpuDriver, NoGpus, bind_deadline
from gpugate.host.ports import listening_sockets
from gpugate.host.procfs import ProcessId, ProcFs
from gpugate.host.roots import HostRoots
from gpugate.host.shm import ShmArea, ShmKey
from gpugate.host.shm_host import HostShm
from gpugate.host.systemd import unit_of_cgroup
from gpugate.phase import Phase

MAX_ROUNDS = 5
MIB = 1024 * 1024
TIMEOUT_MARGIN_S = 10  # asked of systemd beyond our own deadline, for the exit itself


@dataclass(frozen=True)
class RunScope:
    """What one run is about, decided before it is built; the one object that carries the
    phase and the unit (the reporter's journal fields are made from it)."""

    phase: Phase
    unit: str  # the unit, or the label standing for it (a Slurm job's)
    unit_cgroup: str  # every process in it dies (a Slurm job's cgroup for Slurm)
    # `gpugate run` by an account that is not root: only that account's processes die (the
    # hidden --for-uid on its hooks, written by root's gpugate; decide.for_account)
    for_uid: int | None = None


class PhaseRun:
    def __init__(
        self,
        scope: RunScope,
        loaded: LoadedConfig,
        narrator: Narration,
        *,
        roots: HostRoots,
        pinner: Callable[[ProcessId, ProcFs], Pinned | None],
        clock: Callable[[], float],
        surroundings: Surroundings,
        shm_host: Callable[[list[ShmArea]], ShmHost] | None = None,
    ) -> None:
        """shm_host: the shm files' host side for the areas discovery found (tests)."""
        self.surroundings = surroundings
        self.dry_run = False
        self.start_refusal: str | None = None  # why the surroundings refused this start
        self.scope = scope
        self.loaded = loaded
        self.config = loaded.config
        self.policy = loaded.config.policy(scope.phase)
        self.narrator = narrator
        self.roots = roots
        self.procfs = ProcFs(roots.proc)  # cached only inside a round's oneshot()
        self.pinner = pinner
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = RunSummary()
        self.facts = RunFacts()  # the exit code is exit_code_for(facts), set in finish
        self.wanted: GpuSelection | None = self.config.selection()  # None: no GPU (degraded)
        self.driver: GpuDriver = NoGpus()
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        self.signalled: dict[ProcessId, Choice] = {}  # every target of this run, once
        self.ports = self.config.ports if scope.phase.traits.checks_ports else ()
        self.watch = RespawnWatch(())
        # Spared for good (protected, holding no GPU of the unit): not waited on. A watcher is
        # not among them: NVML listing it later means it became a GPU user, to look at again.
        self.spared_pids: set[int] = set()
        self.reported_faults: set[int] = set()
        # Each process's role when first judged in this run: a watcher stays one while the
        # driver frees a killed holder's memory (roles.stable_role).
        self.judged: dict[ProcessId, Role] = {}
        # What the run is doing, and the GPUs it last saw busy: what an interruption says,
        # and which GPUs this start's post need not wait on again.
        self.activity = "looking for the GPUs' holders"
        self.last_busy: list[BusyGpu] = []
        self._announced = False
        self.watch_shm(shm_host or (lambda areas: HostShm(areas, roots.proc)))

    def watch_shm(self, shm_host: Callable[[list[ShmArea]], ShmHost]) -> None:
        """Who held which /dev/shm file, from every discovery; names for the PIDs in the
        reasons; the host side of the files."""
        self.shm = ShmLedger()
        self.shm_areas: list[ShmArea] = []
        self.shm_labels: dict[int, str] = {}
        self.shm_host = shm_host

    def degrade(self, error: NvmlUnavailable) -> None:
        """NVML is unusable: fail, or (on_nvml_error = warn) go on with the cgroup alone."""
        if self.policy.on_nvml_error == "fail" or self.summary.degraded:
            raise error
        self.narrator.degraded(error, self.scope.phase.value)
        self.without_nvml()

    def without_nvml(self) -> None:
        """The unit's cgroup alone, no GPU: same deadline, same summary."""
        self.summary.degraded = True
        self.wanted = None
        self.driver = NoGpus()

    def run(self, driver: GpuDriver, *, dry_run: bool) -> RunSummary:
        bind_deadline(driver, self.deadline)  # a driver that stops answering ends the run then
        self.driver = driver
        self.dry_run = dry_run
        while True:
            try:
                return self.sequence()
            except NvmlUnavailable as exc:
                self.degrade(exc)  # raises unless the run may go on without NVML

    def find(self) -> tuple[Discovery, Decision]:
        """One round: discovery and decision over one consistent reading of /proc."""
        with self.procfs.oneshot():
            found = discover(
                unit=self.scope.unit,
                unit_cgroup=self.scope.unit_cgroup,
                wanted=self.wanted,
                config_source=self.loaded.source,
                driver=self.driver,
                procfs=self.procfs,
                roots=self.roots,
                ports=self.ports,
                containers=self.config.containers,
            )
            decision = decide(
                found,
                self.config,
                self.scope.phase,
                self.procfs,
                self.judged,
                for_uid=self.scope.for_uid,
            )
        self.shm.note(found.shm)
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

    def sequence(self) -> RunSummary:
        discovery, decision = self.find()
        self.summary.seconds_discover = self.clock() - self.started
        self.summary.owned = list(discovery.owned)
        # Before any kill: later rounds rediscover, and by then memory may already be freed.
        self.used_before = {g.index: discovery.usage[g.index].used_mib for g in discovery.owned}
        self.last_busy = [
            BusyGpu(g, self.used_before[g.index], ())
            for g in discovery.owned
            if self.used_before[g.index] > self.config.free_mib
        ]
        self.surroundings.before_kill(decision)  # one line, before any other
        self.announce(discovery)
        self.report_faults(discovery)
        self.narrator.blind_spots(discovery)
        self.narrator.choices(decision)
        if decision.refused:
            self.surroundings.held_by_others(discovery.owned)
            self.narrator.refused()
            self.facts.held_by_others = True
        elif self.dry_run:
            refusal = self.surroundings.start_refusal(discovery.owned, dry_run=True)
            blocked = bool(decision.blockers) or refusal is not None
            self.facts.held_by_others = blocked
            self.clean_shm(would_kill={c.holder.pid for c in decision.targets})
        else:
            self.under_locks(discovery, decision)
            return self.summary  # finished under the locks
        return self.finish()

    def announce(self, discovery: Discovery) -> None:
        if self._announced:
            return
        self.narrator.run_started(
            discovery,
            self.loaded.source,
            sum(self.used_before.values()),
            gpu_source=self.surroundings.gpu_source,
            gpu_source_warns=self.surroundings.gpu_source_warns,
        )
        self._announced = True

    def under_locks(self, discovery: Discovery, decision: Decision) -> None:
        # The unit's start/stop timeout may be shorter than our deadline: ask for all of it.
        self.narrator.extend_timeout(self.deadline - self.clock() + TIMEOUT_MARGIN_S)
        with gpu_locks(
            self.config.lock_dir,
            discovery.owned,
            self.deadline,
            on_wait=self.on_lock_wait,
            clock=self.clock,
        ):
            # Checked and taken in one turn on the locks: an overlapping pre waits for it.
            self.start_refusal = self.surroundings.start_refusal(discovery.owned, dry_run=False)
            if self.start_refusal is not None:
                self.facts.held_by_others = True
            else:
                self.surroundings.take_lease_first(discovery.owned)
                self.kill_and_wait(discovery, decision)
                self.clean_shm()
            self.finish()  # the lease is written in finish, still under the locks

    def kill_and_wait(self, discovery: Discovery, decision: Decision) -> None:
        discovery, decision, survivors = self.kill_rounds(discovery, decision)
        if survivors:
            self.facts.survivors = True
            self.narrator.survived(len(survivors))
        elif decision.blockers:
            self.facts.held_by_others = True
            self.narrator.still_held()
        else:
            self.wait(discovery, decision)

    def kill_rounds(
        self, discovery: Discovery, decision: Decision
    ) -> tuple[Discovery, Decision, list[ProcessId]]:
        """Kill the targets; rediscover and repeat while new ones appear (forks)."""
        kill_started = self.clock()
        if self.scope.phase.traits.stops_containers and discovery.unit_containers:
            self.stop_containers(discovery, decision)
        survivors: list[ProcessId] = []
        for round_number in range(1, MAX_ROUNDS + 1):
            fresh = [c for c in decision.targets if c.holder.info.ident not in self.signalled]
            if not fresh:
                break
            survivors = self.kill_round(discovery, fresh, round_number)
            if survivors or self.clock() >= self.deadline:
                break
            discovery, decision = self.find()
            self.report_faults(discovery)
        self.summary.seconds_kill += self.clock() - kill_started
        for ident in survivors:
            self.narrator.survivor(self.signalled[ident])
        return discovery, decision, survivors

    def kill_round(
        self, discovery: Discovery, fresh: list[Choice], round_number: int
    ) -> list[ProcessId]:
        by_ident = self.signalled
        self.summary.rounds += 1  # counted over the run: the wait may kill respawns too
        if round_number > 1:
            self.narrator.choices(Decision(fresh))
        self.narrator.stopping(len(fresh), round_number)
        self.activity = f"stopping {len(fresh)} process(es) (round {round_number})"
        by_ident.update((c.holder.info.ident, c) for c in fresh)
        self.watch.self_chain = discovery.self_chain
        with self.procfs.oneshot():
            self.watch.killed(fresh, by_ident, self.procfs)
        result = terminate(
            [c.holder.info.ident for c in fresh],
            grace_s=self.policy.sigterm_grace_s,
            sigkill_wait_s=self.policy.sigkill_wait_s,
            deadline=self.deadline,
            procfs=self.procfs,  # outside any oneshot(): every check reads /proc afresh
            on_signal=lambda ident, signum: self.narrator.signal_sent(by_ident[ident], signum),
            on_sigkill_wait=lambda idents: self.on_stuck([by_ident[i] for i in idents]),
            pinner=self.pinner,
            clock=self.clock,
        )
        self.summary.killed.extend(result.terminated + result.killed)
        return result.survivors

    def stop_containers(self, discovery: Discovery, decision: Decision) -> None:
        """The unit's own containers stop through their runtime first (it records them as
        stopped); the pinned signals then follow for any process that outlived it."""
        wanted = {c.holder.container.id for c in decision.targets if c.holder.container}
        containers = [c for c in discovery.unit_containers if c.id in wanted]
        self.narrator.container_stopping(len(containers))
        for result in stop_containers(containers, self.policy.sigterm_grace_s):
            self.narrator.container_stopped(result)

    def on_lock_wait(self, gpu: Gpu) -> None:
        self.activity = f"waiting for another gpugate run's lock on {gpu.label}"
        self.narrator.lock_wait(gpu, self.deadline - self.clock())

    def note_busy(self, busy: list[BusyGpu]) -> list[BusyGpu]:
        if busy:
            shown = ", ".join(f"GPU {item.gpu.index} {item.used_mib} MiB" for item in busy)
            self.activity = f"waiting for the driver to free memory ({shown})"
        self.last_busy = busy
        return busy

    def on_stuck(self, choices: list[Choice]) -> None:
        for choice in choices:
            stat = self.procfs.stat(choice.holder.pid)
            state = stat.state if stat else "?"
            self.narrator.stuck(choice, state, self.procfs.wchan(choice.holder.pid))

    def wait(self, discovery: Discovery, decision: Decision) -> None:
        """Wait for free GPUs and ports; what turns up meanwhile (a respawn) is killed too."""
        skipped = self.surroundings.not_to_wait_on(discovery.owned)
        owned = [gpu for gpu in discovery.owned if gpu not in skipped]
        if not owned and not self.ports:
            return
        wait_started = self.clock()
        self.spared_pids = spared_for_good(decision)
        settled = self.settle(owned)
        self.summary.seconds_wait = self.clock() - wait_started
        self.summary.busy = settled.busy
        for gpu in owned:
            used_after = self.driver.usage(gpu).used_mib
            freed = max(self.used_before.get(gpu.index, 0) - used_after, 0)
            self.summary.freed_mib_by_gpu[gpu.index] = freed
        self.judge_wait(settled, owned)

    def settle(self, owned: list[Gpu]) -> Settled:
        free_mib = self.config.free_mib

        def on_progress(busy: list[BusyGpu], left: float) -> None:
            if busy:
                self.narrator.memory_wait(busy, free_mib, left)
            self.narrator.extend_timeout(left + TIMEOUT_MARGIN_S)

        return wait_settled(
            busy_gpus=lambda: self.note_busy(
                busy_gpus(self.driver, owned, free_mib, self.spared_pids)
            ),
            busy_ports=lambda: sorted(set(listening_sockets(self.roots.proc, self.ports).values())),
            pending=lambda: self.watch.pending(self.procfs),
            look_again=self.look_again,
            known_pids=lambda: {i.pid for i in self.signalled} | self.spared_pids,
            watching=lambda: bool(self.watch.watched),
            deadline=self.deadline,
            on_progress=on_progress,
            clock=self.clock,
        )

    def judge_wait(self, settled: Settled, owned: list[Gpu]) -> None:
        """The wait's outcome: respawning, ports or memory still held, or all free."""
        busy, timeout_s = settled.busy, self.policy.wait_timeout_s
        respawners = self.watch.respawners(self.procfs.still_same)
        if settled.held and respawners:
            self.narrator.respawning(respawners, timeout_s)
            self.facts.respawning = True
            return
        for respawner in respawners:
            self.narrator.respawned(respawner)
        failing = self.policy.on_timeout == "fail"
        for item in busy:
            self.narrator.memory_timeout(item, self.config.free_mib, timeout_s, failing=failing)
        if settled.ports:
            self.narrator.ports_held(settled.ports, timeout_s)
            self.facts.held_by_others = True
        if not busy:
            if owned and not settled.ports:
                self.narrator.memory_freed(owned, self.config.free_mib, self.summary.seconds_wait)
        elif failing:
            self.facts.memory_busy = True

    def shm_label(self, pid: int) -> str:
        if pid in self.shm_labels:
            return self.shm_labels[pid]
        info = self.procfs.info(pid)
        if info is None:
            return f"PID {pid}"
        unit = unit_of_cgroup(info.cgroup or "/")
        return f"PID {pid} ({info.comm}, {unit})" if unit else f"PID {pid} ({info.comm})"

    def clean_shm(self, would_kill: set[int] | None = None) -> None:
        """The shared memory of the killed (a dry run: of those it would kill), once they are
        gone; then, before a start, the free space the next start needs."""
        host = self.shm_host(self.shm_areas)
        freed = 0
        if self.policy.remove_shm:
            if would_kill is not None:
                removals = plan(self.shm, would_kill, host, self.shm_label)
                freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
            else:
                killed = {ident.pid for ident in self.signalled}
                removals = remove(self.shm, killed, host, self.shm_label)
            self.narrator.shm_files(removals)
        self.check_shm_space(host, freed)

    def check_shm_space(self, host: ShmHost, freed: int) -> None:
        needed_mib = self.config.shm_min_free_mib
        if (
            needed_mib is None
            or not self.scope.phase.traits.before_start
            or exit_code_for(self.facts) is not ExitCode.OK
        ):
            return
        short = short_of_space(host, needed_mib * MIB, freed)
        if short is None:
            return
        holders: dict[ShmKey, list[int]] = {}
        if short.largest:
            for key, pids in host.holders().by_key.items():
                holders[key] = sorted(pids)
        self.narrator.shm_short(short, holders, self.shm_label)
        self.facts.shm_short = True

    def look_again(self) -> bool:
        """During the wait: rediscover, and kill new targets (respawns) as in the kill rounds."""
        discovery, decision = self.find()
        self.spared_pids |= spared_for_good(decision)
        fresh = [c for c in decision.targets if c.holder.info.ident not in self.signalled]
        if not fresh:
            return False
        self.narrator.choices(Decision(fresh))  # kill_rounds announces only its later rounds
        _, _, survivors = self.kill_rounds(discovery, decision)
        if survivors:
            self.facts.survivors = True
            self.narrator.survived(len(survivors))
        return True

    def finish(self) -> RunSummary:
        self.summary.exit_code = exit_code_for(self.facts)
        if self.dry_run:
            self.narrator.finished(self.summary)
            return self.summary
        # A lease first: one that cannot be written is the run's error (exit 73), never a
        # "success" and then an error. post's failed-pre reason comes last (systemctl status).
        lease_first = self.scope.phase.traits.takes_lease
        if not lease_first:
            self.narrator.finished(self.summary)
        self.surroundings.after_run(self.summary, self.start_refusal)
        if lease_first:
            self.narrator.finished(self.summary)
        return self.summary
