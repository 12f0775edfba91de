"""Command line: `gpugate pre|post|status|config check|slurm` and their exit codes."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpugate import __version__
from gpugate.config import LoadedConfig, load_config, toml_value
from gpugate.errors import ExitCode, GateError, UnknownUnit
from gpugate.nvml import GpuDriver, NvmlDriver
from gpugate.report import PRIORITY_ERR, Event, Reporter
from gpugate.units import own_unit, validate_unit_name

if TYPE_CHECKING:
    from gpugate.pipeline import RunSummary

EPILOG = """exit codes: 0 ok, 1 internal error, 2 usage, 3 config, 4 NVML unavailable,
5 holders survived SIGKILL, 6 memory not freed in time, 7 GPUs held by processes gpugate may
not kill, 8 permission, 9 unknown unit, 10 GPU lock timeout, 11 install/uninstall refused"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        sub.add_argument(
            "--dry-run", action="store_true", help="report what would be killed; kill nothing"
        )
    status = commands.add_parser("status", help="GPUs and the processes holding them")
    _unit_and_config(status)
    status.add_argument("--json", action="store_true", help="stable JSON (see README)")
    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate and print the effective config")
    check.add_argument("path", nargs="?", type=Path, help="file to check (default: lookup)")
    check.add_argument("--unit", help="unit whose lookup to follow (default: default.toml)")
    _install_parsers(commands)
    _slurm_parsers(commands)
    return parser


def _slurm_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    slurm = commands.add_parser("slurm", help="slurm.conf's Prolog= and Epilog= (see README)")
    phases = slurm.add_subparsers(dest="slurm_phase", required=True, metavar="PHASE")
    for phase, text in (
        ("prolog", "Prolog=: make the job's GPUs free before it starts"),
        ("epilog", "Epilog=: kill the job's leftovers on its GPUs and wait; fail to drain"),
    ):
        sub = phases.add_parser(phase, help=text, description=text, epilog=EPILOG)
        sub.add_argument("--config", type=Path, help="config file (default: /etc/gpugate lookup)")
        sub.add_argument(
            "--dry-run", action="store_true", help="report what would be killed; kill nothing"
        )


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
    install.add_argument(
        "--gpus",
        type=_gpus,
        metavar="LIST",
        help="the unit's GPUs for the config: indices and/or UUIDs, comma-separated, or all",
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
    reporter_factory: Callable[[str, str], Reporter] = Reporter,
) -> int:
    args = build_parser().parse_args(argv)
    unit: str | None = None
    reporter: Reporter | None = None
    loaded: LoadedConfig | None = None
    try:
        if args.command == "config":
            return _config_check(args)
        if args.command in ("install", "uninstall"):
            return _install(args)
        if args.command == "slurm":
            from gpugate import slurm  # noqa: PLC0415

            return slurm.main(
                args.slurm_phase,
                config_path=args.config,
                dry_run=args.dry_run,
                environ=os.environ,
                driver_factory=driver_factory,
                reporter_factory=reporter_factory,
            )
        unit = args.unit or (own_unit() if args.command != "status" else None)
        if unit is None and args.command != "status":
            raise UnknownUnit(
                "no UNIT given and gpugate is not running inside a service's cgroup; "
                "pass the unit (%n in a unit file)"
            )
        if unit is not None:
            validate_unit_name(unit)
        loaded = load_config(unit, args.config)
        if args.command == "status":
            return _status(unit, loaded, args.json, driver_factory)
        from gpugate.pipeline import run_phase  # noqa: PLC0415

        assert unit is not None
        reporter = reporter_factory(unit, args.command)
        summary = run_phase(
            args.command,
            unit,
            loaded,
            reporter,
            dry_run=args.dry_run,
            driver_factory=driver_factory,
        )
        if not args.dry_run:
            _record_metrics(loaded, args.command, unit, summary.exit_code, summary)
        return int(summary.exit_code)
    except GateError as exc:
        print(f"gpugate: {exc.message}", file=sys.stderr)
        if reporter is not None:
            reporter.echo = False
            reporter.event(
                Event.ERROR, exc.message, priority=PRIORITY_ERR, exit_code=int(exc.exit_code)
            )
            reporter.status(f"failed: {exc.message}")
            if loaded is not None and unit is not None and not args.dry_run:
                _record_metrics(loaded, args.command, unit, exc.exit_code, None)
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


def _record_metrics(
    loaded: LoadedConfig, phase: str, unit: str, code: ExitCode, summary: RunSummary | None
) -> None:
    if loaded.config.metrics_textfile is None:
        return  # no textfile: the metrics module is not even imported (start-up time)
    from gpugate.metrics import record_after_run, run_record  # noqa: PLC0415

    record_after_run(loaded.config.metrics_textfile, run_record(phase, unit, code, summary))


def _config_check(args: argparse.Namespace) -> int:
    unit = validate_unit_name(args.unit) if args.unit else None
    loaded = load_config(unit, args.path)
    print(f"# effective configuration, from {loaded.source}")
    print(to_toml(loaded.config.model_dump(mode="json")))
    return int(ExitCode.OK)


def _gpus(value: str) -> object:
    from gpugate.install import parse_gpus  # noqa: PLC0415

    try:
        return parse_gpus(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _container(value: str) -> str:
    from gpugate.install import parse_container  # noqa: PLC0415

    try:
        return parse_container(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _install(args: argparse.Namespace) -> int:
    from gpugate import install  # noqa: PLC0415

    dirs = {"systemd_dir": args.systemd_dir, "config_dir": args.config_dir}
    if args.command == "uninstall":
        changes = install.plan_uninstall(args.unit, force=args.force, **dirs)
    else:
        gpugate_path = args.gpugate_path or install.default_gpugate_path()
        changes = install.plan_install(
            args.unit,
            gpus=args.gpus,
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


def _status(
    unit: str | None, loaded: object, as_json: bool, driver_factory: Callable[[], GpuDriver]
) -> int:
    from gpugate.config import LoadedConfig  # noqa: PLC0415
    from gpugate.status import as_dict, collect, render_json, render_table  # noqa: PLC0415

    assert isinstance(loaded, LoadedConfig)
    driver = driver_factory()
    try:
        data = as_dict(collect(unit, loaded, driver), loaded)
    finally:
        driver.close()
    print(render_json(data) if as_json else render_table(data))
    return int(ExitCode.OK)


def to_toml(data: dict[str, object], prefix: str = "") -> str:
    """Enough TOML for gpugate's config: scalars, lists and nested tables."""
    lines: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if value is None:
            lines.append(f"# {key}: not set")
        elif isinstance(value, dict):
            name = f"{prefix}{key}"
            tables.append(f"\n\n[{name}]\n" + to_toml(value, f"{name}."))
        else:
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "".join(tables)
