"""Command line: `gpugate pre|post|status|config check|install|uninstall|slurm`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from gpugate import __version__
from gpugate.config_file import load_config
from gpugate.errors import ExitCode, GateError, UnknownUnit, exit_code_summary
from gpugate.host import HostRoots
from gpugate.nvml import GpuDriver, NvmlDriver
from gpugate.report import Reporter, ReporterFactory
from gpugate.toml_text import to_toml
from gpugate.units import own_unit, resolve_unit_cgroup, unit_argument, validate_unit_name

EPILOG = "\n".join(textwrap.wrap("exit codes: " + exit_code_summary(), 92))
Handler = Callable[[argparse.Namespace, "Front"], int]


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 64 (EX_USAGE), not argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.USAGE), f"{self.prog}: error: {message}\n")


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
    ) -> None:
        """unit_state: a unit's ActiveState for the manual-run check (default: systemd's)."""
        self.driver_factory = driver_factory
        self.reporter_factory = reporter_factory
        self.environ = os.environ if environ is None else environ
        self._roots = roots
        self.unit_state = unit_state or _systemd_active_state

    @property
    def roots(self) -> HostRoots:
        if self._roots is None:
            self._roots = HostRoots.from_environ(self.environ)
        return self._roots


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="gpugate",
        description="Leave a systemd unit's GPUs truly free: find every holder, kill exactly "
        "those, wait until NVML reports the memory freed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpugate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for phase, text in (
        ("pre", "ExecStartPre=: make the unit's GPUs free before it starts"),
        ("post", "ExecStopPost=: reap what is left after the unit stopped, and wait"),
    ):
        sub = commands.add_parser(phase, help=text, description=text, epilog=EPILOG)
        _unit_and_config(sub)
        _dry_run(sub)
        sub.add_argument(
            "--force",
            action="store_true",
            help="run by hand even while the unit is active (kills the running service)",
        )
        sub.set_defaults(func=_hook)
    status = commands.add_parser("status", help="GPUs and the processes holding them")
    _unit_and_config(status)
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="stable JSON (see README)")
    shown.add_argument(
        "--watch", action="store_true", help="redraw the table every second, as watch(1) does"
    )
    status.set_defaults(func=_status)
    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate and print the effective config")
    check.add_argument("path", nargs="?", type=Path, help="file to check (default: lookup)")
    check.add_argument("--unit", help="unit whose lookup to follow (default: default.toml)")
    check.set_defaults(func=_config_check)
    _install_parsers(commands)
    _slurm_parsers(commands)
    return parser


def _dry_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="report what would be killed; kill nothing"
    )


def _slurm_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    slurm = commands.add_parser("slurm", help="slurm.conf's Prolog= and Epilog= (see README)")
    phases = slurm.add_subparsers(dest="slurm_phase", required=True, metavar="PHASE")
    for phase, text in (
        ("prolog", "Prolog=: make the job's GPUs free before it starts"),
        ("epilog", "Epilog=: kill the job's leftovers on its GPUs and wait; fail to drain"),
    ):
        sub = phases.add_parser(phase, help=text, description=text, epilog=EPILOG)
        sub.add_argument("--config", type=Path, help="config file (default: /etc/gpugate lookup)")
        _dry_run(sub)
        sub.set_defaults(func=_slurm)


def _install_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    install = commands.add_parser(
        "install",
        help="put gpugate on a unit: /etc/systemd/system/UNIT.d/gpugate.conf, "
        "/etc/gpugate/UNIT.toml, daemon-reload",
    )
    uninstall = commands.add_parser("uninstall", help="take gpugate off a unit (install, reversed)")
    for sub in (install, uninstall):
        sub.add_argument("unit", help="a service (vllm.service) or template (vllm@.service)")
        sub.add_argument("--force", action="store_true", help="replace or remove edited files")
        sub.add_argument("--dry-run", action="store_true", help="print what it would do; do it not")
        sub.add_argument("--no-reload", action="store_true", help="skip systemctl daemon-reload")
        sub.add_argument("--systemd-dir", type=Path, default=Path("/etc/systemd/system"))
        sub.add_argument("--config-dir", type=Path, default=Path("/etc/gpugate"))
        sub.set_defaults(func=_install)
    install.add_argument(
        "--gpus",
        type=_gpus,
        metavar="LIST",
        help="the unit's GPUs for the config: indices and/or UUIDs, comma-separated, or all",
    )
    install.add_argument(
        "--port",
        type=_port,
        action="append",
        dest="ports",
        metavar="N",
        help="a TCP port of the unit for the config (repeatable): pre frees it before the start",
    )
    install.add_argument(
        "--container",
        dest="containers",
        action="append",
        type=_container,
        default=[],
        metavar="NAME",
        help="a container (name or id) whose processes are the unit's own, as `docker run "
        "--name NAME` in its ExecStart=; repeat for more",
    )
    install.add_argument(
        "--gpugate-path",
        type=Path,
        help="the gpugate ExecStartPre= runs (default: /usr/bin/gpugate, else the one on PATH)",
    )


def _unit_and_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "unit", nargs="?", help="the unit (%%n in a unit file); default: the unit gpugate runs in"
    )
    parser.add_argument("--config", type=Path, help="config file (default: /etc/gpugate lookup)")


def main(
    argv: Sequence[str] | None = None,
    *,
    driver_factory: Callable[[], GpuDriver] = NvmlDriver,
    reporter_factory: ReporterFactory = Reporter,
    roots: HostRoots | None = None,
    unit_state: Callable[[str], str | None] | None = None,
) -> int:
    args = build_parser().parse_args(argv)
    front = Front(
        driver_factory=driver_factory,
        reporter_factory=reporter_factory,
        roots=roots,
        unit_state=unit_state,
    )
    handler: Handler = args.func
    try:
        return handler(args, front)
    except GateError as exc:
        print(f"gpugate: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        print(
            f"gpugate: internal error: {type(exc).__name__}: {exc} "
            "(set GPUGATE_DEBUG=1 for a traceback, and please report it)",
            file=sys.stderr,
        )
        return int(ExitCode.INTERNAL)


def run() -> None:
    """The `gpugate` command: main(), then exit without tearing the interpreter down.

    Freeing pydantic's and pynvml's modules one by one takes ~40 ms, all of it after the GPUs
    are free and before systemd may start the unit. Everything gpugate reports is already sent
    (journald, sd_notify) or written; only Python's own stream buffers need flushing.
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to say there
            stream.flush()
    os._exit(code)


