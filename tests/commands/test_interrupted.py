"""A stopped start is a failed start (issue 18, item 3): `pre` sent SIGTERM (or SIGINT) while
it waits for a lock, for a holder's SIGTERM grace or for memory stops at once with exit 27,
leaves no lease and no lock, records why as a failed start does, and that start's `post` does
not wait again on the GPUs pre was still waiting for. The signal is sent by the test to its
own process (gpugate runs in it, through `main`) once the journal says the run is waiting:
a handshake, never a sleep. Every deadline is long (60 s): the run that was not stopped would
end with another code (75, 20, 21), so the exit code itself proves it stopped at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpugate.errors import ExitCode
from gpugate.front.cli import main
from gpugate.host.locks import gpu_locks
from gpugate.report.journal import Reporter
from tests.fakes import UNIT, FakeHost, RecordingJournal, RecordingNotifier, alive

INVOCATION = "5e1f0c0ffee0000000000000000000aa"
LONG_S = 60


@dataclass
class SignalWhen(RecordingJournal):
    """Records entries; when one matches, another thread sends `signum` to this process."""

    signum: int = signal.SIGTERM
    matches: Callable[[dict[str, str]], bool] = lambda fields: False
    sent: threading.Event = field(default_factory=threading.Event)
    _armed: threading.Event = field(default_factory=threading.Event)

    def send(self, message: str, fields: dict[str, str]) -> None:
        super().send(message, fields)
        if not self._armed.is_set() and self.matches(fields):
            self._armed.set()
            threading.Thread(target=self._fire, daemon=True).start()

    def _fire(self) -> None:
        os.kill(os.getpid(), self.signum)
        self.sent.set()


@pytest.fixture
def start_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's environment as systemd gives it: this start's INVOCATION_ID."""
    monkeypatch.setenv("INVOCATION_ID", INVOCATION)
    monkeypatch.setenv("SERVICE_RESULT", "exit-code")  # post: pre failed
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)


def write_config(host: FakeHost, **phase: Mapping[str, object]) -> Path:
    path = host.root / "gpugate.toml"
    lines = [f'lock_dir = "{host.root / "locks"}"', "gpus = [0, 1]"]
    for name, values in phase.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {value}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def gpugate(host: FakeHost, journal: RecordingJournal, *argv: str) -> int:
    def reporter(unit: str, phase: str, *, fields: Mapping[str, str] | None = None) -> Reporter:
        return Reporter(
            unit, phase, journal=journal, notifier=RecordingNotifier(), echo=False, fields=fields
        )

    return main(
        list(argv),
        driver_factory=lambda: host.memory,
        reporter_factory=reporter,
        roots=host.roots,
        unit_state=lambda unit: "inactive",  # the manual-run guard lets it run
    )


def failed_record(host: FakeHost) -> dict[str, object]:
    data: dict[str, object] = json.loads(
        (host.root / "locks" / "failed" / f"{UNIT}.json").read_text()
    )
    return data


def assert_left_nothing(host: FakeHost) -> None:
    assert not (host.root / "locks" / "leases" / f"{UNIT}.json").exists()
    # every GPU lock is free: taking them does not wait
    with gpu_locks(host.root / "locks", host.memory.gpus()[:2], time.monotonic()):
        pass


def error_entry(journal: RecordingJournal) -> dict[str, str]:
    (entry,) = [e for e in journal.events("error") if e.get("GPUGATE_EXIT_CODE") == "27"]
    return entry


@pytest.mark.usefixtures("start_env")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopped_during_the_memory_wait(host: FakeHost, signum: int) -> None:
    host.memory.leaked_mib[0] = 50000  # freed by nobody: pre waits for it
    config = write_config(host, pre={"wait_timeout_s": LONG_S}, post={"wait_timeout_s": LONG_S})
    journal = SignalWhen(signum=signum, matches=lambda f: f.get("GPUGATE_WAITING_FOR") == "memory")
    code = gpugate(host, journal, "pre", UNIT, "--config", str(config))
    assert journal.sent.wait(10)
    assert code == ExitCode.INTERRUPTED
    name = signal.Signals(signum).name
    error_entry(journal)  # its one error entry, exit 27 (INTERRUPTED)
    assert not journal.events("run_finished"), "it stopped: no summary of a run that went on"
    assert_left_nothing(host)
    record = failed_record(host)
    assert record["exit_code"] == 27 and record["invocation_id"] == INVOCATION
    assert record["busy_uuids"] == [host.memory.gpus()[0].uuid]

    # That start's post: nothing to kill, and it does not wait again on GPU 0's memory.
    post = RecordingJournal()
    assert gpugate(host, post, "post", UNIT, "--config", str(config)) == ExitCode.OK
    assert [e.get("GPUGATE_REASON") for e in post.events("timeout")] == ["failed-start"]
    (last,) = [e for e in post.events("error") if e.get("GPUGATE_REASON") == "failed-start"]
    assert last["GPUGATE_FAILED_START"], name  # the pre's error, recorded for its post


