"""A hook sent SIGTERM (`systemctl stop` during a start, a stop job's timeout) or SIGINT
(Ctrl-C) stops at once: the signal becomes an `Interrupted` exception in the main thread.

Every wait of a run is a sleep, a poll or a lock wait with a timeout in the main thread, and
Python retries none of them when a handler raises (PEP 475), so the exception ends whichever
wait is under way; the `finally` blocks then close the GPU locks, and the run records why. A
second signal while it does so is ignored, so that the cleanup runs to its end (systemd's
SIGKILL after TimeoutStopSec= still ends it).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from gpugate.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise Interrupted (once); outside, as before."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    fired: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        name = signal.Signals(signum).name
        raise Interrupted(f"stopped by {name}", name)

    previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
