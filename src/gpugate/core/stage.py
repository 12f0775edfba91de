"""The phase run's stages and transitions, as codes (after supervisor's process states), and
the one public view of a run under way: `Progress`, what it is doing now. The front reads
`Progress` (an interruption's "while ..." is its stage, worded in report/); nothing outside
the core reads a stage's internals."""

from __future__ import annotations

from dataclasses import dataclass

from gpugate.compat import StrEnum
from gpugate.core.outcome import BusyGpu
from gpugate.host.nvml import Gpu


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
