"""`gpugate pre|post [UNIT]`: a systemd unit's ExecStartPre=/ExecStopPost= hook."""

from __future__ import annotations

import argparse
import functools

from gpugate.core.run import RunScope
from gpugate.errors import UnknownUnit
from gpugate.front.hook import Hook, HostAccess, run_hook, stopped_by_signals
from gpugate.host.systemd import own_unit, resolve_unit_cgroup, unit_argument, validate_unit_name
from gpugate.integrations.config_files import CACHE_NAME, load_config
from gpugate.integrations.unit import UnitContext
from gpugate.phase import Phase


def pre_post(args: argparse.Namespace, front: HostAccess) -> int:
    """From its command line: --force runs by hand against a running unit; the hidden
    --for-uid kills only that account's processes, --ignore-leases warns of leases."""
    phase, dry_run = Phase(args.command), args.dry_run
    roots = front.host_roots()  # first: a host gpugate cannot serve says so before anything
    unit = unit_argument(args.unit) if args.unit else own_unit(roots.proc)
    if unit is None:
        raise UnknownUnit(
            "no UNIT given and gpugate is not running inside a service's cgroup; pass the "
            "unit (%n in a unit file)"
        )
    validate_unit_name(unit)
    loaded = load_config(unit, args.config, cache=roots.run / CACHE_NAME)
    context = UnitContext(
        front.environ,
        guard_manual_run=not (args.force or dry_run),
        active_state=front.unit_state,
        ignore_leases=args.ignore_leases,
    )
    locate = functools.partial(
        resolve_unit_cgroup, unit, roots.cgroup, ask_systemd=roots.ask_systemd
    )
    scope = RunScope(phase, unit, locate, args.for_uid, dry_run, roots, front.driver_factory)
    reporter = front.reporter_factory(unit, phase.value)
    hook = Hook(scope, context.surroundings, reporter, metrics_unit=unit)
    with stopped_by_signals():
        return int(run_hook(hook, loaded).exit_code)
