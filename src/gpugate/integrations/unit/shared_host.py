"""A systemd unit's surroundings on a host that other units share: what the core run asks of
them (core/outcome.py), for the phases whose traits say they apply.

- the unit's GPUs when `gpus = "auto"` (gpu_source.py), named in the run's first entry;
- a hand-typed pre/post against a running unit: refused before anything is killed
  (manual_run_guard, below);
- GPU leases (leases.py): checked and written under the per-GPU locks before the first
  kill; kept on pre's success; given up when pre fails, ends in an error or is interrupted
  (its reason recorded for post: start_failure.py, post does not wait on that memory again),
  and by post (`_ended`: the lease's end, whatever ended the run).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpugate.config.models import LoadedConfig
from gpugate.core.decide import Decision
from gpugate.core.outcome import BusyGpu, Progress, RunSummary, StateToWrite, run_state_to_write
from gpugate.core.run import RunScope
from gpugate.errors import (
    ExitCode,
    GateError,
    Interrupted,
    ManualRunRefused,
    PermissionDenied,
    StateUnwritable,
)
from gpugate.host.nvml import Gpu
from gpugate.host.roots import HostRoots
from gpugate.host.systemd import (
    UnitEnvironment,
    active_state,
    own_unit,
    unit_active_state,
    unit_environment,
)
from gpugate.integrations.unit.gpu_source import GpuChoice, choose_gpus, with_chosen_gpus
from gpugate.integrations.unit.leases import (
    STARTED_BY_VARIABLE,
    Lease,
    LeaseCheck,
    check_leases,
    lease_dir,
    new_lease,
    release_lease,
    write_lease,
)
from gpugate.integrations.unit.start_failure import (
    FailedPre,
    clear_failed_pre,
    failed_pre_of_this_start,
    failure_path,
    record_failed_pre,
)
from gpugate.phase import Phase
from gpugate.report.holder_text import describe
from gpugate.report.journal import Reporter
from gpugate.report.narrate_unit import UnitNarration, failed_start_text
from gpugate.untrusted import cut


@dataclass(frozen=True)
class UnitContext:
    """What the front knows of the unit's hook, for its surroundings: the hook's
    environment, the options; systemd's answers (tests give stand-ins)."""

    environ: Mapping[str, str]  # the hook's (INVOCATION_ID, SERVICE_RESULT)
    roots: HostRoots = field(default_factory=HostRoots)
    # `gpugate pre|post` without --force or --dry-run: refused against a running unit
    # unless it is the unit's own hook (manual_run_guard); never for a container's hook.
    guard_manual_run: bool = False
    active_state: Callable[[str], str | None] = active_state  # the guard's: systemd's
    ignore_leases: bool = False  # pre --ignore-leases (gpugate run --force): warn, not refuse
    environment: Callable[[str], UnitEnvironment | None] | None = None  # default: systemd's
    unit_state: Callable[[str], str | None] | None = None  # default: unit_active_state


