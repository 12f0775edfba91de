from __future__ import annotations

import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from gpugate.core.kill import pin, terminate
from gpugate.host.scan import ProcessId, ProcFs
from tests.fakes import alive, start_time_of

Sleeper = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def sleeper() -> Iterator[Sleeper]:
    """Starts sleeping children; each is registered at spawn and killed after the test, also
    when an assertion fails first (only these, pinned by start time)."""
    started: list[tuple[subprocess.Popen[bytes], int]] = []

    def spawn(*extra: str) -> subprocess.Popen[bytes]:
        # The child says it is ready on its stdout once its signal handlers are set.
        ready = "import sys\nsys.stdout.write('r')\nsys.stdout.flush()\n"
        code = "import signal, time\n" + "\n".join(extra) + "\n" + ready + "time.sleep(3600)"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        started.append((proc, start_time_of(proc.pid)))
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 30)
        assert readable and proc.stdout.read(1) == b"r", "the child did not get ready"
        return proc

    yield spawn
    for proc, start in started:
        if proc.poll() is None and alive(proc.pid, start):
            proc.kill()
        proc.wait(timeout=10)


def test_recycled_pid_is_never_signalled(sleeper: Sleeper) -> None:
    proc = sleeper()
    try:
        real = ProcessId(proc.pid, start_time_of(proc.pid))
        # What discovery saw was an earlier process with this PID (another start time).
        stale = ProcessId(proc.pid, real.start_time - 1)
        assert pin(stale, ProcFs()) is None
        result = terminate([stale], grace_s=0.2, deadline=time.monotonic() + 2, procfs=ProcFs())
        assert not (result.terminated or result.killed or result.survivors)
        assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_stopped_process_gets_sigcont_and_ends_on_sigterm(sleeper: Sleeper) -> None:
    proc = sleeper()
    proc.send_signal(signal.SIGSTOP)
    ident = ProcessId(proc.pid, start_time_of(proc.pid))
    result = terminate([ident], grace_s=5, deadline=time.monotonic() + 10, procfs=ProcFs())
    assert result.terminated == [ident]
    assert proc.wait(5) == -signal.SIGTERM


def test_sigterm_ignored_escalates_to_sigkill(sleeper: Sleeper) -> None:
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


def test_all_targets_signalled_before_waiting(sleeper: Sleeper) -> None:
    procs = [sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)") for _ in range(3)]
    idents = [ProcessId(p.pid, start_time_of(p.pid)) for p in procs]
    sent: list[tuple[ProcessId, int]] = []
    result = terminate(
        idents,
        grace_s=0.5,
        deadline=time.monotonic() + 10,
        procfs=ProcFs(),
        on_signal=lambda ident, signum: sent.append((ident, signum)),
    )
    # one grace for all of them, not one each: every SIGTERM before the first SIGKILL
    signals = [signum for _, signum in sent]
    assert signals == [signal.SIGTERM] * 3 + [signal.SIGKILL] * 3
    assert {ident for ident, _ in sent[:3]} == set(idents)
    assert sorted(result.killed) == sorted(idents)
    for proc in procs:
        proc.wait(5)


REUSE_SCRIPT = """
import os, signal, sys, time
from gpugate.core.kill import pin, terminate
from gpugate.host.scan import ProcessId, ProcFs

def start_sleeper() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    return pid

def after_tick(start_time: int) -> None:
    # Until the clock /proc/PID/stat's start times count in (ticks of boot time) has passed
    # start_time: a process started now has a later one. A bounded spin of at most a tick.
    deadline = time.monotonic() + 5
    ticks = os.sysconf("SC_CLK_TCK")
    while int(time.clock_gettime(time.CLOCK_BOOTTIME) * ticks) <= start_time:
        assert time.monotonic() < deadline, "the clock did not tick"

def reuse(pid: int) -> int:
    # Make the kernel hand out exactly this PID again (this namespace is ours alone).
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    new = start_sleeper()
    assert new == pid, (new, pid)
    return new

procfs = ProcFs()
# 1. Reused between discovery and the first signal: pinning sees another start time.
old = start_sleeper()
seen = procfs.stat(old).ident
os.kill(old, signal.SIGKILL); os.waitpid(old, 0)
after_tick(seen.start_time)  # the new process's start time differs
new = reuse(old)
result = terminate([seen], grace_s=0.2, deadline=time.monotonic() + 2, procfs=ProcFs())
assert not (result.terminated or result.killed or result.survivors), result
assert os.waitpid(new, os.WNOHANG) == (0, 0), "the new process with the old PID was signalled"
os.kill(new, signal.SIGKILL); os.waitpid(new, 0)
# 2. Reused after pinning: the pidfd still names the dead process, so the signal goes nowhere.
old = start_sleeper()
pinned = pin(ProcFs().stat(old).ident, ProcFs())
os.kill(old, signal.SIGKILL); os.waitpid(old, 0)
new = reuse(old)
assert pinned.send(signal.SIGKILL) is False
assert os.waitpid(new, os.WNOHANG) == (0, 0), "the new process with the old PID was signalled"
os.kill(new, signal.SIGKILL); os.waitpid(new, 0)
print("ok")
"""


@pytest.mark.root("a private PID namespace")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_real_pid_reuse_is_never_signalled() -> None:
    # In a private PID namespace with its own /proc, a dead target's PID is handed to a new
    # process on purpose (ns_last_pid), before and after gpugate pinned the target.
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REUSE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
