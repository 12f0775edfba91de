"""One hook run, the same for a unit's, a Slurm job's, an OCI hook's and the sweep's reap:
locate the cgroup, run the phase, say a failure once, record the metrics."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

from gpugate.config.file import LoadedConfig
from gpugate.core.discover import cgroup_members
from gpugate.core.outcome import RunSummary, Surroundings
from gpugate.core.run import TIMEOUT_MARGIN_S, PhaseRun, RunDeps, RunScope
from gpugate.errors import GateError
from gpugate.host.locks import check_all
from gpugate.host.shm import find_areas, host_root
from gpugate.integrations.records import workload_words
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.report.narrate import Narrator, interrupted


@dataclass(frozen=True)
class Hook:
    """Built once by the command and passed whole: what the run is about, how its
    surroundings are made, what it reaches the host through."""

    phase: Phase
    unit: str  # the unit, or the label standing for it (slurm-job-42)
    locate_cgroup: Callable[[], str]  # the cgroup whose processes all die
    # a unit's, a Slurm job's, or none (NullSurroundings)
    surroundings: Callable[[RunScope, LoadedConfig, Reporter], Surroundings]
    reporter: Reporter  # the run's; a dry run uses its as_dry_run() twin
    run: RunDeps = field(default_factory=RunDeps)  # the host: roots, driver, pinner, clock
    metrics_unit: str | None = None  # the metrics' unit label ("slurm"); None: no record
    dry_run: bool = False
    for_uid: int | None = None  # the hidden --for-uid: kill only this account's processes
    stream: TextIO = field(default_factory=lambda: sys.stderr)  # errors, metrics warnings

    @functools.cached_property
    def run_reporter(self) -> Reporter:
        """The one the run and its failure share (a dry run's twin, made once: its echo, off
        after a closed pipe, stays off)."""
        dry = self.dry_run and not self.reporter.dry_run
        return self.reporter.as_dry_run() if dry else self.reporter

    def narrator(self) -> Narrator:
        return Narrator(self.run_reporter)


def run_hook(hook: Hook, loaded: LoadedConfig) -> RunSummary | GateError:
    """The run's summary, or the error that ended it (said once, on stderr too)."""
    result: RunSummary | GateError
    try:
        result = run_phase(hook, loaded)
    except GateError as exc:
        result = exc
        hook.narrator().failed(exc, hook.stream)
    textfile = loaded.config.metrics_textfile
    if hook.metrics_unit and not hook.dry_run and textfile is not None:
        from gpugate.integrations.metrics import record_after_run, run_record  # noqa: PLC0415

        summary = result if isinstance(result, RunSummary) else None
        record = run_record(hook.phase.value, hook.metrics_unit, result.exit_code, summary)
        failed = hook.narrator().metrics_not_written  # a failure to record: a warning at most
        record_after_run(textfile, record, stream=hook.stream, on_failure=failed)
    return result


def run_phase(hook: Hook, loaded: LoadedConfig) -> RunSummary:
    """The phase run, state folders checked first: a start that cannot record its lease fails."""
    scope = RunScope(hook.phase, hook.unit, hook.locate_cgroup(), hook.for_uid)
    narrator = hook.narrator()
    narrator.workloads = workload_words(loaded.config.lock_dir)
    reporter = narrator.reporter
    # First thing: the unit's own TimeoutStartSec=/TimeoutStopSec= may be shorter than this
    # run's deadline; systemd 247 to 257 honour EXTEND_TIMEOUT_USEC= in start-pre and stop-post.
    narrator.extend_timeout(loaded.config.policy(scope.phase).wait_timeout_s + TIMEOUT_MARGIN_S)
    surroundings = hook.surroundings(scope, loaded, reporter)
    if not hook.dry_run:
        required = scope.phase.traits.state_required
        warn = None if required else narrator.state_unwritable  # after a stop: it goes on
        check_all(*surroundings.state_to_write(), on_unwritable=warn)
    narrator.looking()
    roots, traits = hook.run.roots, scope.phase.traits
    # After a stop (read before post kills what is left of the unit), say what the unit's own
    # /dev/shm held. systemd gives the hook a fresh tmpfs of its own there (not PID 1's) where
    # the unit has one: that is how it tells.
    after_stop = traits.systemd and traits.releases_lease and not hook.dry_run
    if after_stop and host_root(roots.dev, roots.proc) is not None:
        from gpugate.host.shm import is_own_tmpfs, own_shm_of_any  # noqa: PLC0415 (post's)
        from gpugate.report.lines import say_own_shm_gone  # noqa: PLC0415

        devs = {area.dev for area in find_areas(roots.dev, roots.proc)}
        if is_own_tmpfs(str(roots.dev / "shm"), devs):
            try:
                pids = set(cgroup_members(roots.cgroup, scope.unit_cgroup)) - {os.getpid()}
            except GateError:
                pids = set()
            say_own_shm_gone(reporter, own_shm_of_any(roots.proc, pids, devs))
    run = PhaseRun(scope, narrator, surroundings, hook.run, dry_run=hook.dry_run)
    return run.run()  # an error is told to the surroundings first (core/run.py)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise Interrupted in the main thread (every wait
    there is a timed sleep, poll or lock wait, PEP 475); a second signal is ignored so that the
    cleanup runs to its end."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    fired: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        name = signal.Signals(signum).name
        raise interrupted(name)

    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, on_signal) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