def _systemd_active_state(unit: str) -> str | None:
    from gpugate.units import query_unit  # noqa: PLC0415

    state = query_unit(unit)
    return state.active_state if state is not None else None


def _hook(args: argparse.Namespace, front: Front) -> int:
    from gpugate.hook import Hook, run_hook  # noqa: PLC0415
    from gpugate.hook_guard import manual_run_guard  # noqa: PLC0415

    unit = unit_argument(args.unit) if args.unit else own_unit()
    if unit is None:
        raise UnknownUnit(
            "no UNIT given and gpugate is not running inside a service's cgroup; "
            "pass the unit (%n in a unit file)"
        )
    validate_unit_name(unit)
    loaded = load_config(unit, args.config)
    roots = front.roots
    hook = Hook(
        args.command,
        unit,
        lambda: resolve_unit_cgroup(unit, roots.cgroup, ask_systemd=roots.ask_systemd),
        metrics_unit=unit,
    )
    manual_refusal = manual_run_guard(
        args.command,
        unit,
        front.unit_state,
        front.environ,
        force=args.force,
        dry_run=args.dry_run,
        proc_root=roots.proc,
    )
    outcome = run_hook(
        hook,
        loaded,
        front.reporter_factory(unit, args.command),
        roots=roots,
        dry_run=args.dry_run,
        driver_factory=front.driver_factory,
        environ=front.environ,
        manual_refusal=manual_refusal,
    )
    return int(outcome.exit_code)


