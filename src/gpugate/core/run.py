"""One pre, post, prolog or epilog run: find -> decide -> lock -> kill rounds -> wait -> finish.

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too. NVML failing (at the start or mid-run)
with `on_nvml_error = "warn"` degrades the same run to the unit's cgroup alone: same deadline,
same summary. What the run says is `narrate`'s business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpugate.config.models import GpuSelection, LoadedConfig
from gpugate.core.decide import Choice, Decision, decide, spared_for_good
from gpugate.core.discover import Discovery, discover
from gpugate.core.kill import Pinned, terminate
from gpugate.core.outcome import BusyGpu, RunSummary
from gpugate.core.respawn import RespawnWatch
from gpugate.core.roles import Role
from gpugate.core.shm_cleanup import ShmHost, ShmLedger, plan, remove, short_of_space
from gpugate.core.wait import busy_gpus, wait_settled
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
from gpugate.integrations.unit.gpu_source import selection
from gpugate.integrations.unit.shared_host import (
    HostContext,
    after_run,
    gpus_not_to_wait_on,
    leases_refuse,
    name_leases_of_holders,
    refuse_manual_run,
    report_faults,
    waiting_skipped,
)
from gpugate.report.holder_text import describe
from gpugate.report.narrate import Narrator

MAX_ROUNDS = 5
MIB = 1024 * 1024
SHM_SPACE_PHASES = ("pre", "prolog")  # the phases before a start: shm_min_free_mib applies
TIMEOUT_MARGIN_S = 10  # asked of systemd beyond our own deadline, for the exit itself


@dataclass(frozen=True)
class RunScope:
    """What one run is about, decided before it is built."""

    phase: str
    unit: str  # the unit, or the label standing for it (a Slurm job's)
    unit_cgroup: str  # every process in it dies (a Slurm job's cgroup for Slurm)


class PhaseRun:
    def __init__(
        self,
        scope: RunScope,
        loaded: LoadedConfig,
        narrator: Narrator,
        *,
        roots: HostRoots,
        pinner: Callable[[ProcessId, ProcFs], Pinned | None],
        clock: Callable[[], float],
        context: HostContext,
        shm_host: Callable[[list[ShmArea]], ShmHost] | None = None,
    ) -> None:
        """shm_host: the shm files' host side for the areas discovery found (tests)."""
        self.context = context
        self.dry_run = False
        self.lease_refusal: str | None = None  # why another unit's lease refused this pre
        self.scope = scope
        self.loaded = loaded
        self.config = loaded.config
        self.policy = loaded.config.policy(scope.phase)
        self.narrator = narrator
        self.roots = roots
        self.pinner = pinner
        self.clock = clock
        self.started = clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = RunSummary()
        self.wanted: GpuSelection | None = selection(self.config)  # None: no GPU (degraded)
        self.driver: GpuDriver = NoGpus()
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        self.signalled: dict[ProcessId, Choice] = {}  # every target of this run, once
        # The unit's ports matter before it starts: pre only.
        self.ports = self.config.ports if scope.phase == "pre" else ()
        self.watch = RespawnWatch(())
        # Spared for good (protected, holding no GPU of the unit): not waited on. A watcher is
        # not among them: NVML listing it later means it became a GPU user, to look at again.
        self.spared_pids: set[int] = set()
        # Each process's role when first judged in this run: a watcher stays one while the
        # driver frees a killed holder's memory (roles.stable_role).
        self.judged: dict[ProcessId, Role] = {}
        # What the run is doing, and the GPUs it last saw busy: what an interruption says,
        # and which GPUs this start's post need not wait on again.
        self.activity = "looking for the GPUs' holders"
        self.last_busy: list[BusyGpu] = []
        self._announced = False
        # Who held which /dev/shm file, from every discovery; names for the PIDs in the reasons.
        self.shm = ShmLedger()
        self.shm_areas: list[ShmArea] = []
        self.shm_labels: dict[int, str] = {}
        self.shm_host = shm_host or (lambda areas: HostShm(areas, roots.proc))

    def degrade(self, error: NvmlUnavailable) -> None:
        """NVML is unusable: fail, or (on_nvml_error = warn) go on with the cgroup alone."""
        if self.policy.on_nvml_error == "fail" or self.summary.degraded:
            raise error
        self.narrator.degraded(error, self.scope.phase)
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
                return self.sequence(dry_run)
            except NvmlUnavailable as exc:
                self.degrade(exc)  # raises unless the run may go on without NVML

    def find(self) -> tuple[Discovery, Decision]:
        procfs = ProcFs(self.roots.proc)
        found = discover(
            unit=self.scope.unit,
            unit_cgroup=self.scope.unit_cgroup,
            wanted=self.wanted,
            config_source=self.loaded.source,
            driver=self.driver,
            procfs=procfs,
            roots=self.roots,
            ports=self.ports,
            containers=self.config.containers,
        )
        decision = decide(found, self.config, self.scope.phase, procfs, self.judged)
        self.shm.note(found.shm)
        self.shm_areas = found.shm_areas
        for choice in decision.choices:
            self.judged.setdefault(choice.holder.info.ident, choice.role)
            self.shm_labels[choice.holder.pid] = (
                f"PID {choice.holder.pid} ({choice.holder.info.comm}, {choice.role})"
            )
        return found, decision

    def sequence(self, dry_run: bool) -> RunSummary:
        narrator, summary = self.narrator, self.summary
        discovery, decision = self.find()
        summary.seconds_discover = self.clock() - self.started
        summary.owned = list(discovery.owned)
        # Before any kill: later rounds rediscover, and by then memory may already be freed.
        self.used_before = {g.index: discovery.usage[g.index].used_mib for g in discovery.owned}
        self.last_busy = [
            BusyGpu(g, self.used_before[g.index], ())
            for g in discovery.owned
            if self.used_before[g.index] > self.config.free_mib
        ]
        refuse_manual_run(self.context, decision, describe)  # one line, before any other
        if not self._announced:
            narrator.run_started(
                discovery,
                self.loaded.source,
                sum(self.used_before.values()),
                gpu_source=self.context.choice.source,
                gpu_source_warns=self.context.choice.warn,
            )
            self._announced = True
        report_faults(self.context, narrator.reporter, discovery)
        narrator.blind_spots(discovery)
        narrator.choices(decision)
        if decision.refused:
            name_leases_of_holders(self.context, self.loaded, narrator.reporter, discovery.owned)
            narrator.refused()
            summary.exit_code = ExitCode.HELD_BY_OTHERS
            return self.finish()
        if dry_run:
            leased = leases_refuse(
                self.context, self.loaded, narrator.reporter, discovery.owned, dry_run=True
            )
            blocked = bool(decision.blockers) or leased is not None
            summary.exit_code = ExitCode.HELD_BY_OTHERS if blocked else ExitCode.OK
            self.clean_shm(would_kill={c.holder.pid for c in decision.targets})
            return self.finish()
        # The unit's start/stop timeout may be shorter than our deadline: ask for all of it.
        narrator.reporter.extend_timeout(self.deadline - self.clock() + TIMEOUT_MARGIN_S)
        with gpu_locks(
            self.config.lock_dir,
            discovery.owned,
            self.deadline,
            on_wait=self.on_lock_wait,
            clock=self.clock,
        ):
            # Checked and taken in one turn on the locks: an overlapping pre waits for it.
            self.lease_refusal = leases_refuse(
                self.context, self.loaded, narrator.reporter, discovery.owned, dry_run=False
            )
            if self.lease_refusal is not None:
                summary.exit_code = ExitCode.HELD_BY_OTHERS
                return self.finish()
            discovery, decision, survivors = self.kill_rounds(discovery, decision)
            if survivors:
                summary.exit_code = ExitCode.UNKILLABLE
                narrator.survived(len(survivors))
            elif decision.blockers:
                summary.exit_code = ExitCode.HELD_BY_OTHERS
                narrator.still_held()
            else:
                self.wait(discovery, decision)
            self.clean_shm()
            return self.finish()  # the lease is written in finish, still under the locks

    def kill_rounds(
        self, discovery: Discovery, decision: Decision, *, announced: bool = True
    ) -> tuple[Discovery, Decision, list[ProcessId]]:
        """Kill the targets; rediscover and repeat while new ones appear (forks).
        announced: the first round's choices were already narrated (sequence's are)."""
        kill_started = self.clock()
        if self.scope.phase == "pre" and discovery.unit_containers:
            self.stop_containers(discovery, decision)
        by_ident = self.signalled
        survivors: list[ProcessId] = []
        for round_number in range(1, MAX_ROUNDS + 1):
            fresh = [c for c in decision.targets if c.holder.info.ident not in by_ident]
            if not fresh:
                break
            self.summary.rounds += 1  # counted over the run: the wait may kill respawns too
            if round_number > 1 or not announced:
                self.narrator.choices(Decision(fresh))
            self.narrator.stopping(len(fresh), round_number)
            self.activity = f"stopping {len(fresh)} process(es) (round {round_number})"
            by_ident.update((c.holder.info.ident, c) for c in fresh)
            self.watch.self_chain = discovery.self_chain
            self.watch.killed(fresh, by_ident, ProcFs(self.roots.proc))
            result = terminate(
                [c.holder.info.ident for c in fresh],
                grace_s=self.policy.sigterm_grace_s,
                sigkill_wait_s=self.policy.sigkill_wait_s,
                deadline=self.deadline,
                procfs=ProcFs(self.roots.proc),
                on_signal=lambda ident, signum: self.narrator.signal_sent(by_ident[ident], signum),
                on_sigkill_wait=lambda idents: self.on_stuck([by_ident[i] for i in idents]),
                pinner=self.pinner,
                clock=self.clock,
            )
            self.summary.killed.extend(result.terminated + result.killed)
            survivors = result.survivors
            if survivors or self.clock() >= self.deadline:
                break
            discovery, decision = self.find()
            report_faults(self.context, self.narrator.reporter, discovery)
        self.summary.seconds_kill += self.clock() - kill_started
        for ident in survivors:
            self.narrator.survivor(by_ident[ident])
        return discovery, decision, survivors

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
        procfs = ProcFs(self.roots.proc)
        for choice in choices:
            stat = procfs.stat(choice.holder.pid)
            self.narrator.stuck(
                choice, stat.state if stat else "?", procfs.wchan(choice.holder.pid)
            )

    def wait(self, discovery: Discovery, decision: Decision) -> None:
        """Wait for free GPUs and ports; what turns up meanwhile (a respawn) is killed too."""
        owned = list(discovery.owned)
        waited_by_pre = gpus_not_to_wait_on(self.context, owned)
        if waited_by_pre:
            owned = [gpu for gpu in owned if gpu not in waited_by_pre]
            waiting_skipped(self.narrator.reporter, waited_by_pre)
        if not owned and not self.ports:
            return
        free_mib = self.config.free_mib
        wait_started = self.clock()
        self.spared_pids = spared_for_good(decision)

        def on_progress(busy: list[BusyGpu], left: float) -> None:
            if busy:
                self.narrator.memory_wait(busy, free_mib, left)
            self.narrator.reporter.extend_timeout(left + TIMEOUT_MARGIN_S)

        settled = wait_settled(
            busy_gpus=lambda: self.note_busy(
                busy_gpus(self.driver, owned, free_mib, self.spared_pids)
            ),
            busy_ports=lambda: sorted(set(listening_sockets(self.roots.proc, self.ports).values())),
            pending=lambda: self.watch.pending(ProcFs(self.roots.proc)),
            look_again=self.look_again,
            known_pids=lambda: {i.pid for i in self.signalled} | self.spared_pids,
            watching=lambda: bool(self.watch.watched),
            deadline=self.deadline,
            on_progress=on_progress,
            clock=self.clock,
        )
        busy = settled.busy
        self.summary.seconds_wait = self.clock() - wait_started
        self.summary.busy = busy
        for gpu in owned:
            used_after = self.driver.usage(gpu).used_mib
            freed = max(self.used_before.get(gpu.index, 0) - used_after, 0)
            self.summary.freed_mib_by_gpu[gpu.index] = freed
        procfs = ProcFs(self.roots.proc)
        respawners = self.watch.respawners(procfs.still_same)
        if settled.held and respawners:
            self.narrator.respawning(respawners, self.policy.wait_timeout_s)
            self.summary.exit_code = ExitCode.RESPAWNING
            return
        for respawner in respawners:
            self.narrator.respawned(respawner)
        failing = self.policy.on_timeout == "fail"
        for item in busy:
            self.narrator.memory_timeout(
                item, free_mib, self.policy.wait_timeout_s, failing=failing
            )
        if settled.ports:
            self.narrator.ports_held(settled.ports, self.policy.wait_timeout_s)
            self.summary.exit_code = ExitCode.HELD_BY_OTHERS
        elif not busy:
            if owned:
                self.narrator.memory_freed(owned, free_mib, self.summary.seconds_wait)
        elif failing:
            self.summary.exit_code = ExitCode.MEMORY_TIMEOUT

    def shm_label(self, pid: int) -> str:
        if pid in self.shm_labels:
            return self.shm_labels[pid]
        info = ProcFs(self.roots.proc).info(pid)
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
            else:
                killed = {ident.pid for ident in self.signalled}
                removals = remove(self.shm, killed, host, self.shm_label)
            self.narrator.shm_files(removals)
            if would_kill is not None:
                freed = sum(r.facts.bytes for r in removals if r.removed and r.facts)
        needed_mib = self.config.shm_min_free_mib
        if (
            needed_mib is None
            or self.scope.phase not in SHM_SPACE_PHASES
            or self.summary.exit_code is not ExitCode.OK
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
        self.summary.exit_code = ExitCode.SHM_SPACE

    def look_again(self) -> bool:
        """During the wait: rediscover, and kill new targets (respawns) as in the kill rounds."""
        discovery, decision = self.find()
        self.spared_pids |= spared_for_good(decision)
        fresh = [c for c in decision.targets if c.holder.info.ident not in self.signalled]
        if not fresh:
            return False
        # Each target found here (a respawn, a watcher NVML now lists) says why it dies.
        _, _, survivors = self.kill_rounds(discovery, decision, announced=False)
        if survivors:
            self.summary.exit_code = ExitCode.UNKILLABLE
            self.narrator.survived(len(survivors))
        return True

    def finish(self) -> RunSummary:
        self.narrator.finished(self.summary)
        if not self.dry_run:
            after_run(
                self.context,
                self.loaded,
                self.narrator.reporter,
                owned=self.summary.owned,
                exit_code=self.summary.exit_code,
                busy=self.summary.busy,
                lease_refusal=self.lease_refusal,
            )
        return self.summary
