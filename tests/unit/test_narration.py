"""What a run says, beyond what it does: dry runs in "would" words on stdout ending in a
summary line, STATUS= cleared after success, and the `waiting` event for lock and memory
waits."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, LockTimeout
from gpugate.report.journal import Event, Reporter
from tests.fakes import FakeHost, alive


def dry_reporter(host: FakeHost, phase: str = "pre") -> Reporter:
    return Reporter("vllm.service", phase, journal=host.journal, notifier=host.notifier)


@pytest.mark.message
@pytest.mark.parametrize("holders", [0, 1, 3])
def test_dry_run_marks_every_entry_says_would_and_ends_in_a_summary_on_stdout(
    host: FakeHost, holders: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pids = [pid for i in range(holders) for pid in host.pool.holder(host.gpu_files(i))]
    for pid in pids:
        host.memory.claim(pid, {pids.index(pid)}, 1000)
    summary = host.run_phase(
        "pre",
        host.config(),
        dry_reporter(host),
        dry_run=True,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.OK
    assert all(alive(pid) for pid in pids)
    entries = host.journal.entries
    assert entries and all(fields["GPUGATE_DRY_RUN"] == "1" for _, fields in entries)
    found = host.journal.events("holder_found")
    assert len(found) == holders and all(e["MESSAGE"].startswith("would kill") for e in found)
    last_message, last = entries[-1]
    assert last["GPUGATE_EVENT"] == "run_finished" and last["GPUGATE_RESULT"] == "success"
    assert last_message == (
        f"dry run: would kill {holders} process(es); the run would succeed; nothing was killed"
    )
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == f"gpugate pre vllm.service: {last_message}"
    assert out.count("gpugate pre vllm.service: ") == len(entries) and err == ""
    assert not host.journal.events("signal_sent")


def test_dry_run_that_would_be_refused_says_so(host: FakeHost) -> None:
    (orphan,) = host.pool.holder(host.gpu_files(0))  # post may not kill an orphan
    host.memory.claim(orphan, {0}, 1000)
    summary = host.run_phase(
        "post",
        host.config(),
        dry_reporter(host, "post"),
        dry_run=True,
        driver_factory=lambda: host.memory,
    )
    assert summary.exit_code is ExitCode.HELD_BY_OTHERS
    assert alive(orphan)
    (refused,) = host.journal.events("refused")
    assert (refused["GPUGATE_PID"], refused["GPUGATE_DRY_RUN"]) == (str(orphan), "1")
    (finished,) = host.journal.events("run_finished")
    assert (finished["GPUGATE_RESULT"], finished["GPUGATE_DRY_RUN"]) == ("held_by_others", "1")


def test_status_is_cleared_after_success_and_kept_after_failure(host: FakeHost) -> None:
    (worker,) = host.pool.holder(host.gpu_files(1))
    host.memory.claim(worker, {1}, 1000)
    ok = host.run_phase("pre", host.config(), host.reporter(), driver_factory=lambda: host.memory)
    assert ok.exit_code is ExitCode.OK
    assert host.notifier.states[-1] == "STATUS="
    host.memory.leaked_mib[2] = 5000
    failed = host.run_phase(
        "pre",
        host.config(pre={"wait_timeout_s": 0.3}),
        host.reporter(),
        driver_factory=lambda: host.memory,
    )
    assert failed.exit_code is ExitCode.MEMORY_TIMEOUT
    kept = host.notifier.states[-1]
    assert kept != "STATUS=" and kept.endswith(f": {failed.exit_code.name.lower()}")


def test_memory_wait_sends_the_waiting_event_with_gpus_mib_and_time_left(
    host: FakeHost,
) -> None:
    host.memory.leaked_mib[3] = 7000
    host.memory.leaked_mib[5] = 2000
    host.run_phase(
        "pre",
        host.config(pre={"wait_timeout_s": 0.5}),
        host.reporter(),
        driver_factory=lambda: host.memory,
    )
    waiting = host.journal.events("waiting")
    assert waiting, "no waiting event during a memory wait"
    first = waiting[0]
    assert first["MESSAGE_ID"] == Event.WAITING.value
    assert first["GPUGATE_WAITING_FOR"] == "memory"
    assert first["GPUGATE_GPU"] == "3,5" and first["GPUGATE_USED_MIB"] == "9000"
    assert int(first["GPUGATE_SECONDS_LEFT"]) >= 0


def test_lock_wait_sends_the_waiting_event(host: FakeHost, tmp_path: Path) -> None:
    config = host.config(pre={"wait_timeout_s": 0.4})
    gpu = host.memory.gpus()[0]
    lock_dir = config.config.lock_dir
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"{gpu.uuid}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another gpugate run holds GPU 0
        with pytest.raises(LockTimeout):
            host.run_phase(
                "pre",
                host.config(gpus=[0], pre={"wait_timeout_s": 0.4}),
                host.reporter(),
                driver_factory=lambda: host.memory,
            )
    finally:
        os.close(fd)
    (waiting,) = host.journal.events("waiting")
    assert waiting["GPUGATE_WAITING_FOR"] == "lock" and waiting["GPUGATE_GPU"] == "0"
    assert waiting["MESSAGE_ID"] == Event.WAITING.value
