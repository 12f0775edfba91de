"""What one run asks of the world around its unit, as protocols: the core calls these and
knows nothing of who answers. A systemd unit's answers (manual-run guard, GPU leases,
failed-start records) are `gpugate.integrations.unit.shared_host.UnitSurroundings`, which
asks the phase's traits what applies (a Slurm job's prolog takes no lease). The front wires
them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpugate.core.decide import Decision
    from gpugate.core.outcome import RunSummary
    from gpugate.host.nvml import Gpu


class Surroundings(Protocol):
    @property
    def gpu_source(self) -> str:
        """Where the unit's GPUs came from, said in the run's first entry."""

    @property
    def gpu_source_warns(self) -> bool:
        """True: every GPU only because nothing named the unit's (a warning)."""

    def before_kill(self, decision: Decision) -> None:
        """Raise (ManualRunRefused) where this run must not kill at all."""

    def start_refusal(self, owned: Sequence[Gpu], *, dry_run: bool) -> str | None:
        """Under the GPU locks, before anything is killed: why this start must not go on
        (another running unit's GPU lease), or None."""

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        """The run refuses: another running unit's processes hold the GPUs. Says what else
        is known of that hold (its GPU lease: who started it, and when)."""

    def take_lease_first(self, owned: Sequence[Gpu]) -> None:
        """Under the GPU locks, before the first kill: what the start will hold on success,
        written now, so that state that cannot be written stops the run before anything
        dies (a run that then fails gives it up in after_run)."""

    def not_to_wait_on(self, owned: Sequence[Gpu]) -> list[Gpu]:
        """The GPUs whose memory need not be waited for again."""

    def after_run(self, summary: RunSummary, start_refusal: str | None) -> None:
        """After a run that was not a dry run, still under the locks."""
