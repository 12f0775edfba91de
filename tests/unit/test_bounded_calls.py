"""The worker thread NVML calls are made on: an answer, the callee's own exception, or
CallTimedOut at the deadline while the call goes on; a call that never returns does not keep
the process from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpugate.errors import CallTimedOut
from gpugate.host.nvml import CallThread


def test_answers_and_exceptions_come_back_as_they_are() -> None:
    thread = CallThread("test")
    assert thread.call(time.monotonic() + 5, lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="gone"):
        thread.call(time.monotonic() + 5, {}.__getitem__, "gone")
    assert not thread.busy


def test_a_call_that_does_not_return_times_out_and_the_thread_stays_busy() -> None:
    thread = CallThread("test")
    release = threading.Event()
    with pytest.raises(CallTimedOut):
        thread.call(time.monotonic() + 0.2, release.wait)
    assert thread.busy, "the hung call still runs: nothing may be queued behind it"
    release.set()


def test_the_process_exits_while_a_call_hangs() -> None:
    code = textwrap.dedent(
        """
        import threading, time
        from gpugate.host.nvml import CallThread, CallTimedOut
        try:
            CallThread("test").call(time.monotonic() + 0.1, threading.Event().wait)
        except CallTimedOut:
            raise SystemExit(7)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 7, done.stderr  # CallTimedOut, the hung thread left behind
