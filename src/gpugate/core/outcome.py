"""A run seen from outside the core: where it is, what it ended with (its code by
`errors.outcome_code`), what surrounds it (`Workload`, in integrations/) and what it
tells (`RunEvent`s, worded in report/narrate.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from gpugate.compat import StrEnum
from gpugate.errors import ExitCode, Interrupted
from gpugate.host.nvml import Gpu
from gpugate.host.scan import ProcessId

if TYPE_CHECKING:
    from gpugate.config.file import LoadedConfig
    from gpugate.core.decide import Choice, Decision
    from gpugate.core.discover import Discovery
    from gpugate.core.kill import Respawner
    from gpugate.core.shm_cleanup import ShmRemoval, SpaceShort
    from gpugate.errors import GateError
    from gpugate.host.containers import StopResult
    from gpugate.host.nvml import GpuFault
    from gpugate.host.shm import ShmKey


class BusyGpu(NamedTuple):
    gpu: Gpu
    used_mib: int
    pids: tuple[int, ...]  # processes NVML still lists on it


class Blocker(NamedTuple):
    """A process that still held the run's GPUs at its end (refused, spared or unkillable),
    with what an admin needs to act on it: its PID, account, GPUs and the rule that kept it."""

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


class RunSummary:
    """What a run did, filled in by `PhaseRun` as it goes."""

    def __init__(self) -> None:
        self.exit_code = ExitCode.OK
        self.killed: list[ProcessId] = []  # stopped by SIGTERM or SIGKILL
        self.rounds = 0
        self.seconds_discover = self.seconds_kill = self.seconds_wait = 0.0
        self.busy: list[BusyGpu] = []  # still used at the deadline
        self.owned: list[Gpu] = []  # the GPUs this run made free
        self.held: list[Blocker] = []  # who kept them: refused, spared, survived
        self.freed_mib_by_gpu: dict[int, int] = {}
        self.degraded = False  # NVML failed and on_nvml_error = warn: the cgroup only
        self.would_kill = 0  # a dry run: how many targets it would have killed


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


class Progress(NamedTuple):
    """What the run is doing: its stage (set only by `PhaseRun.enter`) and that stage's facts."""

    stage: Stage = Stage.LOOKING
    processes: int = 0  # STOPPING: how many this round
    round_number: int = 0  # STOPPING
    lock_gpu: Gpu | None = None  # LOCKING: the GPU whose lock another run holds
    waiting_on: tuple[BusyGpu, ...] = ()  # WAITING: the GPUs still busy
    last_busy: tuple[BusyGpu, ...] = ()  # the GPUs last seen busy (post need not wait again)

    @property
    def doing(self) -> str:
        """What the run is doing, in the words of an interruption's error."""
        if self.stage is Stage.STOPPING:
            return f"stopping {self.processes} process(es) (round {self.round_number})"
        if self.stage is Stage.LOCKING:
            if self.lock_gpu is None:
                return "taking the GPUs' locks"
            return f"waiting for another gpugate run's lock on {self.lock_gpu.label}"
        if self.stage is Stage.WAITING:
            if not self.waiting_on:
                return "waiting for the GPUs and ports to be free"
            shown = ", ".join(
                f"GPU {item.gpu.shown} {item.used_mib} MiB" for item in self.waiting_on
            )
            return f"waiting for the driver to free memory ({shown})"
        if self.stage is Stage.FINISHING:
            return "finishing"
        return "looking for the GPUs' holders"


def interrupted(signal_name: str, progress: Progress | None = None) -> Interrupted:
    """Interrupted in words, the one place: as the signal arrives, or as a run's error (what it
    was doing, what it left). An error's words are made where it is raised, core's too."""
    if progress is None:
        return Interrupted(f"stopped by {signal_name}", signal_name)
    return Interrupted(
        f"stopped by {signal_name} while {progress.doing}; it left no GPU lock or lease",
        signal_name,
        progress.stage.value,
    )


# (folder, what it holds) pairs and (file, what it is) pairs: host.state_dirs.check_all's input
StateToWrite = tuple[list[tuple[Path, str]], list[tuple[Path, str]]]


class Workload:
    """The workload a run cleans up for (a unit's, a Slurm job's, a container's): its config,
    GPUs resolved, and what only it knows. The defaults refuse, share and record nothing;
    integrations/ and the commands subclass it."""

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
        """What this run writes, checked before it kills: the GPU locks (not the metrics)."""
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
        """The owned GPUs the run shares on purpose: others' processes there are sharers."""
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


class PlainWorkload(Workload):
    """A workload with no rule of its own: the run is decided by its config alone."""

    __slots__ = ("gpu_source", "gpu_source_warns", "loaded")
    gpu_source: str  # a field here, a property in Workload
    gpu_source_warns: bool

    def __init__(
        self, loaded: LoadedConfig, gpu_source: str = "", gpu_source_warns: bool = False
    ) -> None:
        self.loaded = loaded
        self.gpu_source, self.gpu_source_warns = gpu_source, gpu_source_warns