@pytest.mark.usefixtures("start_env")
def test_stopped_during_the_kill_grace(host: FakeHost) -> None:
    (stubborn,) = host.pool.holder(host.gpu_files(1), ignore_term=True)
    host.put_in_unit(stubborn)
    host.memory.claim(stubborn, {1}, 30000)
    grace = {"wait_timeout_s": LONG_S, "sigterm_grace_s": 40, "sigkill_wait_s": 5}
    config = write_config(host, pre=grace, post={**grace, "kill_orphans": "false"})
    journal = SignalWhen(matches=lambda f: f.get("GPUGATE_SIGNAL") == "SIGTERM")
    code = gpugate(host, journal, "pre", UNIT, "--config", str(config))
    assert code == ExitCode.INTERRUPTED
    error_entry(journal)  # its one error entry, exit 27 (INTERRUPTED)
    assert alive(stubborn), "stopped at once: no SIGKILL after the grace"
    assert_left_nothing(host)
    assert failed_record(host)["busy_uuids"] == [host.memory.gpus()[1].uuid]

    # post kills what is in the unit's cgroup all the same
    post_config = write_config(
        host, post={"wait_timeout_s": 10, "sigterm_grace_s": 1, "sigkill_wait_s": 1}
    )
    assert gpugate(host, RecordingJournal(), "post", UNIT, "--config", str(post_config)) == 0
    assert not alive(stubborn)


def _hold_lock(host: FakeHost) -> Iterator[subprocess.Popen[str]]:
    gpus = [(g.index, g.uuid) for g in host.memory.gpus()[:2]]
    code = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from gpugate.host.locks import gpu_locks
        from gpugate.host.nvml import Gpu
        gpus = [Gpu(i, u, i, "g", 1) for i, u in {gpus!r}]
        with gpu_locks(Path({str(host.root / "locks")!r}), gpus, time.monotonic() + 5):
            print("locked", flush=True)
            time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("start_env")
def test_stopped_while_waiting_for_another_runs_lock(host: FakeHost) -> None:
    host.memory.leaked_mib[1] = 40000
    config = write_config(host, pre={"wait_timeout_s": LONG_S})
    journal = SignalWhen(matches=lambda f: f.get("GPUGATE_WAITING_FOR") == "lock")
    holder = _hold_lock(host)
    next(holder)
    try:
        code = gpugate(host, journal, "pre", UNIT, "--config", str(config))
    finally:
        holder.close()
    assert code == ExitCode.INTERRUPTED
    error_entry(journal)  # its one error entry, exit 27 (INTERRUPTED)
    assert_left_nothing(host)
    # not yet waiting for memory, but GPU 1 was busy when it looked: post need not wait on it
    assert failed_record(host)["busy_uuids"] == [host.memory.gpus()[1].uuid]


@pytest.mark.usefixtures("start_env")
def test_post_stopped_during_its_wait_ends_at_once_and_drops_the_lease(host: FakeHost) -> None:
    leases = host.root / "locks" / "leases"
    leases.mkdir(parents=True)
    (leases / f"{UNIT}.json").write_text(
        json.dumps({"unit": UNIT, "gpus": [0, 1], "uuids": [], "share": False})
    )
    host.memory.leaked_mib[0] = 50000
    config = write_config(host, post={"wait_timeout_s": LONG_S})
    journal = SignalWhen(matches=lambda f: f.get("GPUGATE_WAITING_FOR") == "memory")
    code = gpugate(host, journal, "post", UNIT, "--config", str(config))
    assert code == ExitCode.INTERRUPTED
    assert error_entry(journal)["GPUGATE_PHASE"] == "post"
    assert not (leases / f"{UNIT}.json").exists()
