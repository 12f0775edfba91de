"""What a run ended with: its exit code and what it did, in terms every reporter shares; and
where a run is: its stage and transition codes and its `Progress` (what an interruption
names).

Low in the stack (beside `errors`): the pipeline fills it in; the narration, the metrics and
the Slurm drain reason read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpugate.compat import StrEnum
from gpugate.errors import ExitCode
from gpugate.host.nvml import Gpu
from gpugate.host.procfs import ProcessId


@dataclass(frozen=True)
class BusyGpu:
    gpu: Gpu
    used_mib: int
    pids: tuple[int, ...]  # processes NVML still lists on it


@dataclass(frozen=True)
class Held:
    """A process that kept the run's GPUs at its end: what an admin needs to act on it."""

    pid: int
    user: str | None  # its account's name (or uid), where /proc said
    gpus: tuple[int, ...]  # the run's GPUs it holds
    rule: str  # decide.Rule's value, or UNKILLABLE: why it was not killed
    foreign: tuple[int, ...] = ()  # STRADDLES: the GPUs it holds that are not the run's
    other: str | None = None  # OTHER_UNIT / OTHER_CONTAINER: the unit its cgroup is in
    cgroup: str | None = None  # its cgroup (a Slurm job's names the job)


UNKILLABLE = "unkillable"  # Held.rule of a process that outlived SIGKILL


@dataclass
class RunFacts:
    """What a run found that decides its exit code; several can hold at once."""

    survivors: bool = False  # a target outlived SIGKILL (D state)
    respawning: bool = False  # a process gpugate may not take kept respawning holders
    held_by_others: bool = False  # refused, leased, a blocker or a port held by another
    memory_busy: bool = False  # memory still used at the deadline, with on_timeout = "fail"
    shm_short: bool = False  # before a start: /dev/shm has less free than shm_min_free_mib


# First the cause the operator must remove before anything else helps: a respawner (a loop, a
# supervisor) makes every kill futile, and the respawn it started last, killed at the
# deadline, had no time to die (it would read as a survivor). Then a survivor of SIGKILL (a GPU
# reset or a reboot, whatever else holds); then a holder gpugate may not kill (its owner's to
# stop); then memory no process holds (the driver's to free); last, /dev/shm short of space
# for the next start (looked at only when all else went well).
PRECEDENCE = (
    ("respawning", ExitCode.RESPAWNING),
    ("survivors", ExitCode.UNKILLABLE),
    ("held_by_others", ExitCode.HELD_BY_OTHERS),
    ("memory_busy", ExitCode.MEMORY_TIMEOUT),
    ("shm_short", ExitCode.SHM_SPACE),  # looked at only where nothing above holds
)


def exit_code_for(facts: RunFacts) -> ExitCode:
    """The run's exit code: the first of PRECEDENCE whose fact holds, else OK. (Errors that
    end a run early, GateError, carry their own code and are not facts.)"""
    for name, code in PRECEDENCE:
        if getattr(facts, name):
            return code
    return ExitCode.OK


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
    held: list[Held] = field(default_factory=list)  # who kept them: refused, spared, survived
    freed_mib_by_gpu: dict[int, int] = field(default_factory=dict)  # by GPU index
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


# Where a run is: the phase run's stages and transitions, as codes (after supervisor's
# process states), and the one public view of a run under way: `Progress`, what it is doing
# now. The front reads `Progress` (an interruption's "while ..." is its stage, worded in
# report/); nothing outside the core reads a stage's internals.


class Stage(StrEnum):
    LOOKING = "looking"  # discovery and decision
    LOCKING = "locking"  # waiting for another gpugate run's lock on a GPU
    STOPPING = "stopping"  # the kill rounds
    WAITING = "waiting"  # for the driver to free the memory (and the ports)
    FINISHING = "finishing"  # the shm step, the surroundings' records, the last entry


class Transition(StrEnum):
    """How a stage ended: the edge the run took (the run's `transitions` lists them)."""

    FOUND = "found"  # looking -> locking: there is something to do under the locks
    REFUSED = "refused"  # looking -> finishing: another unit's processes hold the GPUs
    DRY_RUN = "dry-run"  # looking -> finishing: a dry run stops after the decision
    LOCKED = "locked"  # locking -> stopping
    START_REFUSED = "start-refused"  # locking -> finishing: the surroundings refuse the start
    STOPPED = "stopped"  # stopping -> waiting: every target is gone
    SURVIVED = "survived"  # stopping -> finishing (or back to waiting): one outlived SIGKILL
    STILL_HELD = "still-held"  # stopping -> finishing: a blocker still holds a GPU
    SETTLED = "settled"  # waiting -> finishing: free, or the deadline
    RESPAWNED = "respawned"  # waiting -> stopping: a new target turned up in the wait
    NVML_FAILED = "nvml-failed"  # any stage -> looking again, without NVML (on_nvml_error=warn)
    FINISHED = "finished"  # finishing -> the end


@dataclass(frozen=True)
class Progress:
    """What the run is doing: its stage (set only by entering one: `RunState.enter`) and the
    facts that stage is about."""

    stage: Stage = Stage.LOOKING
    processes: int = 0  # STOPPING: how many this round
    round_number: int = 0  # STOPPING: which round
    lock_gpu: Gpu | None = None  # LOCKING: the GPU whose lock another run holds
    waiting_on: tuple[BusyGpu, ...] = ()  # WAITING: the GPUs still busy
    last_busy: tuple[BusyGpu, ...] = ()  # the GPUs last seen busy (post need not wait again)
