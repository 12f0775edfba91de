"""What the commands share, below them: `HostAccess`, what a command may touch; one hook run, the
same for a unit's, a Slurm job's, an OCI hook's and the sweep's reap (locate the cgroup, run the
phase, say a failure once, record the metrics); `collect`, the one discovery of `status`, the
sweep and `gpugate run`'s check; a Slurm node's drain; a uid as sudo writes it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from gpugate.config.file import LoadedConfig
from gpugate.config.values import GpuSelection
from gpugate.core.discover import Discovery, DiscoveryQuery, as_refs, cgroup_members, discover
from gpugate.core.outcome import RunSummary, Workload, interrupted
from gpugate.core.run import TIMEOUT_MARGIN_S, PhaseRun, RunScope
from gpugate.errors import GateError
from gpugate.host.locks import check_all
from gpugate.host.logind import SESSIONS_DIR
from gpugate.host.nvml import Gpu, GpuDriver, NvmlDriver
from gpugate.host.safe_files import find_program, run_program
from gpugate.host.scan import NO_DEADLINE, Deadline, ProcFs, WatchScan
from gpugate.host.shm import find_areas, host_root
from gpugate.host.systemd import (
    CgroupLayout,
    HostRoots,
    active_state,
    host_cgroup_layout,
    on_units_tree,
    resolve_unit_cgroup,
)
from gpugate.integrations.records import workload_words
from gpugate.integrations.unit import choose_gpus, with_chosen_gpus
from gpugate.report.journal import Reporter, ReporterFactory
from gpugate.report.narrate import Narrator

UID_TEXT = re.compile(r"(?:0|[1-9][0-9]{0,9})")
NO_UID = 2**32 - 1  # (uid_t)-1: "no uid" to the kernel, never an account
STATUS_SCAN_S = 10.0  # status's pass over /proc, at most (processes with millions of fds)
NO_UNIT_CGROUP = "/gpugate-status-no-unit"
SCONTROL_TIMEOUT_S = 15
SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what stopped_by_signals turns into Interrupted


class HostAccess:
    """Everything a command reaches the host through: NVML, the journal, the host's roots
    (/proc, /dev, the cgroup tree), systemd's answers, the environment and logind's state."""

    def __init__(
        self,
        *,
        driver_factory: Callable[[], GpuDriver] | None = None,
        reporter_factory: ReporterFactory | None = None,
        roots: HostRoots | None = None,
        unit_state: Callable[[str], str | None] | None = None,
        cgroup_layout: Callable[[HostRoots], CgroupLayout | None] | None = None,
    ) -> None:
        self.driver_factory: Callable[[], GpuDriver] = driver_factory or NvmlDriver
        self.reporter_factory: ReporterFactory = reporter_factory or Reporter
        self.environ: Mapping[str, str] = os.environ
        self.device_stat: Callable[[str], os.stat_result] = os.stat  # gres.conf's File= (slurm)
        self.given_roots = roots or HostRoots()
        self.unit_state = unit_state or active_state
        self.cgroup_layout = cgroup_layout or host_cgroup_layout
        self.sessions_dir: Path = SESSIONS_DIR  # logind's state files (the sweep's owners)

    def host_roots(self) -> HostRoots:
        """The roots on the cgroup tree systemd tracks units in; HostUnsupported on v1 only."""
        return on_units_tree(self.given_roots, self.cgroup_layout)


class Hook:
    """Built once by the command and passed whole: what the run is about and what it reaches
    the host through (scope), how its surroundings are made, where it is told."""

    __slots__ = ("metrics_unit", "reporter", "scope", "stream", "surroundings")

    def __init__(
        self,
        scope: RunScope,
        # a unit's, a Slurm job's, or none (PlainWorkload)
        surroundings: Callable[[RunScope, LoadedConfig, Reporter], Workload],
        reporter: Reporter,  # the run's; a dry run uses its as_dry_run() twin
        metrics_unit: str | None = None,  # the metrics' unit label ("slurm"); None: no record
        stream: TextIO | None = None,  # errors, metrics warnings; None: sys.stderr when made
    ) -> None:
        self.scope, self.surroundings, self.metrics_unit = scope, surroundings, metrics_unit
        # The one reporter the run and its failure share: a dry run's twin made once, so that
        # its echo, off after a closed pipe, stays off.
        dry = scope.dry_run and not reporter.dry_run
        self.reporter = reporter.as_dry_run() if dry else reporter
        self.stream: TextIO = sys.stderr if stream is None else stream

    def narrator(self) -> Narrator:
        return Narrator(self.reporter)


def run_hook(hook: Hook, loaded: LoadedConfig) -> RunSummary | GateError:
    """The run's summary, or the error that ended it (said once, on stderr too)."""
    result: RunSummary | GateError
    try:
        result = run_phase(hook, loaded)
    except GateError as exc:
        result = exc
        hook.narrator().failed(exc, hook.stream)
    textfile = loaded.config.metrics_textfile
    if hook.metrics_unit and not hook.scope.dry_run and textfile is not None:
        from gpugate.integrations.metrics import record_after_run, run_record  # noqa: PLC0415

        summary = result if isinstance(result, RunSummary) else None
        record = run_record(hook.scope.phase.value, hook.metrics_unit, result.exit_code, summary)
        failed = hook.narrator().metrics_not_written  # a failure to record: a warning at most
        record_after_run(textfile, record, stream=hook.stream, on_failure=failed)
    return result


