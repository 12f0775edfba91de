"""`gpugate pre|post [UNIT]`: a systemd unit's ExecStartPre=/ExecStopPost= hook."""

from __future__ import annotations

from pathlib import Path

from gpugate.core.run import RunScope
from gpugate.errors import UnknownUnit
from gpugate.front.hook import Hook, HostAccess, run_hook, stopped_by_signals
from gpugate.host.systemd import own_unit, resolve_unit_cgroup, unit_argument, validate_unit_name
from gpugate.integrations.config_files import load_config
from gpugate.integrations.unit import UnitContext
from gpugate.phase import Phase


def pre_post(
    front: HostAccess,
    phase: Phase,
    unit_given: str | None,
    config: Path | None,
    *,
    dry_run: bool = False,
    force: bool = False,
    ignore_leases: bool = False,
    for_uid: int | None = None,
) -> int:
    """force: run by hand against a running unit; for_uid: kill only this account's."""
    roots = front.host_roots()  # first: a host gpugate cannot serve says so before anything
    unit = unit_argument(unit_given) if unit_given else own_unit(roots.proc)
    if unit is None:
        raise UnknownUnit(
            "no UNIT given and gpugate is not running inside a service's cgroup; pass the "
            "unit (%n in a unit file)"
        )
    validate_unit_name(unit)
    loaded = load_config(unit, config)
    context = UnitContext(
        front.environ,
        guard_manual_run=not (force or dry_run),
        active_state=front.unit_state,
        ignore_leases=ignore_leases,
    )
    scope = RunScope(
        phase,
        unit,
        lambda: resolve_unit_cgroup(unit, roots.cgroup, ask_systemd=roots.ask_systemd),
        for_uid,
        dry_run,
        roots,
        front.driver_factory,
    )
    reporter = front.reporter_factory(unit, phase.value)
    hook = Hook(scope, context.surroundings, reporter, metrics_unit=unit)
    with stopped_by_signals():
        return int(run_hook(hook, loaded).exit_code)