def _slurm(args: argparse.Namespace, front: Front) -> int:
    from gpugate import slurm  # noqa: PLC0415

    return slurm.main(
        args.slurm_phase,
        config_path=args.config,
        dry_run=args.dry_run,
        environ=front.environ,
        driver_factory=front.driver_factory,
        reporter_factory=front.reporter_factory,
        roots=front.roots,
    )


def _config_check(args: argparse.Namespace, front: Front) -> int:
    unit = validate_unit_name(unit_argument(args.unit)) if args.unit else None
    loaded = load_config(unit, args.path)
    print(f"# effective configuration, from {loaded.source}")
    if unit is not None:
        from gpugate.gpu_source import choose_gpus, with_chosen_gpus  # noqa: PLC0415

        environment = None if front.roots.ask_systemd else (lambda _: None)
        choice = choose_gpus(unit, loaded, environment)
        shown = "all" if choice.gpus == "all" else ", ".join(map(str, choice.gpus)) or "none"
        print(f"# {unit}'s GPUs: {shown}, from {choice.source}")
        loaded = with_chosen_gpus(loaded, choice)
    print(to_toml(loaded.config.model_dump(mode="json")))
    return int(ExitCode.OK)


def _gpus(value: str) -> object:
    from gpugate.install import parse_gpus  # noqa: PLC0415

    try:
        return parse_gpus(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (1-65535)")
    return int(value)


def _container(value: str) -> str:
    from gpugate.install import parse_container  # noqa: PLC0415

    try:
        return parse_container(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _install(args: argparse.Namespace, front: Front) -> int:
    from gpugate import install, install_files  # noqa: PLC0415

    dirs = {"systemd_dir": args.systemd_dir, "config_dir": args.config_dir}
    args.unit = unit_argument(args.unit)  # `install vllm` is vllm.service, as for systemctl
    if args.command == "uninstall":
        changes = install.plan_uninstall(args.unit, force=args.force, **dirs)
    else:
        gpugate_path = args.gpugate_path or install_files.default_gpugate_path()
        changes = install.plan_install(
            args.unit,
            gpus=args.gpus,
            ports=args.ports,
            containers=args.containers,
            gpugate_path=gpugate_path,
            force=args.force,
            **dirs,
        )
        if not os.access(gpugate_path, os.X_OK) and not args.dry_run:
            print(f"gpugate: warning: {gpugate_path} is not an executable here", file=sys.stderr)
    reload = (lambda: False) if args.no_reload else install.systemctl_daemon_reload
    changed = install.apply(changes, dry_run=args.dry_run, reload=reload)
    if changed and args.command == "install":
        print(f"takes effect at the next start: systemctl restart {args.unit}")
    return int(ExitCode.OK)


def _status(args: argparse.Namespace, front: Front) -> int:
    from gpugate.status import (  # noqa: PLC0415
        as_dict,
        collect,
        render_json,
        render_table,
        unreadable_warning,
    )

    unit = validate_unit_name(unit_argument(args.unit)) if args.unit else None
    loaded = load_config(unit, args.config)
    roots = front.roots
    driver = front.driver_factory()
    try:
        warned = False
        while True:
            discovery = collect(unit, loaded, driver, roots)
            warning = unreadable_warning(discovery)
            if warning and not warned:  # once, also in --watch
                print(warning, file=sys.stderr, flush=True)
                warned = True
            data = as_dict(discovery, loaded, roots)
            if not args.watch:
                print(render_json(data) if args.json else render_table(data), flush=True)
                return int(ExitCode.GPU_UNREADABLE if data["unreadable_gpus"] else ExitCode.OK)
            # Home and clear the screen, then the table, as watch(1) draws it.
            header = f"every 1 s: gpugate status{' ' + unit if unit else ''}    (Ctrl-C ends)"
            print(f"\x1b[H\x1b[J{header}\n\n{render_table(data)}", flush=True)
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
