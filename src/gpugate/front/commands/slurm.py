"""`gpugate slurm prolog|epilog`: slurm.conf's Prolog= and Epilog=."""

from __future__ import annotations

from pathlib import Path

from gpugate.core.run import RunDeps
from gpugate.front.commands import Front
from gpugate.front.hook import stopped_by_signals
from gpugate.front.slurm_hook import SlurmDeps, run_slurm_hook
from gpugate.phase import Phase


def slurm(front: Front, phase: Phase, config: Path | None, *, dry_run: bool = False) -> int:
    with stopped_by_signals():
        deps = SlurmDeps(
            front.environ,
            front.reporter_factory,
            RunDeps(roots=front.host_roots(), driver_factory=front.driver_factory),
        )
        return run_slurm_hook(phase, config, dry_run=dry_run, deps=deps)
