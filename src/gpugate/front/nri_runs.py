"""`gpugate nri`'s runs: a container's pre or post (front/container_hook.py's
`run_container_hook`, as `gpugate oci-hook` runs it), each in a child forked from the plugin.

So the plugin answers the runtime within NRI's bound however long a run takes: a pre is
waited for until the bound is nearly spent, then ended with SIGTERM (the run's own handler
stops it and gives its locks back) and the creation is refused for now; a post is not waited
for at all. A run's stderr (gpugate's one line) comes back through a pipe. The plugin itself
is one thread, so forking it is safe; NVML is opened in the child only."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from gpugate.config.file import LoadedConfig
from gpugate.errors import ExitCode
from gpugate.front.container_hook import run_container_hook
from gpugate.host.nvml import GpuDriver
from gpugate.host.oci import ContainerSpec, ContainerState
from gpugate.host.systemd import HostRoots
from gpugate.phase import Phase
from gpugate.report import lines
from gpugate.report.journal import (
    PRIORITY_ERR,
    FieldValue,
    Journal,
    Reporter,
    ReporterFactory,
)

MAX_SAID = 64 << 10  # of a run's stderr kept: its one line, and a warning or two
STOP_GRACE_S = 10.0  # a pre ended by SIGTERM gives its locks back within this, or is killed


class GateRun(NamedTuple):
    pid: int
    pidfd: int
    said: int  # the read end of its stderr
    container: str
    phase: Phase


class RunResult(NamedTuple):
    code: int  # the run's exit code
    line: str  # its last line on stderr, "" where it said nothing


class GateSetup(NamedTuple):
    """What every run of this plugin gets."""

    roots: HostRoots
    loaded: LoadedConfig | None
    driver_factory: Callable[[], GpuDriver]
    close_in_child: Sequence[int]  # the plugin's own descriptors (its NRI socket)
    reporter_factory: ReporterFactory = Reporter
    unit_state: Callable[[str], str | None] | None = None  # systemctl's, unless a test's


def start(setup: GateSetup, phase: Phase, state: ContainerState, spec: ContainerSpec) -> GateRun:
    read, write = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _child(setup, phase, state, spec, write)
    os.close(write)
    return GateRun(pid, os.pidfd_open(pid), read, state.id, phase)


def _child(
    setup: GateSetup, phase: Phase, state: ContainerState, spec: ContainerSpec, write: int
) -> None:
    code = int(ExitCode.INTERNAL)
    try:
        for fd in setup.close_in_child:
            with contextlib.suppress(OSError):
                os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until the run's own handler is set
        # Its stderr is the pipe: the run's lines (its Reporter's echo, as on a terminal: the
        # pipe is no journal stream) come back to the plugin, the last one for the runtime.
        os.dup2(write, 2)
        os.close(write)
        stream = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = stream
        first_error = FirstError()
        try:
            code = run_container_hook(
                phase,
                state,
                spec,
                roots=setup.roots,
                loaded=setup.loaded,
                driver_factory=setup.driver_factory,
                reporter_factory=first_error.watching(setup.reporter_factory),
                unit_state=setup.unit_state,
                stream=stream,
            )
            if code != ExitCode.OK and first_error.line:
                print(first_error.line, file=stream)  # the last line: the runtime's answer
        except Exception as exc:  # the plugin stays up; the run says what broke
            if os.environ.get("GPUGATE_DEBUG"):
                raise
            print(lines.internal_error_text(exc), file=stream)
    finally:
        for out in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                out.flush()
        os._exit(code)


class FirstError:
    """The run's first journal entry of error priority (a refusal, what survived, a timeout),
    as its stderr line: what the runtime is answered with where the run fails, rather than
    its summary."""

    def __init__(self) -> None:
        self.line = ""

    def watching(self, factory: ReporterFactory) -> ReporterFactory:
        def make(
            unit: str, phase: str, *, fields: Mapping[str, FieldValue] | None = None
        ) -> Reporter:
            reporter = factory(unit, phase, fields=fields)
            reporter.journal = _Tee(reporter.journal, self, reporter)
            return reporter

        return make


class _Tee:
    def __init__(self, journal: Journal, first: FirstError, reporter: Reporter) -> None:
        self.journal, self.first, self.reporter = journal, first, reporter

    def send(self, message: str, fields: dict[str, FieldValue]) -> None:
        self.journal.send(message, fields)
        priority = fields.get("PRIORITY")
        error = isinstance(priority, str) and priority.isdigit() and int(priority) <= PRIORITY_ERR
        if error and not self.first.line:
            shown = self.reporter.shown
            self.first.line = f"gpugate {self.reporter.phase} {shown}: {message}"


def wait(run: GateRun, deadline: float) -> RunResult | None:
    """The run's result once it exits, or None where it still runs at deadline
    (time.monotonic()); its stderr is read meanwhile."""
    said = bytearray()
    if not _wait(run, said, deadline):
        return None
    code = _reap(run)
    text = said.decode("utf-8", "replace").strip().splitlines()
    return RunResult(code, text[-1] if text else "")


class Ending(NamedTuple):
    run: GateRun
    kill_at: float | None  # SIGKILL then, where SIGTERM has not ended it (None: a post's)


def end(run: GateRun) -> Ending:
    """SIGTERM: the run stops and gives its locks back (front/hook.py's stopped_by_signals);
    `tend` kills it STOP_GRACE_S later where it has not."""
    signal.pidfd_send_signal(run.pidfd, signal.SIGTERM)
    return Ending(run, time.monotonic() + STOP_GRACE_S)


def tend(background: list[Ending]) -> list[tuple[GateRun, int]]:
    """Takes the runs that have exited out of background, with their exit codes; kills those
    past their kill_at."""
    done = []
    for ending in list(background):
        run = ending.run
        if select.select([run.pidfd], [], [], 0)[0]:
            _drain(run, bytearray())
            done.append((run, _reap(run)))
            background.remove(ending)
        elif ending.kill_at is not None and time.monotonic() > ending.kill_at:
            signal.pidfd_send_signal(run.pidfd, signal.SIGKILL)
    return done


def _wait(run: GateRun, said: bytearray, deadline: float) -> bool:
    """Reads its stderr until it exits (True) or deadline passes (False)."""
    watched = [run.pidfd, run.said]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready = select.select(watched, [], [], left)[0]
        if run.said in ready and _drain(run, said):
            watched.remove(run.said)  # its end: only the exit is left to come
        if run.pidfd in ready:
            _drain(run, said)
            return True


def _drain(run: GateRun, said: bytearray) -> bool:
    """Reads what the run wrote; True at the pipe's end."""
    os.set_blocking(run.said, False)
    try:
        while chunk := os.read(run.said, 65536):
            if len(said) < MAX_SAID:
                said += chunk[: MAX_SAID - len(said)]
    except BlockingIOError:
        return False
    return True


def _reap(run: GateRun) -> int:
    _, status = os.waitpid(run.pid, 0)
    os.close(run.pidfd)
    os.close(run.said)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else int(ExitCode.INTERNAL)