class RunEvent:
    """Something that happened in a run, as core's own objects: core tells each to its one
    sink (PhaseRun's `tell`); report.narrate words each kind (journal entry, STATUS=)."""


class RunStarted(RunEvent):  # the run's first entry
    def __init__(self, discovery: Discovery, used_mib: int, workload: Workload) -> None:
        self.discovery, self.used_mib, self.workload = discovery, used_mib, workload


class FaultElsewhere(RunEvent):  # a fault on a GPU the unit does not own
    def __init__(self, fault: GpuFault) -> None:
        self.fault = fault


class Degraded(RunEvent):  # NVML failed, phase.on_nvml_error = warn: the cgroup alone
    def __init__(self, error: GateError, phase: str) -> None:
        self.error, self.phase = error, phase


class NvmlSkipped(RunEvent):  # this start's pre found NVML not answering: not asked
    def __init__(self, why: str, phase: str) -> None:
        self.why, self.phase = why, phase


class BlindSpots(RunEvent):  # what the discovery could not see
    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery


class Decided(RunEvent):  # each holder's verdict: kill, refuse, spare (the run may refuse)
    def __init__(self, decision: Decision) -> None:
        self.decision = decision


class ExtendTimeout(RunEvent):  # what the run asks of systemd's start/stop timeout
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class LockWait(RunEvent):  # another gpugate run holds a GPU's lock
    def __init__(self, gpu: Gpu, left_s: float) -> None:
        self.gpu, self.left_s = gpu, left_s


class LockNotTaken(RunEvent):  # after a stop: a lock that could not be made
    def __init__(self, path: object, cause: str) -> None:
        self.path, self.cause = path, cause


class Stopping(RunEvent):  # a kill round begins
    def __init__(self, count: int, round_number: int) -> None:
        self.count, self.round_number = count, round_number


class ContainerStopping(RunEvent):  # the unit's own containers, through their runtime
    def __init__(self, count: int) -> None:
        self.count = count


class ContainerStopped(RunEvent):
    def __init__(self, result: StopResult) -> None:
        self.result = result


class SignalSent(RunEvent):
    def __init__(self, choice: Choice, signum: int) -> None:
        self.choice, self.signum = choice, signum


class Stuck(RunEvent):  # alive after SIGKILL: its state and wchan, waited for
    def __init__(self, choice: Choice, state: str, wchan: str) -> None:
        self.choice, self.state, self.wchan = choice, state, wchan


class Survived(RunEvent):  # the targets that outlived SIGKILL until the deadline
    def __init__(self, choices: list[Choice]) -> None:
        self.choices = choices


class StillHeld(RunEvent):
    """After the kill, a process the run may not kill still holds a GPU."""


class MemoryWait(RunEvent):  # each poll of the wait that finds GPUs busy
    def __init__(self, busy: Sequence[BusyGpu], free_mib: int, left_s: float) -> None:
        self.busy, self.free_mib, self.left_s = busy, free_mib, left_s


class MemoryTimeout(RunEvent):  # GPUs still busy at the deadline; failing: on_timeout = fail
    def __init__(
        self, busy: Sequence[BusyGpu], free_mib: int, timeout_s: float, failing: bool
    ) -> None:
        self.busy, self.free_mib, self.timeout_s, self.failing = busy, free_mib, timeout_s, failing


class Respawning(RunEvent):  # still respawning the killed at the deadline
    def __init__(self, respawners: Sequence[Respawner], timeout_s: float) -> None:
        self.respawners, self.timeout_s = respawners, timeout_s


class Respawned(RunEvent):  # respawned the killed in the wait; each respawn was killed
    def __init__(self, respawner: Respawner) -> None:
        self.respawner = respawner


class PortsHeld(RunEvent):  # ports still listened on at the deadline
    def __init__(self, ports: Sequence[int], timeout_s: float) -> None:
        self.ports, self.timeout_s = ports, timeout_s


class MemoryFreed(RunEvent):
    def __init__(self, owned: Sequence[Gpu], free_mib: int, seconds: float) -> None:
        self.owned, self.free_mib, self.seconds = owned, free_mib, seconds


class ShmFiles(RunEvent):  # the killed's /dev/shm files: removed or kept, and why
    def __init__(self, removals: list[ShmRemoval]) -> None:
        self.removals = removals


class ShmShort(RunEvent):  # too little free /dev/shm for the start; label: a PID in words
    def __init__(
        self, short: SpaceShort, holders: Mapping[ShmKey, list[int]], label: Callable[[int], str]
    ) -> None:
        self.short, self.holders, self.label = short, holders, label


class Finished(RunEvent):  # the run's last entry
    def __init__(self, summary: RunSummary) -> None:
        self.summary = summary
