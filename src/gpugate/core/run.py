"""One pre, post, prolog or epilog run, as a small stage machine (core/stages.py): looking ->
locking -> stopping -> waiting -> finishing, each transition a code (core/stage.py).

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too. NVML failing (at the start or mid-run)
with `on_nvml_error = "warn"` is a transition back to looking, with the unit's cgroup alone:
same deadline, same summary. What the run says goes through `Narration` (worded in
gpugate.report); what the unit's surroundings add (leases, the manual-run guard) comes through
`Surroundings`. Outside the core, a run is `PhaseRun(...).run()` and its
`progress` (what it is doing, for an interruption to say).
"""

from __future__ import annotations

from gpugate.core.narration import Narration
from gpugate.core.outcome import RunSummary
from gpugate.core.run_state import TIMEOUT_MARGIN_S, RunDeps, RunScope, RunState
from gpugate.core.stage import Progress, Stage, Transition
from gpugate.core.stages import Looking, StageStep
from gpugate.core.surroundings import Surroundings
from gpugate.errors import GateError, ManualRunRefused, NvmlUnavailable
from gpugate.host.nvml import GpuDriver, NoGpus

__all__ = ["TIMEOUT_MARGIN_S", "PhaseRun", "RunDeps", "RunScope"]


class PhaseRun:
    """surroundings.loaded: the config the run uses (the unit's GPUs resolved)."""

    def __init__(
        self,
        scope: RunScope,
        narrator: Narration,
        surroundings: Surroundings,
        deps: RunDeps,
        *,
        dry_run: bool = False,
    ) -> None:
        self._state = RunState(scope, narrator, surroundings, deps, dry_run=dry_run)

    @property
    def progress(self) -> Progress:
        """What the run is doing now (or was, when it ended in an error)."""
        return self._state.progress

    @property
    def transitions(self) -> list[tuple[Stage, Transition]]:
        """Each stage the run went through, with the transition it left by."""
        return self._state.transitions

    def run(self) -> RunSummary:
        """The run; an error (but a manual run's refusal, where nothing began) is told to the
        surroundings first (not in a dry run), after the locks are released."""
        state = self._state
        try:
            self._run()
        except ManualRunRefused:
            raise
        except GateError as exc:
            if not state.dry_run:
                state.surroundings.after_error(exc, state.progress)
            raise
        return state.summary

    def _run(self) -> None:
        state = self._state
        driver = self._open()
        try:
            driver.answer_by(state.deadline)  # one that stops answering ends the run
            state.driver = driver
            with state.locks:
                self._go(Looking(state, announce=True))
        finally:
            driver.close()

    def _open(self) -> GpuDriver:
        state = self._state
        hung = state.surroundings.driver_hung_earlier()
        if hung is not None:
            # This start's pre waited its deadline on a driver that did not answer: asking
            # again would hang post too. The cgroup still dies.
            state.narrator.nvml_skipped(hung, state.scope.phase.value)
            state.without_nvml()
            return NoGpus()
        try:
            return state.deps.driver_factory()
        except NvmlUnavailable as exc:
            state.without_nvml(exc)  # raises unless the run may go on without NVML
            return NoGpus()

    def _go(self, first: StageStep) -> None:
        state = self._state
        state.enter(first.code)
        stage: StageStep | None = first
        while stage is not None:
            current = stage
            try:
                transition, stage = current.step()
            except NvmlUnavailable as exc:
                state.locks.close()  # released before the run goes on without NVML
                state.without_nvml(exc)  # raises unless the run may go on without NVML
                # Looking again, with the unit's cgroup alone; announced once only.
                announce = isinstance(current, Looking) and current.announce
                transition, stage = Transition.NVML_FAILED, Looking(state, announce=announce)
            if stage is None:
                state.end(transition)
            else:
                state.enter(stage.code, transition)