def run_phase(hook: Hook, loaded: LoadedConfig) -> RunSummary:
    """The phase run, state folders checked first: a start that cannot record its lease fails."""
    scope = hook.scope
    cgroup = scope.locate_cgroup()  # first: one not found ends the run before anything
    narrator = hook.narrator()
    narrator.workloads = workload_words(loaded.config.lock_dir)
    reporter = narrator.reporter
    # First thing: the unit's own TimeoutStartSec=/TimeoutStopSec= may be shorter than this
    # run's deadline; systemd 247 to 257 honour EXTEND_TIMEOUT_USEC= in start-pre and stop-post.
    reporter.extend_timeout(loaded.config.policy(scope.phase).wait_timeout_s + TIMEOUT_MARGIN_S)
    surroundings = hook.surroundings(scope, loaded, reporter)
    if not scope.dry_run:
        required = scope.phase.traits.state_required
        warn = None if required else narrator.state_unwritable  # after a stop: it goes on
        check_all(*surroundings.state_to_write(), on_unwritable=warn)
    narrator.looking()
    roots, traits = scope.roots, scope.phase.traits
    # After a stop (read before post kills what is left of the unit), say what the unit's own
    # /dev/shm held. systemd gives the hook a fresh tmpfs of its own there (not PID 1's) where
    # the unit has one: that is how it tells.
    after_stop = traits.systemd and traits.releases_lease and not scope.dry_run
    if after_stop and host_root(roots.dev, roots.proc) is not None:
        from gpugate.host.shm import is_own_tmpfs, own_shm_of_any  # noqa: PLC0415 (post's)
        from gpugate.report.lines import say_own_shm_gone  # noqa: PLC0415

        devs = {area.dev for area in find_areas(roots.dev, roots.proc)}
        if is_own_tmpfs(str(roots.dev / "shm"), devs):
            try:
                pids = set(cgroup_members(roots.cgroup, cgroup)) - {os.getpid()}
            except GateError:
                pids = set()
            say_own_shm_gone(reporter, own_shm_of_any(roots.proc, pids, devs))
    # An error is told to the surroundings first (core/run.py).
    return PhaseRun(scope, cgroup, narrator.tell, surroundings).run()


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
        raise interrupted(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def collect(
    unit: str | None,
    loaded: LoadedConfig,
    driver: GpuDriver,
    roots: HostRoots,
    *,
    procfs: ProcFs | None = None,
    watch: WatchScan | None = None,
    listed_first: bool = False,
    starting: Sequence[Gpu] | None = None,
) -> Discovery:
    """The commands' one discovery. `status` (unit None: the whole host), as nvidia-smi: a GPU
    NVML cannot read is listed in `faults`, not hiding the others. listed_first (the sweep's):
    every process's fds only where NVML's lists do not account for the GPUs' memory within
    free_mib (`discover`'s listed_within_mib); status reads them all. starting (`gpugate run`'s
    check before the start): the unit's GPUs; no process is in its cgroup yet, and an NVML
    error on them fails the check, as it fails the unit's pre."""
    cgroup, checking = NO_UNIT_CGROUP, False
    wanted: GpuSelection = "all"
    if starting is not None and unit is not None:
        cgroup, wanted, checking = f"/system.slice/{unit}", as_refs(starting), True
    elif unit is not None:
        loaded = with_chosen_gpus(loaded, choose_gpus(unit, loaded, ask_systemd=roots.ask_systemd))
        cgroup = resolve_unit_cgroup(unit, roots.cgroup, ask_systemd=roots.ask_systemd)
        wanted = loaded.config.selection()
    return discover(
        DiscoveryQuery(unit or "", cgroup, wanted, loaded.source),
        driver=driver,
        procfs=procfs or ProcFs(roots.proc),
        roots=roots,
        ports=() if unit is None else loaded.config.ports,
        containers=loaded.config.containers,
        strict_faults=checking,
        deadline=NO_DEADLINE if checking else Deadline(time.monotonic() + STATUS_SCAN_S),
        watch=watch,
        listed_within_mib=loaded.config.free_mib if listed_first else None,
    )


def set_drain_reason(node: str, reason: str, stream: TextIO) -> None:
    """Best effort: drain the node first with gpugate's reason, which slurmctld keeps when
    the failed hook drains it too. scontrol from the system folders, never the job's PATH."""
    from gpugate.report import lines  # noqa: PLC0415 (a drain's words; not on pre's path)

    scontrol = find_program("scontrol")
    if scontrol is None:
        return
    try:
        result = run_program(
            [scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
            SCONTROL_TIMEOUT_S,
        )
    except GateError as exc:
        print(lines.warning(exc.message), file=stream)
        return
    if result.returncode != 0:
        said = f"scontrol exited {result.returncode}: {result.first_line()}"
        print(lines.warning(said), file=stream)


def warn_environment_files(unit: str) -> None:
    """What the unit's EnvironmentFile= lines would let another account change (stderr)."""
    from gpugate.integrations.env_files import unit_environment_warnings  # noqa: PLC0415
    from gpugate.report import lines  # noqa: PLC0415

    for line in unit_environment_warnings(unit):
        print(lines.error(line), file=sys.stderr)


def parse_uid(text: str) -> int | None:
    """A uid in decimal ASCII digits, as sudo writes SUDO_UID (and `--for-uid`): no sign,
    blank, leading zero or other script's digits (int() takes Arabic-Indic ones), and not
    (uid_t)-1."""
    if not UID_TEXT.fullmatch(text):
        return None
    uid = int(text)
    return uid if uid < NO_UID else None
