"""Command line: `gpugate pre|post|status|config check|install|uninstall|run|slurm`: the
parser and main(). Each command is a typed function in a module of its own (`front/commands/`,
pipx's layout); the parser stores with each command the function that calls it (`run=`), so
main() dispatches without looking a name up.

Only the parser is imported up front: `--help`, `--version` and a usage error import no
pydantic, no pynvml, no psutil (issue 30; tests/commands/test_cli.py checks it). Each command's
module, and everything it needs, is imported once the command line is parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import textwrap

from gpugate import __version__
from gpugate.errors import ExitCode, GateError, InvalidValue, exit_code_summary

# Loaded with the package (gpugate/__init__.py: every error's message is its words).

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from typing import NoReturn

    from gpugate.front.commands import Front
    from gpugate.host.nvml import GpuDriver
    from gpugate.host.roots import CgroupLayout, HostRoots
    from gpugate.report.journal import ReporterFactory

HOST_ROOTS_OPTION = "--host-roots"  # host.roots.OPTION; not imported (its dataclasses), test_cli

CONTAINERS_HELP = (
    "instead of a unit: gpugate's OCI hook for podman, CRI-O and docker (hooks.d files, "
    "docker's gpugate runtime; see docs/containers.md)"
)
EPILOG = "\n".join(textwrap.wrap("exit codes: " + exit_code_summary(), 92))


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 64 (EX_USAGE), not argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.USAGE), f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="gpugate",
        description="Leave a systemd unit's GPUs truly free: find every holder, kill exactly "
        "those, wait until NVML reports the memory freed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpugate {__version__}")
    _stand_in_options(parser)
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
        # `gpugate run --force` writes it on its unit's ExecStartPre=: other units' leases are
        # warned about, not refused. Hidden: not for hand use, never from the environment.
        sub.add_argument("--ignore-leases", action="store_true", help=argparse.SUPPRESS)
        # `gpugate run` by an account that is not root writes it on both hook lines: kill only
        # that account's processes (it narrows, never widens; docs/gpugate-run.md).
        sub.add_argument("--for-uid", type=_uid, metavar="UID", help=argparse.SUPPRESS)
        sub.set_defaults(run=_pre_post)
    _status_parser(commands)
    sweep = commands.add_parser("sweep", help="between starts: GPU memory nobody owns, said/reaped")
    sweep.add_argument("--config", type=_path, help="config file (default: /etc/gpugate lookup)")
    sweep.set_defaults(run=_sweep)
    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate and print the effective config")
    check.add_argument("path", nargs="?", type=_path, help="file to check (default: lookup)")
    check.add_argument("--unit", help="unit whose lookup to follow (default: default.toml)")
    check.set_defaults(run=_config_check)
    _install_parsers(commands)
    _oci_parsers(commands)
    _launch_parser(commands)
    _slurm_parsers(commands)
    return parser


def _status_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = commands.add_parser("status", help="GPUs and the processes holding them")
    _unit_and_config(status)
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="stable JSON (see README)")
    shown.add_argument(
        "--watch", action="store_true", help="redraw the table every second, as watch(1) does"
    )
    status.set_defaults(run=_status)


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
        sub.add_argument("--config", type=_path, help="config file (default: /etc/gpugate lookup)")
        _dry_run(sub)
        sub.set_defaults(run=_slurm)
    text = (
        "say whether each job gets its own /dev/shm (job_container/tmpfs) and whether "
        "gres.conf resolves every GPU to an NVML GPU"
    )
    check = phases.add_parser("check", help=text, description=text, epilog=EPILOG)
    check.add_argument("--node", help="the node's Slurm name (default: the short host name)")
    check.set_defaults(run=_slurm_check)


DEFAULT_HELP = "with --containers: make gpugate containerd's CRI default runtime"


def _install_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    install = commands.add_parser(
        "install",
        help="put gpugate on a unit: /etc/systemd/system/UNIT.d/gpugate.conf, "
        "/etc/gpugate/UNIT.toml, daemon-reload",
    )
    uninstall = commands.add_parser("uninstall", help="take gpugate off a unit (install, reversed)")
    for sub in (install, uninstall):
        sub.add_argument(
            "unit", nargs="?", help="a service (vllm.service) or template (vllm@.service)"
        )
        sub.add_argument("--containers", dest="oci", action="store_true", help=CONTAINERS_HELP)
        sub.add_argument("--sweep", action="store_true", help="gpugate-sweep.timer, enabled")
        sub.add_argument("--force", action="store_true", help="replace or remove edited files")
        sub.add_argument("--dry-run", action="store_true", help="print what it would do; do it not")
        sub.add_argument("--no-reload", action="store_true", help="skip systemctl daemon-reload")
        sub.add_argument("--systemd-dir", type=_path, default="/etc/systemd/system")
        sub.add_argument("--config-dir", type=_path, default="/etc/gpugate")
    install.set_defaults(run=_install)
    uninstall.set_defaults(run=_uninstall)
    install.add_argument("--default", action="store_true", help=DEFAULT_HELP)
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
        type=_path,
        help="the gpugate ExecStartPre= runs (default: /usr/bin/gpugate, else the one on PATH)",
    )


def _oci_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Shown in --help; the command itself never reaches this parser (front/entry.py)."""
    hook = commands.add_parser(
        "oci-hook",
        help="OCI runtime hook: free a container's GPUs before it starts, after it stops",
    )
    hook.add_argument("stage", help="createRuntime, prestart or poststop (state on stdin)")
    hook.add_argument("--config", type=_path, help="default: /etc/gpugate/containers.toml")
    hook.set_defaults(run=_oci_hook)
    runtime = commands.add_parser(
        "oci-runtime", help="runc with gpugate's hooks added to GPU containers (docker's runtime)"
    )
    runtime.add_argument("args", nargs=argparse.REMAINDER, help="runc's arguments")
    runtime.set_defaults(run=_oci_runtime)


