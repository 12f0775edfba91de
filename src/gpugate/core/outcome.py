"""A run seen from outside the core: where it is, what it ended with (its code by
`errors.outcome_code`), what surrounds it (`Workload`, in integrations/) and what it
tells (`Narration`, report/)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpugate.compat import StrEnum
from gpugate.errors import ExitCode
from gpugate.host.nvml import Gpu
from gpugate.host.scan import ProcessId

if TYPE_CHECKING:
    from gpugate.config.file import LoadedConfig
    from gpugate.core.decide import Choice, Decision
    from gpugate.core.discover import Discovery
    from gpugate.core.kill import Respawner
    from gpugate.core.shm_cleanup import ShmRemoval, SpaceShort
    from gpugate.errors import GateError, Interrupted
    from gpugate.host.containers import StopResult
    from gpugate.host.nvml import GpuFault
    from gpugate.host.shm import ShmKey


@dataclass(frozen=True)
class BusyGpu:
    gpu: Gpu
    used_mib: int
    pids: tuple[int, ...]  # processes NVML still lists on it


@dataclass(frozen=True)
class Blocker:
    """A process that still held the run's GPUs when the run ended, because the run refused
    to kill it, spared it or could not kill it. It carries what an admin needs to act on it:
    its PID, account, GPUs and the rule that kept it."""

    pid: int
    user: str | None  # its account's name (or uid), where /proc said
    gpus: tuple[int, ...]  # the run's GPUs it holds
    rule: str  # decide.Rule's value, or UNKILLABLE
    foreign: tuple[int, ...] = ()  # STRADDLES: the GPUs it holds that are not the run's
    other: str | None = None  # OTHER_UNIT / OTHER_CONTAINER: the unit its cgroup is in
    cgroup: str | None = None

    @classmethod
    def of(cls, choice: Choice, rule: str | None = None) -> Blocker:
        """Make the blocker of a decided holder; rule overrides the decision's (UNKILLABLE)."""
        holder = choice.holder
        return cls(
            pid=holder.pid,
            user=holder.info.user if holder.info.uid is not None else None,
            gpus=tuple(sorted(choice.on_owned or holder.using)),
            rule=rule or choice.rule.value,
            foreign=tuple(sorted(choice.foreign)),
            other=choice.other_unit,
            cgroup=holder.info.cgroup,
        )


UNKILLABLE = "unkillable"  # Blocker.rule of a process that outlived SIGKILL


@dataclass
class RunSummary:
    exit_code: ExitCode = ExitCode.OK
    killed: list[ProcessId] = field(default_factory=list)  # stopped by SIGTERM or SIGKILL
    rounds: int = 0
    seconds_discover: float = 0.0
    seconds_kill: float = 0.0
    seconds_wait: float = 0.0
    busy: list[BusyGpu] = field(default_factory=list)  # still used at the deadline
    owned: list[Gpu] = field(default_factory=list)  # the GPUs this run made free
    held: list[Blocker] = field(default_factory=list)  # who kept them: refused, spared, survived
    freed_mib_by_gpu: dict[int, int] = field(default_factory=dict)
    degraded: bool = False  # NVML failed and on_nvml_error = warn: the cgroup only
    would_kill: int = 0  # a dry run: how many targets it would have killed

    @property
    def freed_mib(self) -> int:
        return sum(self.freed_mib_by_gpu.values())

    @property
    def result(self) -> str:
        return result_label(self.exit_code)


def result_label(exit_code: ExitCode) -> str:
    """The metrics' and journal's word for an outcome: success, or the exit code's name."""
    return "success" if exit_code is ExitCode.OK else exit_code.name.lower()


class Stage(StrEnum):
    LOOKING = "looking"  # discovery and decision
    LOCKING = "locking"  # waiting for another gpugate run's lock on a GPU
    STOPPING = "stopping"  # the kill rounds
    WAITING = "waiting"  # for the driver to free the memory (and the ports)
    FINISHING = "finishing"  # the shm step, the surroundings' records, the last entry


