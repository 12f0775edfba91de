"""One pre, post, prolog or epilog run, as a small stage machine (core/stages.py): looking ->
locking -> stopping -> waiting -> finishing, each transition a code (core/outcome.py).

Discovery and killing repeat (bounded in rounds and by the deadline) so that a holder that
forks while it is being killed is found and killed too. NVML failing (at the start or mid-run)
with `on_nvml_error = "warn"` is a transition back to looking, with the unit's cgroup alone:
same deadline, same summary. What the run says goes through `Narration` (worded in
gpugate.report); what the unit's surroundings add (leases, the manual-run guard) comes through
`Surroundings`. Outside the core, a run is `PhaseRun(...).run()` and its
`progress` (what it is doing, for an interruption to say).
"""

from __future__ import annotations

from gpugate.core.outcome import RunSummary, Transition
from gpugate.core.run_state import TIMEOUT_MARGIN_S, RunDeps, RunScope, RunState
from gpugate.core.stages import Looking, StageStep
from gpugate.errors import GateError, ManualRunRefused, NvmlUnavailable
from gpugate.host.nvml import GpuDriver, NoGpus

__all__ = ["TIMEOUT_MARGIN_S", "PhaseRun", "RunDeps", "RunScope"]


class PhaseRun(RunState):
    """The machine over its state (as supervisor's Subprocess is): made with the run's
    scope, narrator, surroundings and deps; `progress` and `transitions` are what the front
    reads of it."""

    def run(self) -> RunSummary:
        """The run; an error (but a manual run's refusal, where nothing began) is told to the
        surroundings first (not in a dry run), after the locks are released."""
        try:
            self._run()
        except ManualRunRefused:
            raise
        except GateError as exc:
            if not self.dry_run:
                self.surroundings.after_error(exc, self.progress)
            raise
        return self.summary

    def _run(self) -> None:
        driver = self._open()
        try:
            driver.answer_by(self.deadline)  # one that stops answering ends the run
            self.driver = driver
            with self.locks:
                self._go(Looking(self, announce=True))
        finally:
            driver.close()

    def _open(self) -> GpuDriver:
        hung = self.surroundings.driver_hung_earlier()
        if hung is not None:
            # This start's pre waited its deadline on a driver that did not answer: asking
            # again would hang post too. The cgroup still dies.
            self.narrator.nvml_skipped(hung, self.scope.phase.value)
            self.without_nvml()
            return NoGpus()
        try:
            return self.deps.driver_factory()
        except NvmlUnavailable as exc:
            self.without_nvml(exc)  # raises unless the run may go on without NVML
            return NoGpus()

    def _go(self, first: StageStep) -> None:
        self.enter(first.code)
        stage: StageStep | None = first
        while stage is not None:
            current = stage
            try:
                transition, stage = current.step()
            except NvmlUnavailable as exc:
                self.locks.close()  # released before the run goes on without NVML
                self.without_nvml(exc)  # raises unless the run may go on without NVML
                # Looking again, with the unit's cgroup alone; announced once only.
                announce = isinstance(current, Looking) and current.announce
                transition, stage = Transition.NVML_FAILED, Looking(self, announce=announce)
            if stage is None:
                self.end(transition)
            else:
                self.enter(stage.code, transition)
