from __future__ import annotations

import signal
import subprocess
import sys
import time

from gpugate.kill import pin, terminate
from gpugate.procfs import ProcessId, ProcFs
from tests.fakes import alive, start_time_of


def sleeper(*extra: str) -> subprocess.Popen[bytes]:
    code = "import signal, time\n" + "\n".join(extra) + "\ntime.sleep(3600)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)
    return proc


def test_recycled_pid_is_never_signalled() -> None:
    proc = sleeper()
    try:
        real = ProcessId(proc.pid, start_time_of(proc.pid))
        # What discovery saw was an earlier process with this PID (another start time).
        stale = ProcessId(proc.pid, real.start_time - 1)
        assert pin(stale, ProcFs()) is None
        result = terminate([stale], grace_s=0.2, deadline=time.monotonic() + 2, procfs=ProcFs())
        assert result.gone_before == [stale]
        assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_stopped_process_gets_sigcont_and_ends_on_sigterm() -> None:
    proc = sleeper()
    proc.send_signal(signal.SIGSTOP)
    ident = ProcessId(proc.pid, start_time_of(proc.pid))
    result = terminate([ident], grace_s=5, deadline=time.monotonic() + 10, procfs=ProcFs())
    assert result.terminated == [ident]
    assert proc.wait(5) == -signal.SIGTERM


def test_sigterm_ignored_escalates_to_sigkill() -> None:
    proc = sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    ident = ProcessId(proc.pid, start_time_of(proc.pid))
    sent: list[int] = []
    result = terminate(
        [ident],
        grace_s=0.3,
        deadline=time.monotonic() + 10,
        procfs=ProcFs(),
        on_signal=lambda i, s: sent.append(s),
    )
    assert result.killed == [ident]
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    assert proc.wait(5) == -signal.SIGKILL


def test_all_targets_signalled_before_waiting() -> None:
    procs = [sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)") for _ in range(3)]
    idents = [ProcessId(p.pid, start_time_of(p.pid)) for p in procs]
    started = time.monotonic()
    result = terminate(idents, grace_s=0.5, deadline=time.monotonic() + 10, procfs=ProcFs())
    # one grace for all of them, not one each
    assert time.monotonic() - started < 1.4
    assert sorted(result.killed) == sorted(idents)
    for proc in procs:
        proc.wait(5)
