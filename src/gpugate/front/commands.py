"""The command handlers `cli` dispatches to: each takes the parsed arguments and what it may
touch (`Front`), and returns the exit code."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpugate.config.models import LoadedConfig
from gpugate.config.toml_text import to_toml
from gpugate.errors import ExitCode, NvmlNotAnswering, Problem, UnknownUnit
from gpugate.front.interrupt import stopped_by_signals
from gpugate.host.cgroups import CgroupLayout, on_unified_hierarchy, read_cgroup_layout
from gpugate.host.nvml import GpuDriver, NotAnswering, NvmlDriver
from gpugate.host.roots import SYSTEM_CGROUP_ROOT, HostRoots
from gpugate.host.systemd import (
    active_state,
    own_unit,
    resolve_unit_cgroup,
    systemd_running,
    unit_argument,
    validate_unit_name,
)
from gpugate.integrations.config_files import load_config
from gpugate.report import lines
from gpugate.report.error_text import error_text
from gpugate.report.journal import Reporter, ReporterFactory

Handler = Callable[[argparse.Namespace, "Front"], int]


class Front:
    """What a command may touch, injected by tests; production's real defaults."""

    def __init__(
        self,
        *,
        driver_factory: Callable[[], GpuDriver] = NvmlDriver,
        reporter_factory: ReporterFactory = Reporter,
        roots: HostRoots | None = None,
        environ: Mapping[str, str] | None = None,
        unit_state: Callable[[str], str | None] | None = None,
        cgroup_layout: Callable[[HostRoots], CgroupLayout | None] | None = None,
    ) -> None:
        """roots: injected by tests (or --host-roots), never read from the environment;
        unit_state: a unit's ActiveState for the manual-run check (default: systemd's);
        cgroup_layout: the host's cgroup layout for these roots (default: the real
        /proc/self/mountinfo's where the cgroup root is the real one; a stand-in tree, None,
        is used as it is)."""
        self.driver_factory = driver_factory
        self.reporter_factory = reporter_factory
        self.environ = os.environ if environ is None else environ
        self.given_roots = roots or HostRoots()
        self.unit_state = unit_state or active_state
        self.cgroup_layout = cgroup_layout or _host_cgroup_layout

    def host_roots(self) -> HostRoots:
        """The roots with the cgroup root on the tree systemd tracks units in (a hybrid
        host's /sys/fs/cgroup/unified); HostUnsupported on a v1-only host. Read afresh on
        each call: a command asks once, first, where it needs the host."""
        given = self.given_roots
        layout = self.cgroup_layout(given)
        return given if layout is None else on_unified_hierarchy(given, layout)


def _host_cgroup_layout(roots: HostRoots) -> CgroupLayout | None:
    if roots.cgroup != SYSTEM_CGROUP_ROOT:
        return None  # a stand-in tree (tests, a root that is not this host's): as it is
    return read_cgroup_layout(roots.proc)


def hook_command(args: argparse.Namespace, front: Front) -> int:
    from gpugate.core.run import RunDeps  # noqa: PLC0415
    from gpugate.front.hook import Deps, Hook, run_hook  # noqa: PLC0415
    from gpugate.integrations.unit.manual_guard import manual_run_guard  # noqa: PLC0415
    from gpugate.integrations.unit.shared_host import UnitContext, unit_surroundings  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    roots = front.host_roots()  # first: a host gpugate cannot serve says so before anything
    unit = unit_argument(args.unit) if args.unit else own_unit(roots.proc)
    if unit is None:
        raise UnknownUnit(Problem.UNIT_NOT_GIVEN)
    validate_unit_name(unit)
    loaded = load_config(unit, args.config)
    phase = Phase(args.command)
    manual_refusal = manual_run_guard(
        phase,
        unit,
        front.unit_state,
        front.environ,
        force=args.force,
        dry_run=args.dry_run,
        proc_root=roots.proc,
    )
    context = UnitContext(
        front.environ, roots, manual_refusal=manual_refusal, ignore_leases=args.ignore_leases
    )
    hook = Hook(
        phase,
        unit,
        lambda: resolve_unit_cgroup(unit, roots.cgroup, ask_systemd=roots.ask_systemd),
        metrics_unit=unit,
        surroundings=unit_surroundings(context),
        dry_run=args.dry_run,
        for_uid=args.for_uid,
    )
    deps = Deps(
        front.reporter_factory(unit, args.command),
        RunDeps(roots=roots, driver_factory=front.driver_factory),
    )
    with stopped_by_signals():
        outcome = run_hook(hook, loaded, deps)
    return int(outcome.exit_code)


