"""A systemd unit's surroundings (core.outcome.Workload): its GPUs for `gpus = "auto"`,
a hand-typed pre/post against a running unit refused, and its GPU lease's life."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from gpugate.config.file import DEFAULT_CONFIG_DIR, LoadedConfig, replaced
from gpugate.config.values import BUILTIN_SOURCE, GpuSelection, parse_gpu_text
from gpugate.core.decide import Decision
from gpugate.core.discover import Discovery
from gpugate.core.outcome import BusyGpu, Progress, RunSummary, StateToWrite, Workload
from gpugate.core.run import RunScope
from gpugate.errors import (
    ConfigError,
    ExitCode,
    GateError,
    Interrupted,
    InvalidValue,
    ManualRunRefused,
    PermissionDenied,
    StateUnwritable,
)
from gpugate.host.nvml import Gpu
from gpugate.host.systemd import (
    UnitEnvironment,
    active_state,
    own_unit,
    unit_active_state,
    unit_environment,
)
from gpugate.integrations import records
from gpugate.phase import Phase
from gpugate.report.journal import Reporter
from gpugate.report.narrate import Narrator, describe, failed_start_text
from gpugate.untrusted import for_error, truncate

VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
NVIDIA_NO_GPU = {"", "none", "void"}
MAX_LISTED = 5  # processes a manual-run refusal lists before "and N more"
MAX_LISTED_TEXT = 120  # characters of each


class GpuChoice(NamedTuple):
    gpus: GpuSelection  # "all", or the GPUs ((): the unit uses none)
    source: str  # said in the run's first journal entry and by `config check --unit`
    warn: bool = False  # all GPUs only because nothing named them, and no config file
    named: bool = True  # False: every GPU by default, because nothing named the unit's


def parse_visible_devices(variable: str, value: str, where: str) -> GpuSelection:
    """A *_VISIBLE_DEVICES value: "all" or a tuple of indices and UUIDs."""
    text = value.strip()
    if variable == "NVIDIA_VISIBLE_DEVICES" and text.lower() in {"all", *NVIDIA_NO_GPU}:
        return "all" if text.lower() == "all" else ()
    if not text or text.split(",")[0].strip() == "-1":  # CUDA: a first -1 hides every GPU
        return ()
    try:
        return parse_gpu_text(text)
    except InvalidValue as exc:
        raise ConfigError(where, variable, f"{for_error(value)}: {exc}") from None


def choose_gpus(
    unit: str | None,
    loaded: LoadedConfig,
    environment: Callable[[str], UnitEnvironment | None] | None = None,
    *,
    ask_systemd: bool = True,
) -> GpuChoice:
    """`gpus = "auto"`: the unit's CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES, as
    systemd gives them to the unit (environment, default systemd's where it may be asked;
    never gpugate's own), else every GPU."""
    if loaded.config.gpus != "auto":
        return GpuChoice(loaded.config.gpus, f"gpus in {loaded.source}")
    if environment is None and ask_systemd:
        environment = unit_environment
    env = environment(unit) if unit and environment is not None else None
    if env is not None:
        for variable in VARIABLES:
            if variable in env.variables:
                where = f"unit {unit}: {env.origin(variable)}"
                gpus = parse_visible_devices(variable, env.variables[variable], where)
                return GpuChoice(gpus, f"{variable} of {unit} ({env.origin(variable)})")
    why = f"{unit} sets neither {' nor '.join(VARIABLES)}" if unit else "no unit"
    if env is None and unit:
        why = "systemd cannot be asked for the unit's environment"
    builtin = loaded.source == BUILTIN_SOURCE
    if builtin:
        why += " and no config file names gpus (set gpus, or the unit's CUDA_VISIBLE_DEVICES)"
    else:
        why += f' (gpus = "auto" in {loaded.source})'
    return GpuChoice("all", f"all GPUs: {why}", warn=builtin, named=False)


def with_chosen_gpus(loaded: LoadedConfig, choice: GpuChoice) -> LoadedConfig:
    return LoadedConfig(replaced(loaded.config, gpus=choice.gpus), loaded.source)


class UnitContext(NamedTuple):
    """The unit's hook: its environment, the options; systemd's answers (tests: stand-ins)."""

    environ: Mapping[str, str]  # the hook's (INVOCATION_ID, SERVICE_RESULT)
    # `gpugate pre|post` without --force or --dry-run; never for a container's hook.
    guard_manual_run: bool = False
    active_state: Callable[[str], str | None] = active_state  # the guard's
    ignore_leases: bool = False  # pre --ignore-leases (gpugate run --force): warn, not refuse
    environment: Callable[[str], UnitEnvironment | None] | None = None  # default: systemd's
    unit_state: Callable[[str], str | None] | None = None  # default: unit_active_state
    # A container's hook (integrations.container): its GPUs from its spec, its label on its
    # lease, the system unit around it (whose lease never refuses it, nor is taken or removed).
    choice: GpuChoice | None = None  # None: `gpus = "auto"` asks the unit's environment
    container: str | None = None
    around: str | None = None

    def surroundings(
        self, scope: RunScope, loaded: LoadedConfig, reporter: Reporter
    ) -> UnitWorkload:
        """Made once the run's scope and config are known (Hook.surroundings)."""
        narration = Narrator(reporter)
        ask = scope.roots.ask_systemd
        choice = self.choice or choose_gpus(scope.unit, loaded, self.environment, ask_systemd=ask)
        made = UnitWorkload(scope, with_chosen_gpus(loaded, choice), self, choice, narration)
        if scope.phase.traits.reads_failed_start:
            told = narration.failed_start_unreadable if self.container is None else None
            made.failed_pre = records.failed_pre_of_this_start(
                loaded.config.lock_dir, scope.unit, self.environ, told or (lambda path, why: None)
            )
        return made


class UnitWorkload(Workload):
    """A systemd unit as the workload of its pre or post: its GPUs come from its config or
    its environment, its leases refuse a start on GPUs another running unit holds, and pre
    writes this start's lease before the first kill. A container's hook uses it too, with
    the GPUs from the container's spec and the container's label on its lease."""

    __slots__ = (
        "choice",
        "context",
        "failed_pre",
        "gpu_source",
        "gpu_source_warns",
        "lease_written",
        "loaded",
        "narration",
        "refusal",
        "scope",
    )
    gpu_source: str  # the choice's: a field here, a property in Workload
    gpu_source_warns: bool

    def __init__(
        self,
        scope: RunScope,
        loaded: LoadedConfig,  # with the unit's GPUs resolved
        context: UnitContext,
        choice: GpuChoice,
        narration: Narrator,
    ) -> None:
        self.scope, self.loaded, self.context = scope, loaded, context
        self.choice, self.narration = choice, narration
        self.gpu_source, self.gpu_source_warns = choice.source, choice.warn
        self.failed_pre: records.FailedPre | None = None  # post: this start's failed pre
        self.lease_written = False  # pre wrote its lease before the kill (reserve)
        self.refusal: str | None = None  # why another unit's lease refused this start

    def before_kill(self, decision: Decision) -> None:
        context, scope = self.context, self.scope
        if not context.guard_manual_run:
            return
        state = manual_run_guard(
            scope.phase, scope.unit, context.active_state, context.environ, scope.roots.proc
        )
        if state is not None:
            would_kill = [describe(choice) for choice in decision.targets]
            raise refusal(state, scope.phase.value, scope.unit, would_kill)

    def shared_gpus(self, discovery: Discovery) -> frozenset[int]:
        """`share_gpus = true`: every GPU the unit owns is shared on purpose."""
        if not self.loaded.config.share_gpus:
            return frozenset()
        return frozenset(gpu.index for gpu in discovery.owned)

    def refuses_start(self, owned: Sequence[Gpu], *, dry_run: bool) -> bool:
        """Before pre kills: a running unit's lease covers its GPUs."""
        if not self.scope.phase.traits.takes_lease or not owned:
            return False
        check = self._check_leases(owned)
        for path, why in check.unreadable.items():
            self.narration.lease_unreadable(path, why)
        for lease, state in check.stale:
            # Said once: the stale lease is removed (not in a dry run) and never seen again.
            self.narration.lease_stale(lease.unit, lease.gpus, state, dry_run=dry_run)
            if not dry_run:
                records.release_lease(self.loaded.config.lock_dir, lease.unit)
        for lease, gpus in check.shared:
            self.narration.gpus_shared(lease.unit, [g.index for g in gpus])
        if check.conflicts and self.context.ignore_leases:
            for lease, gpus in check.conflicts:
                self.narration.lease_overridden(
                    lease.unit, lease.holder_text(), [g.index for g in gpus]
                )
        elif check.conflicts:
            self.refusal = self._refused(check, first=True)
        return self.refusal is not None

    def reserve(self, owned: Sequence[Gpu]) -> None:
        """pre's lease, written before it kills: one that cannot be written stops the run."""
        if not self.scope.phase.traits.takes_lease or not owned or not self.choice.named:
            return
        records.write_lease(self.loaded.config.lock_dir, self._lease(owned))
        self.lease_written = True

    def _lease(self, owned: Sequence[Gpu]) -> records.Lease:
        return records.new_lease(
            self.scope.unit,
            owned,
            share=self.loaded.config.share_gpus,
            invocation_id=self.context.environ.get("INVOCATION_ID"),
            started_by=self.context.environ.get(records.STARTED_BY_VARIABLE),
            container=self.context.container,
        )

    def state_to_write(self) -> StateToWrite:
        """The run's own (locks, metrics), and this phase's leases and failed-start records."""
        config, traits = self.loaded.config, self.scope.phase.traits
        folders, files = super().state_to_write()
        unit_folders = []
        if traits.takes_lease:
            unit_folders.append((config.lock_dir / records.LEASE_FOLDER, "GPU leases"))
        if traits.records_failed_start:
            unit_folders.append((config.lock_dir / records.FAILED_FOLDER, "failed-start records"))
        return [folders[0], *unit_folders, *folders[1:]], files

    def held_by_others(self, owned: Sequence[Gpu]) -> None:
        """Where the unit holding the GPUs also leases them, say so (it names who started it)."""
        if not self.scope.phase.traits.takes_lease or not owned:
            return
        check = self._check_leases(owned)
        if check.conflicts:
            self._refused(check, first=False)

    def _refused(self, check: records.LeaseCheck, *, first: bool) -> str:
        """The refusal, said: it names where this workload's share_gpus is set and how it
        would share."""
        context, source = self.context, self.loaded.source
        if context.container is None and context.environ.get(records.STARTED_BY_VARIABLE):
            refusal = check.refusal("--share-gpus", "start it with gpugate run --share-gpus")
        else:
            if source == BUILTIN_SOURCE:
                own = str(DEFAULT_CONFIG_DIR / f"{self.scope.unit}.toml")
                source = own if context.container is None else records.CONTAINERS_CONFIG
            refusal = check.refusal(source, container=context.container is not None)
        holders = [lease.unit for lease, _ in check.conflicts]
        self.narration.lease_refused(
            refusal, check.conflicted(), holders=holders, first=first, who=context.container
        )
        return refusal

    def _check_leases(self, owned: Sequence[Gpu]) -> records.LeaseCheck:
        config, roots = self.loaded.config, self.scope.roots
        unit_state = self.context.unit_state or functools.partial(
            unit_active_state, cgroup_root=roots.cgroup, ask_systemd=roots.ask_systemd
        )
        return records.check_leases(
            config.lock_dir,
            self.scope.unit,
            owned,
            share=config.share_gpus,
            unit_state=unit_state,
            around=self.context.around,
        )

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
        code, traits = summary.exit_code, self.scope.phase.traits
        if traits.takes_lease and code is ExitCode.OK:
            lock_dir = self.loaded.config.lock_dir
            if not self.choice.named or not summary.owned:
                # A lease on every GPU only because nothing named the unit's would lock every
                # other unit out. (No GPU at all: NVML failed with on_nvml_error = warn.)
                records.release_lease(lock_dir, self.scope.unit)
            elif not self.lease_written:
                records.write_lease(lock_dir, self._lease(summary.owned))
            records.clear_failed_pre(lock_dir, self.scope.unit)
        else:
            timeout_s = self.loaded.config.policy(self.scope.phase).wait_timeout_s
            reason = self.refusal or failed_start_text(code, summary.busy, timeout_s)
            self._failed(code, reason, summary.busy, error=False)
        if traits.releases_lease:
            self._release()
        if traits.reads_failed_start and self.failed_pre is not None:
            self.narration.start_failed_earlier(self.failed_pre.reason)

    def after_error(self, error: GateError, progress: Progress) -> None:
        """An interruption's reason says what the run was doing; the GPUs it was still
        waiting for need no second wait in post. post ends the lease only when interrupted:
        after another error the unit may still run."""
        busy: Sequence[BusyGpu] = ()
        if isinstance(error, Interrupted):
            busy = progress.last_busy
        self._failed(error.exit_code, error.message, busy, error=True)
        if self.scope.phase.traits.releases_lease and isinstance(error, Interrupted):
            self._release()

    def _failed(self, code: ExitCode, reason: str, busy: Sequence[BusyGpu], *, error: bool) -> None:
        """A failed pre gives its lease up (after an error, quietly) and records why."""
        if not self.scope.phase.traits.records_failed_start:
            return
        lock_dir = self.loaded.config.lock_dir
        with contextlib.suppress(StateUnwritable) if error else contextlib.nullcontext():
            records.release_lease(lock_dir, self.scope.unit)
        failed = records.FailedPre(
            unit=self.scope.unit,
            invocation_id=self.context.environ.get("INVOCATION_ID") or None,
            reason=reason,
            exit_code=int(code),
            busy_uuids=tuple(item.gpu.uuid for item in busy),
        )
        records.record_failed_pre(lock_dir, failed)

    def _release(self) -> None:
        """After a stop: the lease and the failed-start record go; where they cannot, a phase
        whose state is not required says so and stands (the lease is stale once inactive)."""
        lock_dir = self.loaded.config.lock_dir
        for remove in (records.release_lease, records.clear_failed_pre):
            try:
                remove(lock_dir, self.scope.unit)
            except (StateUnwritable, PermissionDenied) as exc:
                if self.scope.phase.traits.state_required:
                    raise
                self.narration.not_recorded(exc)

    def driver_hung_earlier(self) -> str | None:
        """post after a pre that NVML did not answer: pre's words, or None."""
        failed = self.failed_pre
        if failed is not None and failed.exit_code == ExitCode.NVML_NOT_ANSWERING:
            return failed.reason
        return None


# A manual run: `gpugate pre|post UNIT` typed in a shell. systemd runs a unit's ExecStartPre=
# and ExecStopPost= in the unit's own cgroup with INVOCATION_ID set; a run that lacks either
# is not the unit's hook, and against a running unit it refuses unless given --force.


def manual_run_guard(
    phase: Phase,
    unit: str,
    unit_state: Callable[[str], str | None],
    environ: Mapping[str, str],
    proc_root: Path = Path("/proc"),
) -> str | None:
    """The running unit's ActiveState where this hand-typed run must not kill, or None where
    it may: the unit's own hook (systemd is not even asked), or a unit that is not running."""
    if not phase.traits.guards_manual_run:
        return None
    if environ.get("INVOCATION_ID") and own_unit(proc_root) == unit:
        return None
    state = unit_state(unit)
    return state if state in records.RUNNING_STATES else None


def refusal(state: str, phase: str, unit: str, would_kill: list[str]) -> GateError:
    """would_kill: each target as the journal names it (already escaped by describe)."""
    shown = [truncate(re.sub(r"\s+", " ", text), MAX_LISTED_TEXT) for text in would_kill]
    more = [f"and {len(shown) - MAX_LISTED} more"] if len(shown) > MAX_LISTED else []
    listed = "; ".join(shown[:MAX_LISTED] + more)
    what = f"{len(shown)} process(es): {listed}" if shown else "nothing now"
    return ManualRunRefused(
        f"{unit} is {state} and this `gpugate {phase}` is not its {phase} hook "
        f"(not in the unit's cgroup with INVOCATION_ID set); it would kill {what}; nothing "
        f"killed. To do it on purpose: gpugate {phase} {unit} --force"
    )