@dataclass
class UnitSurroundings:
    """What one run knows about the host around its unit; implements core's Surroundings."""

    scope: RunScope  # the phase and the unit
    loaded: LoadedConfig  # with the unit's GPUs resolved
    context: UnitContext
    choice: GpuChoice
    narration: UnitNarration
    failed_pre: FailedPre | None = None  # post: this start's failed pre
    lease_written: bool = False  # pre wrote its lease before the kill (reserve)
    refusal: str | None = None  # why another unit's lease refused this start

    @property
    def environ(self) -> Mapping[str, str]:
        return self.context.environ

    @property
    def phase(self) -> Phase:
        return self.scope.phase

    @property
    def unit(self) -> str:
        return self.scope.unit

    @property
    def gpu_source(self) -> str:
        return self.choice.source

    @property
    def gpu_source_warns(self) -> bool:
        return self.choice.warn

    def before_kill(self, decision: Decision) -> None:
        context = self.context
        if not context.guard_manual_run:
            return
        state = manual_run_guard(
            self.phase, self.unit, context.active_state, self.environ, context.roots.proc
        )
        if state is not None:
            would_kill = [describe(choice) for choice in decision.targets]
            raise refusal(state, self.phase.value, self.unit, would_kill)

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        self.refusal = self._lease_refusal(owned, dry_run=dry_run)
        return self.refusal is not None

    def _lease_refusal(self, owned: Sequence[Gpu], *, dry_run: bool) -> str | None:
        """Before pre kills: why it refuses, where a running unit's lease covers its GPUs."""
        if not self.phase.traits.takes_lease or not owned:
            return None
        config = self.loaded.config
        check = self._check_leases(owned)
        for path in check.unreadable:
            self.narration.lease_unreadable(path, check.why.get(path, ""))
        for lease, state in check.stale:
            # Said once: the stale lease is removed (not in a dry run) and never seen again.
            self.narration.lease_stale(lease.unit, lease.gpus, state, dry_run=dry_run)
            if not dry_run:
                release_lease(config.lock_dir, lease.unit)
        for lease, gpus in check.shared:
            self.narration.gpus_shared(lease.unit, [g.index for g in gpus])
        if not check.conflicts:
            return None
        if self.context.ignore_leases:  # gpugate run --force
            for lease, gpus in check.conflicts:
                self.narration.lease_overridden(
                    lease.unit, lease.holder_text(), [g.index for g in gpus]
                )
            return None
        conflicted = {g.index for _, gpus in check.conflicts for g in gpus}
        self.narration.lease_refused(check.refusal(), sorted(conflicted))
        return check.refusal()

    def reserve(self, owned: Sequence[Gpu]) -> None:
        """pre, before it kills: the lease it will hold on success, written now, so that a
        lease that cannot be written (no space, read-only) stops the run before anything
        dies. A run that then fails releases it (after_run)."""
        if not self.phase.traits.takes_lease or not owned or not self.choice.named:
            return
        write_lease(self.loaded.config.lock_dir, self._lease(owned))
        self.lease_written = True

    def _lease(self, owned: Sequence[Gpu]) -> Lease:
        return new_lease(
            self.unit,
            owned,
            share=self.loaded.config.share_gpus,
            invocation_id=self.environ.get("INVOCATION_ID"),
            started_by=self.environ.get(STARTED_BY_VARIABLE),
        )

    def state_to_write(self) -> StateToWrite:
        """The run's own (locks, metrics), and this phase's leases and failed-start records."""
        config, traits = self.loaded.config, self.phase.traits
        folders, files = run_state_to_write(config)
        unit_folders = []
        if traits.takes_lease:
            unit_folders.append((lease_dir(config.lock_dir), "GPU leases"))
        if traits.records_failed_start:
            unit_folders.append((failure_path(config.lock_dir, "-").parent, "failed-start records"))
        return [folders[0], *unit_folders, *folders[1:]], files

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        """pre refused because another running unit holds the GPUs: where that unit also
        holds a lease on them, say so too (it names who started a `gpugate run` unit)."""
        if not self.phase.traits.takes_lease or not owned:
            return
        check = self._check_leases(owned)
        if check.conflicts:
            conflicted = {g.index for _, gpus in check.conflicts for g in gpus}
            self.narration.lease_refused(check.refusal(), sorted(conflicted), first=False)

    def _check_leases(self, owned: Sequence[Gpu]) -> LeaseCheck:
        config = self.loaded.config
        return check_leases(
            config.lock_dir, self.unit, owned, share=config.share_gpus, unit_state=self._state
        )

    def _state(self, name: str) -> str | None:
        if self.context.unit_state is not None:
            return self.context.unit_state(name)
        roots = self.context.roots
        return unit_active_state(name, roots.cgroup, ask_systemd=roots.ask_systemd)

    def not_to_wait_on(self, owned: Sequence[Gpu]) -> list[Gpu]:
        """post after a failed pre: the GPUs whose memory pre already waited for in vain."""
        if self.failed_pre is None:
            return []
        busy = {uuid.lower() for uuid in self.failed_pre.busy_uuids}
        skipped = [gpu for gpu in owned if gpu.uuid.lower() in busy]
        if skipped:
            self.narration.waiting_skipped(skipped)
        return skipped

    def after_run(self, summary: RunSummary) -> None:
        code = summary.exit_code
        busy = [(b.gpu.label, b.used_mib, b.pids) for b in summary.busy]
        timeout_s = self.loaded.config.policy(self.phase).wait_timeout_s
        reason = self.refusal or failed_start_text(int(code), code.name, busy, timeout_s)
        self._ended(code, reason, summary.busy, owned=summary.owned)
        if self.phase.traits.reads_failed_start and self.failed_pre is not None:
            self.narration.start_failed_earlier(self.failed_pre.reason)

    def after_error(self, error: GateError, progress: Progress) -> None:
        """An interruption's reason says what the run was doing; the GPUs it was still
        waiting for need no second wait in post."""
        busy: Sequence[BusyGpu] = ()
        if isinstance(error, Interrupted):
            from gpugate.report.stage_text import interrupted  # noqa: PLC0415 (a stopped run's)

            error, busy = interrupted(error, progress), progress.last_busy
        self._ended(error.exit_code, error.message, busy, ended_by=error)

    def _ended(
        self,
        code: ExitCode,
        reason: str,
        busy: Sequence[BusyGpu],
        *,
        owned: Sequence[Gpu] = (),
        ended_by: GateError | None = None,
    ) -> None:
        """The lease's end, whatever ended the run: pre keeps it on success; a failed pre
        (an exit code, an error, an interruption) gives it up and records why; post ends it
        (but for an error before it was over: the unit may still run)."""
        lock_dir, traits = self.loaded.config.lock_dir, self.phase.traits
        if traits.takes_lease and ended_by is None and code is ExitCode.OK:
            self._started(owned)
        elif traits.records_failed_start:
            with contextlib.suppress(StateUnwritable) if ended_by else contextlib.nullcontext():
                release_lease(lock_dir, self.unit)  # an error: the run's own is the one to say
            uuids = tuple(item.gpu.uuid for item in busy)
            self._record_failure(reason, int(code), uuids)
        if traits.releases_lease and not (ended_by and not isinstance(ended_by, Interrupted)):
            self._release()

    def _started(self, owned: Sequence[Gpu]) -> None:
        lock_dir = self.loaded.config.lock_dir
        if not self.choice.named or not owned:
            # Every GPU only because nothing named the unit's: a lease on all of them would
            # lock every other unit out. The run's first entry said where the GPUs came from.
            # (No GPU at all: NVML failed with on_nvml_error = warn, or the unit uses none.)
            release_lease(lock_dir, self.unit)
        elif not self.lease_written:
            write_lease(lock_dir, self._lease(owned))
        clear_failed_pre(lock_dir, self.unit)

    def _release(self) -> None:
        """After a stop: the unit's lease and this start's failed-start record go. Where
        lock_dir will not let them (read-only), a phase whose state is not required says so
        and its result stands: the lease is stale once the unit is inactive."""
        lock_dir = self.loaded.config.lock_dir
        for remove in (release_lease, clear_failed_pre):
            try:
                remove(lock_dir, self.unit)
            except (StateUnwritable, PermissionDenied) as exc:
                if self.phase.traits.state_required:
                    raise
                self.narration.not_recorded(exc)

    def driver_hung_earlier(self) -> str | None:
        """post after a pre that NVML did not answer: pre's words, or None."""
        failed = self.failed_pre
        if failed is None or failed.exit_code != ExitCode.NVML_NOT_ANSWERING:
            return None
        return failed.reason

    def _record_failure(self, reason: str, exit_code: int, busy_uuids: tuple[str, ...]) -> None:
        failed = FailedPre(
            unit=self.unit,
            invocation_id=self.environ.get("INVOCATION_ID") or None,
            reason=reason,
            exit_code=exit_code,
            busy_uuids=busy_uuids,
        )
        record_failed_pre(self.loaded.config.lock_dir, failed)


