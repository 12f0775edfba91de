"""Calls into a library that may never return (a hung GPU driver), made on one worker thread
and waited for with a deadline.

ctypes releases the GIL for the call, so the main thread keeps running: it waits on an Event
with a timeout (a wait a signal handler's exception interrupts) and gives up at the deadline.
The call itself cannot be cancelled: the thread is a daemon, so the process can still exit,
and once a call has hung the caller must make no further call (they would queue behind it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class CallTimedOut(Exception):
    """The call did not return by its deadline; it may still be running."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"no answer after {waited_s:.1f} s")
        self.waited_s = waited_s


@dataclass
class _Request:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class CallThread:
    """One daemon thread that makes the calls, in order."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: _Request | None = None

    @property
    def busy(self) -> bool:
        """A call has not returned (it hung, or its caller was interrupted waiting for it)."""
        return self._last is not None and not self._last.done.is_set()

    def call(self, until: float, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """function(*args, **kwargs) on the thread; its value or exception, or CallTimedOut
        once `until` (on this clock) passes without an answer."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        request = _Request(function, args, kwargs)
        self._last = request
        started = self._clock()
        self._requests.put(request)
        if not request.done.wait(max(until - started, 0.0)):
            raise CallTimedOut(self._clock() - started)
        if request.error is not None:
            raise request.error
        return request.value

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            try:
                request.value = request.function(*request.args, **request.kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as it is
                request.error = exc
            request.done.set()
