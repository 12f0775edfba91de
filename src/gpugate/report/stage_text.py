"""A run's stage in words: what an interrupted run was doing (its `Progress`)."""

from __future__ import annotations

from gpugate.core.outcome import Progress, Stage
from gpugate.errors import Interrupted


def doing(progress: Progress) -> str:
    """What the run was doing, after "while"."""
    stage = progress.stage
    if stage is Stage.STOPPING:
        return f"stopping {progress.processes} process(es) (round {progress.round_number})"
    if stage is Stage.LOCKING:
        if progress.lock_gpu is None:
            return "taking the GPUs' locks"
        return f"waiting for another gpugate run's lock on {progress.lock_gpu.label}"
    if stage is Stage.WAITING:
        if not progress.waiting_on:
            return "waiting for the GPUs and ports to be free"
        shown = ", ".join(
            f"GPU {item.gpu.shown} {item.used_mib} MiB" for item in progress.waiting_on
        )
        return f"waiting for the driver to free memory ({shown})"
    if stage is Stage.FINISHING:
        return "finishing"
    return "looking for the GPUs' holders"


def interrupted(error: Interrupted, progress: Progress) -> Interrupted:
    """The interruption as the run's error: what it was doing, and what it left."""
    return Interrupted(
        f"stopped by {error.signal_name} while {doing(progress)}; it left no GPU lock or lease",
        error.signal_name,
        progress.stage.value,
    )
