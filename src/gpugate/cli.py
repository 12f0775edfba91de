"""Command line: `gpugate pre|post|status|config check` and their exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpugate import __version__
from gpugate.config import load_config
from gpugate.errors import ExitCode, GateError, UnknownUnit
from gpugate.nvml import GpuDriver, NvmlDriver
from gpugate.report import PRIORITY_ERR, Event, Reporter
from gpugate.units import own_unit, validate_unit_name

EPILOG = """exit codes: 0 ok, 1 internal error, 2 usage, 3 config, 4 NVML unavailable,
5 holders survived SIGKILL, 6 memory not freed in time, 7 GPUs held by processes gpugate may
not kill, 8 permission, 9 unknown unit, 10 GPU lock timeout"""


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
    return parser


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
    try:
        if args.command == "config":
            return _config_check(args)
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
        return int(summary.exit_code)
    except GateError as exc:
        print(f"gpugate: {exc.message}", file=sys.stderr)
        if reporter is not None:
            reporter.echo = False
            reporter.event(
                Event.ERROR, exc.message, priority=PRIORITY_ERR, exit_code=int(exc.exit_code)
            )
            reporter.status(f"failed: {exc.message}")
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


def _config_check(args: argparse.Namespace) -> int:
    unit = validate_unit_name(args.unit) if args.unit else None
    loaded = load_config(unit, args.path)
    print(f"# effective configuration, from {loaded.source}")
    print(to_toml(loaded.config.model_dump(mode="json")))
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
        if isinstance(value, dict):
            name = f"{prefix}{key}"
            tables.append(f"\n\n[{name}]\n" + to_toml(value, f"{name}."))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "".join(tables)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
