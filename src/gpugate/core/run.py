"""One pre, post, prolog or epilog run, as a small stage machine (core/stages.py): looking ->
locking -> stopping -> waiting -> finishing, each transition a code (core/stage.py).

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too. NVML failing (at the start or mid-run)
with `on_nvml_error = "warn"` is a transition back to looking, with the unit's cgroup alone:
same deadline, same summary. What the run says goes through `Narration` (worded in
gpugate.report); what the unit's surroundings add (leases, the manual-run guard) comes through
`Surroundings`. Outside the core, a run is `PhaseRun(setup).run()` and its
`progress` (what it is doing, for an interruption to say).
"""

from __future__ import annotations

from collections.abc import Callable

from gpugate.core.outcome import RunSummary
from gpugate.core.run_state import RunDeps, RunScope, RunSetup, RunState
from gpugate.core.stage import Progress, Stage, Transition
from gpugate.core.stages import Looking, StageStep
from gpugate.errors import NvmlUnavailable
from gpugate.host.nvml import GpuDriver, NoGpus

__all__ = ["PhaseRun", "RunDeps", "RunScope", "RunSetup"]


class PhaseRun:
    def __init__(self, setup: RunSetup) -> None:
        self._state = RunState(setup, NoGpus())
        self._transitions: list[tuple[Stage, Transition]] = []

    @property
    def progress(self) -> Progress:
        """What the run is doing now (or was, when it ended in an error)."""
        return self._state.progress

    @property
    def transitions(self) -> list[tuple[Stage, Transition]]:
        """Each stage the run went through, with the transition it left by."""
        return list(self._transitions)

    def run(self) -> RunSummary:
        driver = self._open(self._state.setup.deps.driver_factory)
        try:
            driver.answer_by(self._state.deadline)  # one that stops answering ends the run
            self._state.driver = driver
            with self._state.locks:
                self._go(Looking(self._state, announce=True))
        finally:
            driver.close()
        return self._state.summary

    def _open(self, open_driver: Callable[[], GpuDriver]) -> GpuDriver:
        state = self._state
        hung = state.surroundings.driver_hung_earlier()
        if hung is not None:
            # This start's pre waited its deadline on a driver that did not answer: asking
            # again would hang post too. The cgroup still dies.
            state.narrator.nvml_skipped(hung, state.scope.phase.value)
            state.without_nvml()
            return NoGpus()
        try:
            return open_driver()
        except NvmlUnavailable as exc:
            state.without_nvml(exc)  # raises unless the run may go on without NVML
            return NoGpus()

    def _go(self, first: StageStep) -> None:
        stage: StageStep | None = first
        while stage is not None:
            current = stage
            try:
                transition, stage = current.step()
            except NvmlUnavailable as exc:
                self._state.locks.close()  # released before the run goes on without NVML
                self._state.without_nvml(exc)  # raises unless the run may go on without NVML
                transition, stage = Transition.NVML_FAILED, current.after_nvml_failure()
            self._transitions.append((current.code, transition))