def _launch_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = (
        "run COMMAND as a transient service with gpugate's hooks: its GPUs leased, its whole "
        "cgroup stopped and GPUs freed on Ctrl-C, a closed terminal or systemctl stop"
    )
    run = commands.add_parser(
        "run",
        help=text,
        description=text + " (see docs/gpugate-run.md)",
        usage="gpugate run [-h] [--gpus LIST] [--port N]... [--name NAME] [--config PATH] "
        "[--force] -- COMMAND [ARGS...]",
        epilog=EPILOG,
    )
    run.add_argument(
        "--gpus",
        type=_gpus,
        metavar="LIST",
        help="the GPUs (indices and/or UUIDs, or all); default: your CUDA_VISIBLE_DEVICES, "
        "else all",
    )
    run.add_argument(
        "--port",
        type=_port,
        action="append",
        dest="ports",
        metavar="N",
        help="a TCP port the command listens on (repeatable): pre frees it (needs root)",
    )
    run.add_argument("--name", help="the unit's name (default: gpugate-run-COMMAND-ID.service)")
    run.add_argument("--config", type=_path, help="config file for the hooks (default: lookup)")
    run.add_argument(
        "--force", action="store_true", help="run even onto GPUs leased to a running unit"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="COMMAND [ARGS...], after --")
    run.set_defaults(run=_launch)


def _stand_in_options(parser: argparse.ArgumentParser) -> None:
    # Stand-in /dev, /proc and cgroup tree for tests and the bench (docs/hardening.md); not
    # shown in --help, never in the unit drop-in, and never taken from the environment.
    parser.add_argument(HOST_ROOTS_OPTION, dest="host_roots", help=argparse.SUPPRESS)
    # A stand-in libnvidia-ml.so.1 by its path (tests, the bench); never LD_LIBRARY_PATH.
    parser.add_argument("--nvml-library", dest="nvml_library", help=argparse.SUPPRESS)


def _unit_and_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "unit", nargs="?", help="the unit (%%n in a unit file); default: the unit gpugate runs in"
    )
    parser.add_argument("--config", type=_path, help="config file (default: /etc/gpugate lookup)")