def slurm_command(args: argparse.Namespace, front: Front) -> int:
    from gpugate.core.run import RunDeps  # noqa: PLC0415
    from gpugate.front.slurm_hook import SlurmDeps, run_slurm_hook  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    with stopped_by_signals():
        deps = SlurmDeps(
            front.environ,
            front.reporter_factory,
            RunDeps(roots=front.host_roots(), driver_factory=front.driver_factory),
        )
        return run_slurm_hook(Phase(args.slurm_phase), args.config, dry_run=args.dry_run, deps=deps)


def config_check_command(args: argparse.Namespace, front: Front) -> int:
    unit = validate_unit_name(unit_argument(args.unit)) if args.unit else None
    loaded = load_config(unit, args.path)
    print(lines.effective_config(loaded.source))
    if unit is not None:
        from gpugate.integrations.unit.gpu_source import choose_gpus, with_chosen_gpus  # noqa: PLC0415

        environment = None if front.given_roots.ask_systemd else (lambda _: None)
        choice = choose_gpus(unit, loaded, environment)
        print(lines.unit_gpus(unit, choice.gpus, choice.source))
        loaded = with_chosen_gpus(loaded, choice)
        if front.given_roots.ask_systemd:
            _warn_environment_files(unit)
    print(to_toml(loaded.config.model_dump(mode="json")))
    return int(ExitCode.OK)


def install_command(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front import install  # noqa: PLC0415

    dirs = {"systemd_dir": args.systemd_dir, "config_dir": args.config_dir}
    unit = unit_argument(args.unit)  # `install vllm` is vllm.service, as for systemctl
    if args.command == "uninstall":
        changes = install.plan_uninstall(unit, force=args.force, **dirs)
    else:
        from gpugate.front.self_command import command_for, gpugate_command  # noqa: PLC0415

        given = args.gpugate_path
        command = command_for(str(given)) if given else gpugate_command()
        changes = install.plan_install(
            unit,
            gpus=args.gpus,
            ports=args.ports,
            containers=args.containers,
            gpugate_path=command,
            force=args.force,
            **dirs,
        )
        if not os.access(command[0], os.X_OK) and not args.dry_run:
            print(lines.not_executable_here(command[0]), file=sys.stderr)
    if args.command == "install" and systemd_running():
        _warn_environment_files(unit)
    reload = (lambda: False) if args.no_reload else install.systemctl_daemon_reload
    changed = install.apply(changes, dry_run=args.dry_run, reload=reload)
    if changed and args.command == "install":
        print(lines.takes_effect(unit))
    return int(ExitCode.OK)


def _warn_environment_files(unit: str) -> None:
    from gpugate.integrations.unit.env_files import unit_environment_warnings  # noqa: PLC0415

    for line in unit_environment_warnings(unit):
        print(lines.error(line), file=sys.stderr)


def status_command(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.status import render_json, render_table  # noqa: PLC0415

    roots = front.host_roots()
    unit = validate_unit_name(unit_argument(args.unit)) if args.unit else None
    loaded = load_config(unit, args.config)
    driver = front.driver_factory()
    try:
        warned: list[str] = []
        while True:
            data = status_data(unit, loaded, driver, roots, warned)
            hung = driver.not_answering()
            if not args.watch:
                print(render_json(data) if args.json else render_table(data), flush=True)
                if hung is not None:
                    print(lines.error(error_text(hung)), file=sys.stderr, flush=True)
                    return int(hung.exit_code)
                return int(ExitCode.GPU_UNREADABLE if data["unreadable_gpus"] else ExitCode.OK)
            if hung is not None:
                raise hung  # --watch: no next look can answer
            # Home and clear the screen, then the table, as watch(1) draws it.
            print(f"\x1b[H\x1b[J{lines.watch_header(unit)}\n\n{render_table(data)}", flush=True)
            time.sleep(1)
    except KeyboardInterrupt:
        return int(ExitCode.OK)  # how --watch ends
    except BrokenPipeError:
        # `gpugate status | head`: the reader has all it wanted. Point stdout at /dev/null so
        # that the interpreter's last flush does not fail once more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    finally:
        driver.close()


def status_data(
    unit: str | None,
    loaded: LoadedConfig,
    driver: GpuDriver,
    roots: HostRoots,
    warned: list[str],
) -> dict[str, Any]:
    """One look for `status`; a warning about unreadable holders is said once (warned)."""
    from gpugate.front.status import (  # noqa: PLC0415
        as_dict,
        collect,
        device_minors,
        state_warnings,
        unreadable_warning,
    )

    try:
        discovery = collect(unit, loaded, driver, roots)
    except NvmlNotAnswering as exc:
        # Hung before it named a GPU: what /dev and /proc show, without NVML.
        discovery = collect(unit, loaded, NotAnswering(exc, device_minors(roots)), roots)
    for warning in [unreadable_warning(discovery), *state_warnings(loaded)]:
        if warning and warning not in warned:  # once, also in --watch
            print(warning, file=sys.stderr, flush=True)
            warned.append(warning)
    return as_dict(discovery, loaded, roots)
