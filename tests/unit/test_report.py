"""report.py: what every journal entry carries, errors logged once, dry runs, STATUS=, and the
`waiting` event's pace."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gpugate.core import outcome
from gpugate.core.outcome import BusyGpu, LockWait, MemoryWait
from gpugate.errors import ConfigError, GateError
from gpugate.host.nvml import Gpu
from gpugate.report.journal import SYSLOG_IDENTIFIER, Event, Reporter
from gpugate.report.narrate import WORDS, Narrator, lease_refusal_text
from tests.fakes import RecordingJournal, RecordingNotifier


def make(**kwargs: object) -> tuple[Reporter, RecordingJournal, RecordingNotifier, io.StringIO]:
    journal, notifier, stream = RecordingJournal(), RecordingNotifier(), io.StringIO()
    reporter = Reporter(
        "vllm.service", "pre", journal=journal, notifier=notifier, stream=stream, echo=True
    )
    return reporter, journal, notifier, stream


def emit_here(reporter: Reporter) -> int:
    line = sys._getframe().f_lineno + 1
    reporter.event(Event.RUN_STARTED, "hello")
    return line


@pytest.mark.parametrize("kind", list(Event))
def test_every_entry_is_gpugate_and_names_its_real_call_site(kind: Event) -> None:
    reporter, journal, _, _ = make()
    line = sys._getframe().f_lineno + 1
    reporter.event(kind, "x")
    line_2 = emit_here(reporter)
    Narrator(reporter).failed(GateError("boom"))  # the narrator's failed() is named
    Narrator(reporter).metrics_not_written("/m.prom", "EROFS")  # through Reporter.warn
    sites = [(f["CODE_FILE"], f["CODE_LINE"], f["CODE_FUNC"]) for _, f in journal.entries]
    here = __file__
    assert sites[:2] == [
        (here, str(line), "test_every_entry_is_gpugate_and_names_its_real_call_site"),
        (here, str(line_2), "emit_here"),
    ]
    assert Path(sites[2][0]).name == "narrate.py" and sites[2][2] == "failed"
    assert Path(sites[3][0]).name == "narrate.py" and sites[3][2] == "metrics_not_written"
    assert journal.entries[3][1]["GPUGATE_REASON"] == "metrics-unwritable"
    assert all(f["SYSLOG_IDENTIFIER"] == SYSLOG_IDENTIFIER == "gpugate" for _, f in journal.entries)
    assert all("GPUGATE_DRY_RUN" not in f for _, f in journal.entries)


@pytest.mark.message
def test_fail_is_one_entry_one_status_and_stderr_unless_stderr_is_the_journal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reporter, journal, notifier, stream = make()
    with tempfile.TemporaryFile("w+") as err:
        Narrator(reporter).failed(
            ConfigError("/etc/gpugate/x.toml", "free_mib", "must be at least 1"), err
        )
        err.seek(0)
        assert err.read() == "gpugate: /etc/gpugate/x.toml: free_mib: must be at least 1\n"
        ((message, fields),) = journal.entries
        assert fields["GPUGATE_EVENT"] == "error" and fields["PRIORITY"] == "3"
        assert fields["GPUGATE_EXIT_CODE"] == "78"
        assert notifier.states == ["STATUS=gpugate pre: failed: " + message]
        # Under systemd (JOURNAL_STREAM names stderr) the structured entry is the only one.
        info = os.fstat(err.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
        err.seek(0)
        err.truncate()
        Narrator(reporter).failed(GateError("again"), err)
        err.seek(0)
        assert err.read() == ""
        assert len(journal.entries) == 2
    assert "boom" not in stream.getvalue()


@pytest.mark.message
def test_dry_run_marks_every_entry_and_reports_to_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    journal = RecordingJournal()
    reporter = Reporter("vllm.service", "pre", journal=journal, notifier=RecordingNotifier())
    reporter = reporter.as_dry_run()
    reporter.event(Event.HOLDER_FOUND, "would kill PID 5")
    reporter.event(Event.RUN_FINISHED, "dry run: would kill 1 process(es)")
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "gpugate pre vllm.service: would kill PID 5",
        "gpugate pre vllm.service: dry run: would kill 1 process(es)",
    ]
    assert err == ""
    assert [f["GPUGATE_DRY_RUN"] for _, f in journal.entries] == ["1", "1"]


def test_clear_status_sends_an_empty_status() -> None:
    reporter, _, notifier, _ = make()
    reporter.status("waiting")
    reporter.clear_status()
    assert notifier.states == ["STATUS=gpugate pre: waiting", "STATUS="]


@pytest.mark.message
def test_waiting_memory_event_at_once_then_every_10_s() -> None:
    reporter, journal, _, _ = make()
    now = [100.0]
    narrator = Narrator(reporter, clock=lambda: now[0])
    busy = [BusyGpu(Gpu(i, f"GPU-{i}", i, "x", 80000), mib, ()) for i, mib in ((3, 5000), (1, 700))]
    sent = []
    for step in range(31):  # 30 s of a wait, polled every second
        before = len(journal.events("waiting"))
        narrator.tell(MemoryWait(busy, 1024, 60 - step))
        sent.append(len(journal.events("waiting")) > before)
        now[0] += 1.0
    assert sent.count(True) == 4 and sent[0] and sent[10] and sent[20] and sent[30]
    entries = journal.events("waiting")
    assert len(entries) == 4
    first = entries[0]
    assert first["MESSAGE_ID"] == Event.WAITING.value
    assert first["GPUGATE_GPU"] == "1,3" and first["GPUGATE_USED_MIB"] == "5700"
    assert first["GPUGATE_WAITING_FOR"] == "memory" and first["GPUGATE_SECONDS_LEFT"] == "60"
    assert "GPU 1 700 MiB, GPU 3 5000 MiB used (free at 1024 MiB); 60 s left" in first["MESSAGE"]


@pytest.mark.message
def test_waiting_lock_event() -> None:
    reporter, journal, _, _ = make()
    Narrator(reporter).tell(LockWait(Gpu(2, "GPU-abc", 2, "x", 80000), 42.4))
    (entry,) = journal.events("waiting")
    assert entry["GPUGATE_WAITING_FOR"] == "lock" and entry["GPUGATE_GPU"] == "2"
    assert "lock of GPU 2 (GPU-abc); 42 s left" in entry["MESSAGE"]


def test_real_journal_send_gets_the_call_site_not_report_py(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    systemd_journal = pytest.importorskip("systemd.journal")
    sent: list[dict[str, str]] = []
    monkeypatch.setattr(
        systemd_journal, "sendv", lambda *args: sent.append(dict(a.split("=", 1) for a in args))
    )
    monkeypatch.setattr(os.path, "exists", lambda path: True)
    reporter = Reporter("vllm.service", "pre", notifier=RecordingNotifier(), echo=False)
    reporter.event(Event.RUN_STARTED, "x")
    (fields,) = sent
    assert fields["MESSAGE"] == "x" and fields["SYSLOG_IDENTIFIER"] == "gpugate"
    assert fields["CODE_FILE"] == __file__ and Path(fields["CODE_FILE"]).name != "report.py"
    assert (
        int(fields["CODE_LINE"]) > 0
        and fields["CODE_FUNC"] == "test_real_journal_send_gets_the_call_site_not_report_py"
    )


def test_a_failed_run_names_its_problem_by_code() -> None:
    """The error entry carries the code docs/journal.md names beside its words: what to match
    on (an unknown key in a config file: config-unknown-key)."""
    from gpugate.config.file import parse_config

    reporter, journal, notifier, _ = make()
    reporter.error_stream = io.StringIO()
    with pytest.raises(ConfigError) as raised:
        parse_config("frobnicate = 1\n", "/etc/gpugate/x.toml")
    Narrator(reporter).failed(raised.value)
    ((message, fields),) = journal.entries
    assert fields["GPUGATE_PROBLEM"] == "config-unknown-key"
    assert fields["GPUGATE_EXIT_CODE"] == "78"
    assert message == raised.value.message  # the raise site's one line, carried as it is
    assert notifier.states == [f"STATUS=gpugate pre: failed: {message}"]


@pytest.mark.message
def test_a_lease_refusal_names_each_holder_and_what_frees_them() -> None:
    conflicts = [([0, 1], "vllm.service (since 10:00)"), ([3], "tgi.service (since 11:00)")]
    unit = lease_refusal_text(conflicts)
    assert unit.startswith("GPU 0, 1 leased to vllm.service (since 10:00); GPU 3 leased to tgi")
    assert "that unit is still active or activating" in unit and "units' configs" in unit
    container = lease_refusal_text(conflicts[:1], containers=True)
    assert container.startswith("GPU 0, 1 leased to vllm.service (since 10:00): that container")
    assert "until it stops" in container and "still active" not in container


@pytest.mark.message
@pytest.mark.parametrize(
    ("terms", "hint"),
    [
        (  # it shares, this one does not: this one's setting
            {"theirs": (True,), "ours": "set share_gpus = true in /etc/gpugate/b.service.toml"},
            "it shares them on purpose (share_gpus = true): to run beside it, set share_gpus"
            " = true in /etc/gpugate/b.service.toml",
        ),
        (  # this one shares, it does not: its setting
            {"theirs": (False,), "ours": "set share_gpus = true in x", "sharing": True},
            "it does not share them (share_gpus = false): stop it first, or set share_gpus ="
            " true in its config too",
        ),
        (  # neither: both
            {"theirs": (False,), "ours": "start it with gpugate run --share-gpus"},
            "stop it first, or, to share them, start it with gpugate run --share-gpus and set"
            " share_gpus = true in its config too",
        ),
        (  # two containers: one config
            {"theirs": (False,), "ours": "set share_gpus = true in c.toml", "one_place": True},
            "stop it first, or set share_gpus = true in c.toml to share them",
        ),
    ],
)
def test_a_lease_refusal_names_the_setting_that_would_let_them_share(
    terms: dict[str, Any], hint: str
) -> None:
    text = lease_refusal_text([([1], "a.service (since 10:00)")], **terms)
    assert text.endswith("; " + hint)
    assert "kill_other_units" not in text


def test_every_kind_of_run_event_is_worded_in_the_one_table() -> None:
    """A RunEvent core can tell has its row in narrate.WORDS, and the table words nothing else:
    a kind added without its words fails here, not in the one run that meets it."""
    kinds = set(outcome.RunEvent.__subclasses__())
    assert len(kinds) >= 20
    assert set(WORDS) == kinds
