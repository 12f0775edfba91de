"""What one phase run knows as it goes, shared by its stages (core/stages.py): the config and
deadline fixed when it is made, the facts and summary it fills in, who it signalled, the
one discovery round every stage uses (`find`), and the stage it is in: changed only by
`enter` (supervisor's change_state), which records each transition."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpugate.config.file import LoadedConfig
from gpugate.config.values import GpuSelection
from gpugate.core.decide import Choice, Decision, decide
from gpugate.core.discover import Discovery, Sought, discover
from gpugate.core.kill import Pinned, pin
from gpugate.core.outcome import BusyGpu, Progress, RunFacts, RunSummary, Stage, Transition
from gpugate.core.respawn import RespawnWatch
from gpugate.core.roles import Role
from gpugate.core.shm_cleanup import ShmHost, ShmLedger
from gpugate.core.surroundings import Narration, Surroundings
from gpugate.errors import NvmlUnavailable
from gpugate.host.nvml import Gpu, GpuDriver, NoGpus, NvmlDriver
from gpugate.host.procfs import ProcessId, ProcFs
from gpugate.host.roots import HostRoots
from gpugate.host.scan import Deadline, HostShm
from gpugate.host.shm import ShmArea
from gpugate.phase import Phase

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


@dataclass(frozen=True)
class RunDeps:
    """What the run reaches the host through, built once by the front and passed whole;
    production's defaults, each one a test's stand-in."""

    roots: HostRoots = field(default_factory=HostRoots)
    driver_factory: Callable[[], GpuDriver] = NvmlDriver  # opened by the run, closed after
    pinner: Callable[[ProcessId, ProcFs], Pinned | None] = pin
    clock: Callable[[], float] = time.monotonic
    shm_host: Callable[[list[ShmArea], Path], ShmHost] = HostShm  # (areas, proc root)


@dataclass
class ShmSeen:
    """Who held which /dev/shm file, from every discovery, and names for the PIDs."""

    ledger: ShmLedger = field(default_factory=ShmLedger)
    areas: list[ShmArea] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)


class RunState:
    """surroundings.loaded: the config the run uses (the unit's GPUs resolved)."""

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
        self.loaded: LoadedConfig = surroundings.loaded
        self.config = self.loaded.config
        self.policy = self.config.policy(scope.phase)
        self.procfs = ProcFs(deps.roots.proc)  # cached only inside a round's oneshot()
        self.clock = deps.clock
        self.started = self.clock()
        self.deadline = self.started + self.policy.wait_timeout_s
        self.summary = RunSummary()
        self.facts = RunFacts()  # the exit code is exit_code_for(facts), set in finishing
        self.wanted: GpuSelection | None = self.config.selection()  # None: no GPU (degraded)
        self.driver: GpuDriver = NoGpus()  # the run opens NVML's (core/run.py)
        self.used_before: dict[int, int] = {}  # MiB by GPU index, before anything was killed
        self.signalled: dict[ProcessId, Choice] = {}  # every target of this run, once
        self.ports = self.config.ports if scope.phase.traits.checks_ports else ()
        self.watch = RespawnWatch()
        # Spared for good (protected, holding no GPU of the unit): not waited on. A watcher is
        # not among them: NVML listing it later means it became a GPU user, to look at again.
        self.spared_pids: set[int] = set()
        self.reported_faults: set[int] = set()
        # Each process's role when first judged in this run: a watcher stays one while the
        # driver frees a killed holder's memory (roles.stable_role).
        self.judged: dict[ProcessId, Role] = {}
        self.shm = ShmSeen()
        self._progress = Progress()
        self._transitions: list[tuple[Stage, Transition]] = []
        self.locks = contextlib.ExitStack()  # the GPU locks, from locking to the run's end

    @property
    def progress(self) -> Progress:
        return self._progress

    @property
    def transitions(self) -> list[tuple[Stage, Transition]]:
        return list(self._transitions)

    def enter(self, stage: Stage, via: Transition | None = None) -> None:
        """The one way the run changes stage; via: the edge it leaves the current one by
        (None: the first stage). The new stage's facts start empty (`note` fills them)."""
        if via is not None:
            self._transitions.append((self._progress.stage, via))
        self._progress = Progress(stage, last_busy=self._progress.last_busy)

    def end(self, via: Transition) -> None:
        """The last edge: the run is over, still in its last stage."""
        self._transitions.append((self._progress.stage, via))

    def note(self, **facts: Any) -> None:
        """The current stage's facts (Progress's fields), never the stage itself."""
        # A stage among the facts is a TypeError: it is entered (enter), never noted.
        self._progress = replace(self._progress, stage=self._progress.stage, **facts)

    def on_lock_wait(self, gpu: Gpu) -> None:
        self.note(lock_gpu=gpu)
        self.narrator.lock_wait(gpu, self.deadline - self.clock())

    def note_busy(self, busy: list[BusyGpu]) -> list[BusyGpu]:
        """The GPUs seen busy: the wait's, and what an interrupted pre records for its post."""
        if busy:
            self.note(waiting_on=tuple(busy))
        self.note(last_busy=tuple(busy))
        return busy

    def without_nvml(self, error: NvmlUnavailable | None = None) -> None:
        """The unit's cgroup alone, no GPU: same deadline, same summary. error: NVML failed
        here (on_nvml_error = fail, or a second time: the run's error)."""
        if error is not None:
            if self.policy.on_nvml_error == "fail" or self.summary.degraded:
                raise error
            self.narrator.degraded(error, self.scope.phase.value)
        self.summary.degraded = True
        self.wanted = None
        self.driver = NoGpus()

    def find(self) -> tuple[Discovery, Decision]:
        """One round: discovery and decision over one consistent reading of /proc."""
        with self.procfs.oneshot():
            sought = Sought(
                self.scope.unit, self.scope.unit_cgroup, self.wanted, self.loaded.source
            )
            found = discover(
                sought,
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
            )
        self.shm.ledger.note(found.shm)
        self.shm.areas = found.shm_areas
        for choice in decision.choices:
            self.judged.setdefault(choice.holder.info.ident, choice.role)
            self.shm.labels[choice.holder.pid] = (
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
        """The decision's targets this run has not signalled yet."""
        return [c for c in decision.targets if c.holder.info.ident not in self.signalled]