class Transition(StrEnum):  # how a stage ended: the edge the run took
    FOUND = "found"  # looking -> locking
    REFUSED = "refused"  # looking -> finishing: another unit's processes hold the GPUs
    DRY_RUN = "dry-run"  # looking -> finishing
    LOCKED = "locked"  # locking -> stopping
    START_REFUSED = "start-refused"  # locking -> finishing: the surroundings refuse the start
    STOPPED = "stopped"  # stopping -> waiting: every target is gone
    SURVIVED = "survived"  # stopping -> finishing (or back to waiting): one outlived SIGKILL
    STILL_HELD = "still-held"  # stopping -> finishing: a blocker still holds a GPU
    SETTLED = "settled"  # waiting -> finishing: free, or the deadline
    RESPAWNED = "respawned"  # waiting -> stopping: a new target turned up in the wait
    NVML_FAILED = "nvml-failed"  # any stage -> looking again, without NVML (on_nvml_error=warn)
    FINISHED = "finished"  # finishing -> the end


# Where each transition leads (None: the run's end). A respawn killed in the wait goes to
# stopping and back to waiting (`stopped` or `survived`) inside the waiting stage.
NEXT_STAGE: dict[Transition, Stage | None] = {
    Transition.FOUND: Stage.LOCKING,
    Transition.REFUSED: Stage.FINISHING,
    Transition.DRY_RUN: Stage.FINISHING,
    Transition.LOCKED: Stage.STOPPING,
    Transition.START_REFUSED: Stage.FINISHING,
    Transition.STOPPED: Stage.WAITING,
    Transition.SURVIVED: Stage.FINISHING,
    Transition.STILL_HELD: Stage.FINISHING,
    Transition.SETTLED: Stage.FINISHING,
    Transition.RESPAWNED: Stage.STOPPING,
    Transition.NVML_FAILED: Stage.LOOKING,
    Transition.FINISHED: None,
}


@dataclass(frozen=True)
class Progress:
    """What the run is doing: its stage (set only by `PhaseRun.enter`) and that stage's facts."""

    stage: Stage = Stage.LOOKING
    processes: int = 0  # STOPPING: how many this round
    round_number: int = 0  # STOPPING
    lock_gpu: Gpu | None = None  # LOCKING: the GPU whose lock another run holds
    waiting_on: tuple[BusyGpu, ...] = ()  # WAITING: the GPUs still busy
    last_busy: tuple[BusyGpu, ...] = ()  # the GPUs last seen busy (post need not wait again)


# (folder, what it holds) pairs and (file, what it is) pairs: host.state_dirs.check_all's input
StateToWrite = tuple[list[tuple[Path, str]], list[tuple[Path, str]]]


