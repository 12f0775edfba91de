"""What one run asks of the world around what it frees (a systemd unit, a Slurm job, a
container), as a protocol: the core and the front call these and know nothing of who
answers. Four answer today: a systemd unit's (`gpugate.integrations.unit.
UnitSurroundings`: manual-run guard, GPU leases, failed-start records, asking the phase's
traits what applies), a Slurm job's (`gpugate.integrations.slurm.JobSurroundings`: Slurm
gives out its GPUs itself), a container's (`gpugate.integrations.container.
ContainerSurroundings`, for `gpugate oci-hook`: a unit's, with the container's scope as the
unit) and `NullSurroundings` here (nothing around: the plain case, and tests). The front
wires them. And what the run tells (`Narration`), worded in gpugate.report."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpugate.config.file import Config, LoadedConfig

if TYPE_CHECKING:
    from gpugate.core.decide import Choice, Decision
    from gpugate.core.discover import Discovery
    from gpugate.core.outcome import BusyGpu, Progress, RunSummary
    from gpugate.core.respawn import Respawner
    from gpugate.core.shm_cleanup import ShmRemoval, SpaceShort
    from gpugate.errors import GateError
    from gpugate.host.containers import StopResult
    from gpugate.host.nvml import Gpu, GpuFault
    from gpugate.host.shm import ShmKey


# (folder, what it holds) pairs and (file, what it is) pairs: host.locks.check_all's input
StateToWrite = tuple[list[tuple[Path, str]], list[tuple[Path, str]]]


class Surroundings(Protocol):
    @property
    def loaded(self) -> LoadedConfig:
        """The config the run uses: its GPUs resolved to what this run is about."""

    @property
    def gpu_source(self) -> str:
        """Where the GPUs came from, said in the run's first entry."""

    @property
    def gpu_source_warns(self) -> bool:
        """True: every GPU only because nothing named the GPUs (a warning)."""

    def state_to_write(self) -> StateToWrite:
        """Every folder this run writes its state in, with what goes there, and the files it
        replaces whole: checked before the run kills anything (host.locks); a problem
        stops a phase whose state is required, else it is a warning."""

    def driver_hung_earlier(self) -> str | None:
        """Why the driver is not to be asked at all (the same start's earlier phase waited
        its deadline on it), in that phase's words; None: ask it."""

    def before_kill(self, decision: Decision) -> None:
        """Raise (ManualRunRefused) where this run must not kill at all."""

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        """Under the GPU locks, before anything is killed: whether this start must not go on
        (another running workload's claim on the GPUs; the surroundings say why, and keep
        it for after_run)."""

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        """The run refuses: others' processes hold the GPUs. Says what else is known of
        that hold (their claim: who started it, and when)."""

    def reserve(self, owned: Sequence[Gpu]) -> None:
        """Under the GPU locks, before the first kill: what the start will hold on success,
        written now, so that state that cannot be written stops the run before anything
        dies (a run that then fails gives it up in after_run)."""

    def not_to_wait_on(self, owned: Sequence[Gpu]) -> list[Gpu]:
        """The GPUs whose memory need not be waited for again."""

    def after_run(self, summary: RunSummary) -> None:
        """After a run that was not a dry run, still under the locks."""

    def after_error(self, error: GateError, progress: Progress) -> None:
        """The run (not a dry run) ended in an error (Interrupted: stopped by SIGTERM or
        SIGINT), the locks released; progress: what it was doing, and the GPUs it was
        still waiting for (the same start's next phase need not wait on them again)."""


def run_state_to_write(config: Config) -> StateToWrite:
    """What every run writes: its GPU locks. (Not the metrics textfile: metrics are never a
    run's failure; one that cannot be written is a warning after the run.)"""
    return [(config.lock_dir, "GPU locks")], []


@dataclass(frozen=True)
class NullSurroundings:
    """Nothing around the run: no claims, no records, nothing refused; the config's GPUs."""

    loaded: LoadedConfig
    gpu_source: str = ""  # "": the run's first entry names only the config
    gpu_source_warns: bool = False

    def state_to_write(self) -> StateToWrite:
        return run_state_to_write(self.loaded.config)

    def driver_hung_earlier(self) -> str | None:
        return None

    def before_kill(self, decision: Decision) -> None:
        return None

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        return False

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        return None

    def reserve(self, owned: Sequence[Gpu]) -> None:
        return None

    def not_to_wait_on(self, owned: Sequence[Gpu]) -> list[Gpu]:
        return []

    def after_run(self, summary: RunSummary) -> None:
        return None

    def after_error(self, error: GateError, progress: Progress) -> None:
        return None


# What the run tells as it goes: the run says what happened, in its own terms;
# `gpugate.report.narrate.Narrator` words it (journal entries, STATUS= lines). The front
# passes the narrator in, so the core never imports the report layer.


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