def prepare(
    scope: RunScope, loaded: LoadedConfig, narration: UnitNarration, context: UnitContext
) -> UnitSurroundings:
    """The unit's surroundings, its config's GPUs resolved. Without context.environment and
    unit_state (tests' stand-ins) systemd is asked where it runs."""
    environment = context.environment
    if environment is None:
        environment = unit_environment if context.roots.ask_systemd else _no_environment
    choice = choose_gpus(scope.unit, loaded, environment)
    surroundings = UnitSurroundings(
        scope, with_chosen_gpus(loaded, choice), context, choice, narration
    )
    if scope.phase.traits.reads_failed_start:
        lock_dir = loaded.config.lock_dir
        surroundings.failed_pre = failed_pre_of_this_start(
            lock_dir, scope.unit, context.environ, narration.failed_start_unreadable
        )
    return surroundings


def unit_surroundings(
    context: UnitContext,
) -> Callable[[RunScope, LoadedConfig, Reporter], UnitSurroundings]:
    """How the hook's surroundings are made once the run's scope and config are known."""

    def make(scope: RunScope, loaded: LoadedConfig, reporter: Reporter) -> UnitSurroundings:
        return prepare(scope, loaded, UnitNarration(reporter), context)

    return make


def _no_environment(unit: str) -> UnitEnvironment | None:
    """Systemd is not asked (a root that is not the running host's)."""
    return None