def main(
    argv: Sequence[str] | None = None,
    *,
    driver_factory: Callable[[], GpuDriver] | None = None,
    reporter_factory: ReporterFactory | None = None,
    roots: HostRoots | None = None,
    unit_state: Callable[[str], str | None] | None = None,
    cgroup_layout: Callable[[HostRoots], CgroupLayout | None] | None = None,
) -> int:
    """driver_factory, reporter_factory: injected by tests; None: NVML's and journald's."""
    args = build_parser().parse_args(argv)
    try:
        from gpugate.front.commands import Front  # noqa: PLC0415
        from gpugate.host.roots import HostRoots  # noqa: PLC0415

        command: Callable[[argparse.Namespace, Front], int] = args.run
        if args.host_roots is not None:
            roots = HostRoots.parse(args.host_roots)
        if args.nvml_library is not None and driver_factory is None:
            from gpugate.host.nvml import NvmlDriver  # noqa: PLC0415

            driver_factory = functools.partial(NvmlDriver, library=args.nvml_library)
        front = Front(
            driver_factory=driver_factory,
            reporter_factory=reporter_factory,
            roots=roots,
            unit_state=unit_state,
            cgroup_layout=cgroup_layout,
        )
        return command(args, front)
    except GateError as exc:
        from gpugate.report import lines  # noqa: PLC0415 (an error's words only)

        print(lines.error(_line(exc.message)), file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        from gpugate.report import lines  # noqa: PLC0415 (an error's words only)

        print(lines.error(lines.internal_error_text(exc)), file=sys.stderr)
        return int(ExitCode.INTERNAL)


# Each command's call: its module imported now, its function given the command line's values.


def _pre_post(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands.pre_post import pre_post  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    return pre_post(
        front,
        Phase(args.command),
        args.unit,
        args.config,
        dry_run=args.dry_run,
        force=args.force,
        ignore_leases=args.ignore_leases,
        for_uid=args.for_uid,
    )


def _slurm(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands.slurm import slurm  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    return slurm(front, Phase(args.slurm_phase), args.config, dry_run=args.dry_run)


def _slurm_check(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.slurm_check import slurm_check  # noqa: PLC0415
    from gpugate.integrations.slurm_gpus import DeviceNodes  # noqa: PLC0415

    nodes = DeviceNodes(front.host_roots().dev)
    return slurm_check(front.environ, args.node, front.driver_factory, nodes)


def _sweep(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.sweep import sweep  # noqa: PLC0415

    return sweep(args.config, front)


def _status(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands.status import status  # noqa: PLC0415

    return status(front, args.unit, args.config, as_json=args.json, watch=args.watch)


def _config_check(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands.config_check import config_check  # noqa: PLC0415

    return config_check(front, args.path, args.unit)


def _install(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands import install as command  # noqa: PLC0415

    if args.sweep and args.unit is None and not args.oci:
        return _sweep_setup(args, installing=True, gpugate_path=args.gpugate_path)
    if args.oci != (args.unit is None) or args.sweep:
        return command.unit_or_containers("install")
    if args.oci:
        return command.containers_setup(
            True,
            force=args.force,
            dry_run=args.dry_run,
            no_reload=args.no_reload,
            given=args.gpugate_path,
            default=args.default,
        )
    return command.install(
        args.unit,
        force=args.force,
        dry_run=args.dry_run,
        no_reload=args.no_reload,
        systemd_dir=args.systemd_dir,
        config_dir=args.config_dir,
        gpus=args.gpus,
        ports=args.ports,
        containers=args.containers,
        gpugate_path=args.gpugate_path,
    )


def _uninstall(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.commands import install as command  # noqa: PLC0415

    if args.sweep and args.unit is None and not args.oci:
        return _sweep_setup(args, installing=False)
    if args.oci != (args.unit is None) or args.sweep:
        return command.unit_or_containers("uninstall")
    if args.oci:
        return command.containers_setup(
            False, force=args.force, dry_run=args.dry_run, no_reload=args.no_reload
        )
    return command.uninstall(
        args.unit,
        force=args.force,
        dry_run=args.dry_run,
        no_reload=args.no_reload,
        systemd_dir=args.systemd_dir,
        config_dir=args.config_dir,
    )


def _sweep_setup(
    args: argparse.Namespace, *, installing: bool, gpugate_path: Path | None = None
) -> int:
    """`gpugate install|uninstall --sweep` (front/install_sweep.py)."""
    from gpugate.front.install_sweep import sweep_setup  # noqa: PLC0415

    return sweep_setup(
        installing,
        systemd_dir=args.systemd_dir,
        dry_run=args.dry_run,
        no_reload=args.no_reload,
        gpugate_path=gpugate_path,
    )


def _oci_hook(args: argparse.Namespace, front: Front) -> int:
    """`gpugate [--host-roots ...] oci-hook STAGE` where the fast entry did not take it."""
    from gpugate.front.oci_entry import main as oci_hook  # noqa: PLC0415

    return oci_hook(
        [args.stage],
        roots=front.host_roots(),
        config=args.config,
        driver_factory=front.driver_factory,
    )


def _oci_runtime(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.oci_runtime import main as oci_runtime  # noqa: PLC0415

    return oci_runtime(args.args)


def _launch(args: argparse.Namespace, front: Front) -> int:
    from gpugate.front.launch import launch_command  # noqa: PLC0415

    return launch_command(args, front)


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


def _gpus(value: str) -> object:
    from gpugate.front.install import parse_gpus  # noqa: PLC0415

    try:
        return parse_gpus(value)
    except InvalidValue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _line(text: str) -> str:
    from gpugate.untrusted import line  # noqa: PLC0415 (an error's words only)

    return line(text)


def _path(value: str) -> Path:
    from pathlib import Path  # noqa: PLC0415  (pathlib is not needed for --help)

    return Path(value)


def _uid(value: str) -> int:
    from gpugate.front.launch_unit import parse_uid  # noqa: PLC0415

    uid = parse_uid(value)
    if uid is None:
        raise argparse.ArgumentTypeError(f"{value[:20]!r} is not a uid")
    return uid


def _port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (1-65535)")
    return int(value)


def _container(value: str) -> str:
    from gpugate.front.install import parse_container  # noqa: PLC0415

    try:
        return parse_container(value)
    except InvalidValue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
