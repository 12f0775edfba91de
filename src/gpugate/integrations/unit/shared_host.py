"""A run on a host that other units share: the steps hook.py and pipeline.py call around theirs.

- the unit's GPUs when `gpus = "auto"` (gpu_source.py), named in the run's first entry;
- NVML faults on GPUs the unit does not own: a warning, once per run;
- a hand-typed pre/post against a running unit: refused before anything is killed;
- GPU leases (leases.py): checked and taken under the per-GPU locks, released by post;
- a failed pre's reason (start_failure.py): post does not wait on that memory again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpugate.config.models import LoadedConfig
from gpugate.core.decide import Choice, Decision
from gpugate.core.discover import Discovery
from gpugate.core.outcome import BusyGpu
from gpugate.errors import ExitCode, GateError
from gpugate.host.nvml import Gpu
from gpugate.host.roots import HostRoots
from gpugate.host.systemd import UnitEnvironment, unit_active_state, unit_environment
from gpugate.integrations.unit.gpu_source import GpuChoice, choose_gpus, with_chosen_gpus
from gpugate.integrations.unit.leases import (
    FORCE_VARIABLE,
    STARTED_BY_VARIABLE,
    check_leases,
    new_lease,
    release_lease,
    write_lease,
)
from gpugate.integrations.unit.manual_guard import refusal
from gpugate.integrations.unit.start_failure import (
    FailedPre,
    clear_failed_pre,
    failed_pre_of_this_start,
    record_failed_pre,
)
from gpugate.report.journal import PRIORITY_ERR, PRIORITY_WARNING, Event, Reporter


@dataclass
class HostContext:
    """What one run knows about the host around its unit."""

    phase: str
    unit: str
    environ: Mapping[str, str]
    choice: GpuChoice
    manual_refusal: str | None = None  # hook_guard.manual_run_guard's reason, or None
    roots: HostRoots = field(default_factory=HostRoots)
    failed_pre: FailedPre | None = None  # post: this start's failed pre
    reported_faults: set[int] = field(default_factory=set)
    unit_state: Callable[[str], str | None] | None = None  # default: unit_active_state


def prepare(
    phase: str,
    unit: str,
    loaded: LoadedConfig,
    environ: Mapping[str, str],
    *,
    roots: HostRoots,
    manual_refusal: str | None = None,
    environment: Callable[[str], UnitEnvironment | None] | None = None,
    unit_state: Callable[[str], str | None] | None = None,
) -> tuple[LoadedConfig, HostContext]:
    """The config with the unit's GPUs resolved, and the run's context. environment and
    unit_state stand in for systemd (tests); without them systemd is asked where it runs."""
    if environment is None:
        environment = unit_environment if roots.ask_systemd else _no_environment
    choice = choose_gpus(unit, loaded, environment)
    context = HostContext(
        phase,
        unit,
        environ,
        choice,
        manual_refusal=manual_refusal,
        roots=roots,
        unit_state=unit_state,
    )
    if phase == "post":
        context.failed_pre = failed_pre_of_this_start(loaded.config.lock_dir, unit, environ)
    return with_chosen_gpus(loaded, choice), context


def _no_environment(unit: str) -> UnitEnvironment | None:
    """Systemd is not asked (a root that is not the running host's)."""
    return None


def report_faults(context: HostContext, reporter: Reporter, discovery: Discovery) -> None:
    """Faults on GPUs the unit does not own (its own fail the run in discover)."""
    for fault in discovery.faults:
        if fault.index in context.reported_faults:
            continue
        context.reported_faults.add(fault.index)
        reporter.event(
            Event.ERROR,
            f"{fault.error}; not a GPU of {context.unit}: going on with its own GPUs",
            priority=PRIORITY_WARNING,
            gpus=[fault.index],
        )


def refuse_manual_run(
    context: HostContext, decision: Decision, describe: Callable[[Choice], str]
) -> None:
    if context.manual_refusal is None:
        return
    would_kill = [describe(choice) for choice in decision.targets]
    raise refusal(context.manual_refusal, context.phase, context.unit, would_kill)


def leases_refuse(
    context: HostContext,
    loaded: LoadedConfig,
    reporter: Reporter,
    owned: Sequence[Gpu],
    *,
    dry_run: bool,
) -> str | None:
    """Before pre kills: why it refuses, where a running unit's lease covers its GPUs."""
    if context.phase != "pre" or not owned:
        return None
    config = loaded.config
    check = check_leases(
        config.lock_dir,
        context.unit,
        owned,
        share=config.share_gpus,
        unit_state=context.unit_state
        or (
            lambda name: unit_active_state(
                name, context.roots.cgroup, ask_systemd=context.roots.ask_systemd
            )
        ),
    )
    for path in check.unreadable:
        reporter.event(
            Event.ERROR, f"{path}: not a gpugate lease; ignored", priority=PRIORITY_WARNING
        )
    for lease, state in check.stale:
        # Reported once: the stale lease is removed (not in a dry run) and never seen again.
        reporter.event(
            Event.ERROR,
            f"GPU lease of {lease.unit} on GPU {_indices(lease.gpus)} is stale ({lease.unit} "
            f"is {state}); {'would take' if dry_run else 'taking'} it over",
            priority=PRIORITY_WARNING,
            gpus=list(lease.gpus),
        )
        if not dry_run:
            release_lease(config.lock_dir, lease.unit)
    for lease, gpus in check.shared:
        reporter.event(
            Event.PROCESS_SPARED,
            f"GPU {_indices(g.index for g in gpus)} shared with {lease.unit} (share_gpus in both)",
            gpus=[g.index for g in gpus],
        )
    if not check.conflicts:
        return None
    if context.environ.get(FORCE_VARIABLE) == "1":
        for lease, gpus in check.conflicts:
            reporter.event(
                Event.ERROR,
                f"GPU {_indices(g.index for g in gpus)} leased to {lease.holder_text()}; "
                f"starting {context.unit} anyway (gpugate run --force)",
                priority=PRIORITY_WARNING,
                gpus=[g.index for g in gpus],
            )
        return None
    reporter.event(
        Event.REFUSED,
        f"not starting {context.unit}: {check.refusal()}",
        priority=PRIORITY_ERR,
        gpus=sorted({g.index for _, gpus in check.conflicts for g in gpus}),
        reason="leased",
    )
    reporter.status(f"refused: {check.refusal()}")
    return check.refusal()


def name_leases_of_holders(
    context: HostContext, loaded: LoadedConfig, reporter: Reporter, owned: Sequence[Gpu]
) -> None:
    """pre refused because another running unit holds the GPUs: where that unit also holds a
    lease on them, say so too (it names who started a `gpugate run` unit, and when)."""
    if context.phase != "pre" or not owned:
        return
    config = loaded.config
    check = check_leases(
        config.lock_dir,
        context.unit,
        owned,
        share=config.share_gpus,
        unit_state=context.unit_state
        or (
            lambda name: unit_active_state(
                name, context.roots.cgroup, ask_systemd=context.roots.ask_systemd
            )
        ),
    )
    if check.conflicts:
        reporter.event(
            Event.REFUSED,
            f"not starting {context.unit}: {check.refusal()}",
            priority=PRIORITY_ERR,
            gpus=sorted({g.index for _, gpus in check.conflicts for g in gpus}),
            reason="leased",
        )


def after_run(
    context: HostContext,
    loaded: LoadedConfig,
    reporter: Reporter,
    *,
    owned: Sequence[Gpu],
    exit_code: ExitCode,
    busy: Sequence[BusyGpu],
    lease_refusal: str | None = None,
) -> None:
    """pre: take the lease on success, record why on failure; post: release it. (Slurm's
    prolog and epilog take none: Slurm gives out its GPUs itself.)"""
    lock_dir = loaded.config.lock_dir
    if context.phase == "pre":
        if exit_code is ExitCode.OK and (not context.choice.named or not owned):
            # Every GPU only because nothing named the unit's: a lease on all of them would
            # lock every other unit out. The run's first entry said where the GPUs came from.
            # (No GPU at all: NVML failed with on_nvml_error = warn, or the unit uses none.)
            release_lease(lock_dir, context.unit)
            clear_failed_pre(lock_dir, context.unit)
        elif exit_code is ExitCode.OK:
            write_lease(
                lock_dir,
                new_lease(
                    context.unit,
                    owned,
                    share=loaded.config.share_gpus,
                    invocation_id=context.environ.get("INVOCATION_ID"),
                    started_by=context.environ.get(STARTED_BY_VARIABLE),
                ),
            )
            clear_failed_pre(lock_dir, context.unit)
            return
        release_lease(lock_dir, context.unit)
        reason = lease_refusal or failure_reason(exit_code, busy, loaded.config.pre.wait_timeout_s)
        record_failed_pre(
            lock_dir,
            FailedPre(
                unit=context.unit,
                invocation_id=context.environ.get("INVOCATION_ID") or None,
                reason=reason,
                exit_code=int(exit_code),
                busy_uuids=tuple(item.gpu.uuid for item in busy),
            ),
        )
    elif context.phase == "post":
        release_lease(lock_dir, context.unit)
        clear_failed_pre(lock_dir, context.unit)
        if context.failed_pre is not None:
            # Last, so that `systemctl status` (STATUS= and the journal's tail) shows it.
            text = f"start failed in gpugate pre: {context.failed_pre.reason}"
            reporter.event(Event.ERROR, text, priority=PRIORITY_ERR, reason="failed-start")
            reporter.status(text)


def record_pre_error(
    context: HostContext,
    loaded: LoadedConfig,
    error: GateError,
    busy: Sequence[BusyGpu] = (),
) -> None:
    """pre ended with an error (lock timeout, NVML, ...): post need not wait on it again
    (busy: the GPUs pre was still waiting for)."""
    if context.phase != "pre":
        return
    lock_dir = loaded.config.lock_dir
    release_lease(lock_dir, context.unit)
    record_failed_pre(
        lock_dir,
        FailedPre(
            unit=context.unit,
            invocation_id=context.environ.get("INVOCATION_ID") or None,
            reason=error.message,
            exit_code=int(error.exit_code),
            busy_uuids=tuple(item.gpu.uuid for item in busy),
        ),
    )


def record_interrupted(
    context: HostContext, loaded: LoadedConfig, error: GateError, busy: Sequence[BusyGpu]
) -> None:
    """A run stopped by SIGTERM/SIGINT. pre: a failed start, recorded as one, with the GPUs
    it was still waiting for, which that start's post then does not wait on again. post: the
    unit is stopping, so its lease goes, as at post's end. (Slurm's runs take no lease.)"""
    if context.phase == "pre":
        record_pre_error(context, loaded, error, busy)
    elif context.phase == "post":
        release_lease(loaded.config.lock_dir, context.unit)
        clear_failed_pre(loaded.config.lock_dir, context.unit)


def nvml_hung_in_pre(context: HostContext) -> str | None:
    """post after a pre that NVML did not answer: pre's words, or None."""
    failed = context.failed_pre
    if failed is None or failed.exit_code != ExitCode.NVML_NOT_ANSWERING:
        return None
    return failed.reason


def gpus_not_to_wait_on(context: HostContext, owned: Sequence[Gpu]) -> list[Gpu]:
    """post after a failed pre: the GPUs whose memory pre already waited for in vain."""
    if context.failed_pre is None:
        return []
    busy = {uuid.lower() for uuid in context.failed_pre.busy_uuids}
    return [gpu for gpu in owned if gpu.uuid.lower() in busy]


def waiting_skipped(reporter: Reporter, gpus: Sequence[Gpu]) -> None:
    reporter.event(
        Event.TIMEOUT,
        f"not waiting again on GPU {_indices(g.index for g in gpus)}: this start's pre already "
        "waited its wait_timeout_s for that memory",
        priority=PRIORITY_WARNING,
        gpus=[gpu.index for gpu in gpus],
    )


def failure_reason(exit_code: ExitCode, busy: Sequence[BusyGpu], timeout_s: float) -> str:
    if busy:
        return "; ".join(
            f"{item.gpu.label} still {item.used_mib} MiB used after {timeout_s:g} s"
            f" (PIDs {', '.join(map(str, item.pids)) or 'none listed'})"
            for item in busy
        )
    return f"exit {int(exit_code)} ({exit_code.name.lower()}); see journalctl for its entries"


def _indices(indices: object) -> str:
    return ", ".join(str(i) for i in sorted(indices))  # type: ignore[call-overload]
