from __future__ import annotations

import io
from pathlib import Path

import pytest

from gpugate.errors import UnknownUnit
from gpugate.host.systemd import own_unit, unit_of_cgroup, validate_unit_name
from gpugate.report.journal import Event, Reporter
from tests.fakes import RecordingJournal, RecordingNotifier


@pytest.mark.parametrize(
    "name", ["vllm.service", "vllm@0.service", r"vllm@a\x2db.service", "run-u12.scope"]
)
def test_valid_unit_names(name: str) -> None:
    assert validate_unit_name(name) == name


@pytest.mark.parametrize(
    "name", ["vllm", "vllm@.service", "a b.service", "x.timer", "../etc.service", "@.service", ""]
)
def test_invalid_unit_names(name: str) -> None:
    with pytest.raises(UnknownUnit):
        validate_unit_name(name)


def test_unit_of_cgroup() -> None:
    assert unit_of_cgroup("/system.slice/vllm.service") == "vllm.service"
    assert unit_of_cgroup("/system.slice/system-vllm.slice/vllm@a.service") == "vllm@a.service"
    assert unit_of_cgroup("/user.slice/user-0.slice/session-3.scope") == "session-3.scope"
    assert unit_of_cgroup("/") is None


def test_own_unit_reads_proc_self_cgroup(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/system.slice/vllm.service\n")
    assert own_unit(tmp_path) == "vllm.service"
    (tmp_path / "self" / "cgroup").write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    assert own_unit(tmp_path) is None


@pytest.mark.message
def test_reporter_fields_and_channels() -> None:
    journal, notifier, stream = RecordingJournal(), RecordingNotifier(), io.StringIO()
    reporter = Reporter(
        "vllm.service", "pre", journal=journal, notifier=notifier, stream=stream, echo=True
    )
    reporter.event(
        Event.SIGNAL_SENT, "SIGTERM to PID 5", pid=5, gpus=[3, 1], used_mib=7, signal="SIGTERM"
    )
    reporter.status("waiting")
    reporter.extend_timeout(2.5)
    ((message, fields),) = journal.entries
    assert message == "SIGTERM to PID 5"
    assert fields["MESSAGE_ID"] == Event.SIGNAL_SENT.value
    assert fields["GPUGATE_UNIT"] == "vllm.service"
    assert fields["GPUGATE_PHASE"] == "pre"
    assert fields["GPUGATE_PID"] == "5"
    assert fields["GPUGATE_GPU"] == "1,3"
    assert fields["GPUGATE_USED_MIB"] == "7"
    assert fields["GPUGATE_SIGNAL"] == "SIGTERM"
    assert stream.getvalue() == "gpugate pre vllm.service: SIGTERM to PID 5\n"
    assert notifier.states == ["STATUS=gpugate pre: waiting", "EXTEND_TIMEOUT_USEC=2500000"]


def test_message_ids_are_distinct_128_bit() -> None:
    ids = [event.value for event in Event]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
