"""A dry run's entries go to stdout through one twin of the hook's reporter: once its echo
fails (`gpugate pre --dry-run UNIT | head`: EPIPE), nothing later in the run tries again."""

from __future__ import annotations

import io

import pytest

from gpugate.core.run import RunScope
from gpugate.front.hook import Hook
from gpugate.phase import Phase
from gpugate.report.journal import Event, Reporter
from tests.fakes import RecordingJournal, RecordingNotifier


class ClosedPipe(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    def write(self, text: str) -> int:
        self.tries += 1
        raise BrokenPipeError(32, "Broken pipe")


def test_a_dry_runs_echo_once_broken_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = ClosedPipe()
    monkeypatch.setattr("sys.stdout", pipe)
    journal = RecordingJournal()
    reporter = Reporter("m.service", "pre", journal=journal, notifier=RecordingNotifier())
    scope = RunScope(Phase.PRE, "m.service", lambda: "/m", dry_run=True)
    hook = Hook(scope, lambda *a: None, reporter)  # type: ignore[arg-type,return-value]
    for _ in range(3):  # the run's narrator, its failure's, the metrics warning's
        hook.narrator().reporter.event(Event.RUN_STARTED, "looking")
    assert pipe.tries == 1
    assert len(journal.entries) == 3
    assert all(fields.get("GPUGATE_DRY_RUN") == "1" for _, fields in journal.entries)