# Manual runs: `gpugate pre|post UNIT` typed in a shell against a running unit. systemd runs
# a unit's ExecStartPre= and ExecStopPost= in the unit's own cgroup with INVOCATION_ID set; a
# run that lacks either is not the unit's hook. Against a unit that is active or activating
# such a run would kill the running service, so it refuses unless given --force. --dry-run
# is always allowed.

RUNNING = frozenset({"active", "activating", "reloading", "refreshing"})
MAX_LISTED = 5  # processes a manual-run refusal lists before "and N more"
MAX_LISTED_TEXT = 120  # characters of each


def in_own_hook(unit: str, environ: Mapping[str, str], proc_root: Path = Path("/proc")) -> bool:
    return bool(environ.get("INVOCATION_ID")) and own_unit(proc_root) == unit


def manual_run_guard(
    phase: Phase,
    unit: str,
    unit_state: Callable[[str], str | None],
    environ: Mapping[str, str],
    proc_root: Path = Path("/proc"),
) -> str | None:
    """The running unit's ActiveState where this hand-typed run (not --force, not --dry-run)
    must not kill (the refusal's fact; the words are report/'s), or None where it may: the
    unit's own hook (systemd is not even asked), or a unit that is not running."""
    if not phase.traits.guards_manual_run:
        return None
    if in_own_hook(unit, environ, proc_root):
        return None
    active_state = unit_state(unit)
    if active_state not in RUNNING:
        return None
    return active_state


def refusal(state: str, phase: str, unit: str, would_kill: list[str]) -> GateError:
    """state: the unit's ActiveState, as manual_run_guard found it; would_kill: each target
    as the journal names it."""
    # Each already shown (escaped) by describe(); one line, each short.
    shown = [cut(re.sub(r"\s+", " ", text), MAX_LISTED_TEXT) for text in would_kill]
    listed = "; ".join(shown[:MAX_LISTED]) + (
        f"; and {len(shown) - MAX_LISTED} more" if len(shown) > MAX_LISTED else ""
    )
    what = (
        f"it would kill {len(shown)} process(es): {listed}"
        if shown
        else "it would kill nothing now"
    )
    return ManualRunRefused(
        f"{unit} is {state} and this `gpugate {phase}` is not its {phase} hook "
        f"(not in the unit's cgroup with INVOCATION_ID set); {what}; nothing killed. To do it "
        f"on purpose: gpugate {phase} {unit} --force"
    )
