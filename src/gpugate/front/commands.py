"""The command handlers `cli` dispatches to: each takes the parsed arguments and what it may
touch (`Front`), and returns the exit code."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpugate.errors import ExitCode, NvmlNotAnswering, Problem, UnknownUnit
from gpugate.front.interrupt import stopped_by_signals
from gpugate.host.cgroups import CgroupLayout, host_cgroup_layout, on_units_tree
from gpugate.host.nvml import GpuDriver, NotAnswering, NvmlDriver
from gpugate.host.roots import HostRoots
from gpugate.host.systemd import (
    active_state,
    own_unit,
    resolve_unit_cgroup,
    systemd_running,
    unit_argument,
    validate_unit_name,
)
from gpugate.report import lines
from gpugate.report.error_text import error_text
from gpugate.report.journal import Reporter, ReporterFactory

if TYPE_CHECKING:
    from gpugate.config.models import LoadedConfig
    from gpugate.core.discover import DeviceScanner

# The config's modules (pydantic, and the models built with it: most of the start-up) are
# imported by the commands that read a config, not by `--help`, `--version` or a usage error.

Handler = Callable[[argparse.Namespace, "Front"], int]


class Front:
    """What a command may touch, injected by tests; production's real defaults."""

    def __init__(
        self,
        *,
        driver_factory: Callable[[], GpuDriver] | None = None,
        reporter_factory: ReporterFactory | None = None,
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
        self.driver_factory: Callable[[], GpuDriver] = driver_factory or NvmlDriver
        self.reporter_factory: ReporterFactory = reporter_factory or Reporter
        self.environ = os.environ if environ is None else environ
        self.given_roots = roots or HostRoots()
        self.unit_state = unit_state or active_state
        self.cgroup_layout = cgroup_layout or host_cgroup_layout

    def host_roots(self) -> HostRoots:
        """The roots with the cgroup root on the tree systemd tracks units in (a hybrid
        host's /sys/fs/cgroup/unified); HostUnsupported on a v1-only host. Read afresh on
        each call: a command asks once, first, where it needs the host."""
        return on_units_tree(self.given_roots, self.cgroup_layout)


def hook_command(args: argparse.Namespace, front: Front) -> int:
    from gpugate.core.run import RunDeps  # noqa: PLC0415
    from gpugate.front.hook import Deps, Hook, run_hook  # noqa: PLC0415
    from gpugate.integrations.config_files import load_config  # noqa: PLC0415
    from gpugate.integrations.unit.shared_host import UnitContext, unit_surroundings  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    roots = front.host_roots()  # first: a host gpugate cannot serve says so before anything
    unit = unit_argument(args.unit) if args.unit else own_unit(roots.proc)
    if unit is None:
        raise UnknownUnit(Problem.UNIT_NOT_GIVEN)
    validate_unit_name(unit)
    loaded = load_config(unit, args.config)
    phase = Phase(args.command)
    context = UnitContext(
        front.environ,
        roots,
        guard_manual_run=not (args.force or args.dry_run),
        active_state=front.unit_state,
        ignore_leases=args.ignore_leases,
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
    from gpugate.config.toml_text import to_toml  # noqa: PLC0415
    from gpugate.integrations.config_files import load_config  # noqa: PLC0415

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

    if args.oci != (args.unit is None):
        print(lines.unit_or_containers(args.command), file=sys.stderr)
        return int(ExitCode.USAGE)
    if args.oci:
        return containers_install_command(args)
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
    from gpugate.integrations.config_files import load_config  # noqa: PLC0415

    roots = front.host_roots()
    unit = validate_unit_name(unit_argument(args.unit)) if args.unit else None
    loaded = load_config(unit, args.config)
    driver = front.driver_factory()
    try:
        warned: list[str] = []
        look = Look(unit, loaded, driver, roots, warned)
        if args.watch:
            from gpugate.host.scan_watch import WatchScan  # noqa: PLC0415

            look.scanner = WatchScan()
        while True:
            data = look()
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


class Look:
    """One look for `status`, again at each --watch tick; a warning about unreadable holders is
    said once (warned). Each look reads /proc with one ProcFs, in one oneshot(): discovery and
    the JSON's rules share what it read."""

    def __init__(
        self,
        unit: str | None,
        loaded: LoadedConfig,
        driver: GpuDriver,
        roots: HostRoots,
        warned: list[str],
    ) -> None:
        from gpugate.core.discover import full_scan  # noqa: PLC0415

        self.unit = unit
        self.loaded = loaded
        self.driver = driver
        self.roots = roots
        self.warned = warned
        self.scanner: DeviceScanner = full_scan

    def __call__(self) -> dict[str, Any]:
        from gpugate.front.status import (  # noqa: PLC0415
            as_dict,
            collect,
            device_minors,
            state_warnings,
            unreadable_warning,
        )
        from gpugate.host.procfs import ProcFs  # noqa: PLC0415

        unit, loaded, roots = self.unit, self.loaded, self.roots
        procfs = ProcFs(roots.proc)
        with procfs.oneshot():
            try:
                discovery = collect(
                    unit, loaded, self.driver, roots, procfs=procfs, scanner=self.scanner
                )
            except NvmlNotAnswering as exc:
                # Hung before it named a GPU: what /dev and /proc show, without NVML.
                driver = NotAnswering(exc, device_minors(roots))
                discovery = collect(unit, loaded, driver, roots, procfs=procfs)
            for warning in [unreadable_warning(discovery), *state_warnings(loaded)]:
                if warning and warning not in self.warned:  # once, also in --watch
                    print(warning, file=sys.stderr, flush=True)
                    self.warned.append(warning)
            return as_dict(discovery, loaded, roots, procfs)


def containers_install_command(args: argparse.Namespace) -> int:
    """`gpugate install|uninstall --containers` (front/install_containers.py)."""
    from gpugate.front import install  # noqa: PLC0415
    from gpugate.front import install_containers as oci  # noqa: PLC0415

    installing = args.command == "install"
    host = oci.detect()
    given = getattr(args, "gpugate_path", None)
    # This very gpugate: the script it was run as (the packages' launcher isolates Python
    # itself; a venv's console script is run as it is, see docs/containers.md).
    script = str(given) if given else os.path.abspath(sys.argv[0])
    command = (script,)
    changes = oci.plan_hooks(host, command, install=installing, force=args.force)
    if host.daemon_json is not None:
        wrapper = oci.wrapper_beside(script) if installing else ""
        changes += oci.plan_daemon_json(host, wrapper, install=installing)
    if not changes:
        from gpugate.report.oci_text import NOTHING_TO_SET_UP  # noqa: PLC0415

        print(NOTHING_TO_SET_UP)
        return int(ExitCode.OK)
    install.apply(changes, dry_run=args.dry_run, reload=lambda: False)
    docker_changed = any(
        c.path == host.daemon_json and c.action is install.Action.WRITE for c in changes
    )
    if docker_changed and not args.dry_run and not args.no_reload:
        print(oci.reload_docker())
    return int(ExitCode.OK)


def oci_command(args: argparse.Namespace, front: Front) -> int:
    """`gpugate [--host-roots ...] oci-hook STAGE` where the fast entry did not take it."""
    if args.command == "oci-runtime":
        from gpugate.front.oci_runtime import main as runtime  # noqa: PLC0415

        return runtime(args.args)
    from gpugate.front.oci_entry import main  # noqa: PLC0415

    return main([args.stage], roots=front.host_roots(), config=args.config)