class Workload:
    """The workload a run cleans up for: a systemd unit's, a Slurm job's or a container's.

    It holds the run's config (with its GPUs resolved) and answers what only the workload
    knows: which GPUs it shares on purpose, whether another workload's lease refuses this
    start, what this start reserves and what happens after the run. Each default here is the
    plain case, in which nothing is refused, shared or recorded; integrations/ and the
    commands subclass it.
    """

    loaded: LoadedConfig  # the config the run uses: its GPUs resolved to what it is about

    @property
    def gpu_source(self) -> str:
        """Where the GPUs came from, said in the run's first entry."""
        return ""

    @property
    def gpu_source_warns(self) -> bool:
        """True: every GPU only because nothing named the GPUs (a warning)."""
        return False

    def state_to_write(self) -> StateToWrite:
        """The folders and files this run writes, checked before it kills anything: every
        run's GPU locks (the metrics textfile is never a run's failure)."""
        return [(self.loaded.config.lock_dir, "GPU locks")], []

    def known_watchers(self) -> Sequence[ProcessId]:
        """Processes a look before this run judged watchers (the sweep's reap, whose owners
        do not depend on the GPUs' memory): watchers from the start while NVML lists them on
        no GPU, as a watcher of this run's first look stays one."""
        return ()

    def driver_hung_earlier(self) -> str | None:
        """Why not to ask the driver (this start's earlier phase waited on it); None: ask."""
        return None

    def before_kill(self, decision: Decision) -> None:
        """Raise (ManualRunRefused) where this run must not kill at all."""

    def shared_gpus(self, discovery: Discovery) -> frozenset[int]:
        """The owned GPUs' keys the run shares on purpose (docs/what-gets-killed.md): another
        workload's processes there are sharers. The plain case shares none."""
        return frozenset()

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        """Under the GPU locks, before any kill: another workload's claim refuses the start."""
        return False

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        """The run refuses: says what else is known of the others' hold."""

    def reserve(self, owned: Sequence[Gpu]) -> None:
        """Under the GPU locks, before the first kill: what the start will hold, written now."""

    def not_to_wait_on(self, owned: Sequence[Gpu]) -> list[Gpu]:
        """The GPUs whose memory need not be waited for again."""
        return []

    def after_run(self, summary: RunSummary) -> None:
        """After a run that was not a dry run, still under the locks."""

    def after_error(self, error: GateError, progress: Progress) -> None:
        """The run (not a dry run) ended in an error; progress: what it was doing."""


@dataclass(frozen=True)
class PlainWorkload(Workload):
    """A workload with no rule of its own: it refuses nothing, shares nothing and records
    nothing, so the run is decided by its config alone."""

    loaded: LoadedConfig
    gpu_source: str = ""
    gpu_source_warns: bool = False


class Narration(Protocol):
    # the run's start, what it found and chose
    def run_started(
        self,
        discovery: Discovery,
        config_source: str,
        used_mib: int,
        *,
        gpu_source: str = "",
        gpu_source_warns: bool = False,
    ) -> None: ...
    def fault_elsewhere(self, fault: GpuFault, unit: str) -> None: ...
    def degraded(self, error: GateError, phase: str) -> None: ...
    def nvml_skipped(self, why: str, phase: str) -> None: ...
    def blind_spots(self, discovery: Discovery) -> None: ...
    def choices(self, decision: Decision) -> None: ...
    def refused(self) -> None: ...
    def interrupted(self, error: Interrupted, progress: Progress) -> Interrupted: ...
    def extend_timeout(self, seconds: float) -> None: ...
    def lock_wait(self, gpu: Gpu, left_s: float) -> None: ...
    def lock_not_taken(self, path: object, cause: str) -> None: ...

    # the kill
    def stopping(self, count: int, round_number: int) -> None: ...
    def container_stopping(self, count: int) -> None: ...
    def container_stopped(self, result: StopResult) -> None: ...
    def signal_sent(self, choice: Choice, signum: int) -> None: ...
    def stuck(self, choice: Choice, state: str, wchan: str) -> None: ...
    def survivor(self, choice: Choice) -> None: ...
    def survived(self, count: int) -> None: ...
    def still_held(self) -> None: ...

    # the wait and the end
    def memory_wait(self, busy: Sequence[BusyGpu], free_mib: int, left_s: float) -> None: ...
    def memory_timeout(
        self, item: BusyGpu, free_mib: int, timeout_s: float, *, failing: bool
    ) -> None: ...
    def respawning(self, respawners: Sequence[Respawner], timeout_s: float) -> None: ...
    def respawned(self, respawner: Respawner) -> None: ...
    def ports_held(self, ports: Sequence[int], timeout_s: float) -> None: ...
    def memory_freed(self, owned: Sequence[Gpu], free_mib: int, seconds: float) -> None: ...
    def finished(self, summary: RunSummary) -> None: ...

    # the shared memory of the killed
    def shm_files(self, removals: list[ShmRemoval]) -> None: ...
    def shm_short(
        self,
        short: SpaceShort,
        holders: Mapping[ShmKey, list[int]],
        label: Callable[[int], str],
    ) -> None: ...
