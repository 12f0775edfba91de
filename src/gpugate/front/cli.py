"""Command line: the parser and main(). Only the parser is imported up front (--help,
--version and a usage error import no pydantic, pynvml or psutil); main() builds only the named
command's parser, and imports that command's module once the command line is parsed."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap

from gpugate import __version__
from gpugate.errors import ExitCode, GateError, InvalidValue, exit_code_summary

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from typing import Any, NoReturn

    from gpugate.front.hook import HostAccess
    from gpugate.host.nvml import GpuDriver
    from gpugate.host.systemd import CgroupLayout, HostRoots
    from gpugate.report.journal import ReporterFactory

    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    SubParsers = argparse._SubParsersAction  # not subscriptable at run time

HOST_ROOTS_OPTION = "--host-roots"  # host.systemd.HOST_ROOTS_OPTION; not imported

EPILOG = "\n".join(textwrap.wrap("exit codes: " + exit_code_summary(), 92))


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 64 (EX_USAGE); raw: line breaks kept."""

    def __init__(self, *, raw: bool = False, **kwargs: Any) -> None:
        formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
        super().__init__(formatter_class=functools.partial(formatter, width=_width()), **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.USAGE), f"{self.prog}: error: {message}\n")


def _width() -> int:
    """argparse's help width without importing shutil (its bz2, lzma cost --help 2 ms)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0 and sys.__stdout__ is not None:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (ValueError, OSError):  # closed, detached, not a terminal
            columns = 0
    return (columns if columns > 0 else 80) - 2


class Commands(SubParsers):
    """The commands, each parser built once argparse reaches it (lazy), else at once (tests and
    docs walk every parser)."""

    later: dict[str, Callable[[], None]]

    def build(self, name: str) -> None:
        if name in self.later:
            del self._name_parser_map[name]  # add_parser refuses a name it holds
            self.later.pop(name)()

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        self.build(values[0] if isinstance(values, list) else "")
        super().__call__(parser, namespace, values, option_string)


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    parser = Parser(
        prog="gpugate",
        raw=True,
        description="Leave a systemd unit's GPUs truly free: find every holder, kill exactly "
        "those, wait until NVML reports the memory freed.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"gpugate {__version__}")
    # Stand-in /dev, /proc, cgroup tree and libnvidia-ml.so.1 for tests and the bench
    # (docs/hardening.md): hidden, never in the drop-in, never from the environment.
    parser.add_argument(HOST_ROOTS_OPTION, dest="host_roots", help=argparse.SUPPRESS)
    parser.add_argument("--nvml-library", dest="nvml_library", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(
        action=Commands, dest="command", required=True, metavar="COMMAND"
    )
    assert isinstance(commands, Commands)
    commands.later = {}
    for name, text, build in COMMANDS:
        commands._choices_actions.append(commands._ChoicesPseudoAction(name, (), text))
        commands._name_parser_map[name] = None  # type: ignore[assignment]  # accepted, not built
        commands.later[name] = functools.partial(build, commands, name, text)
    for name in () if lazy else list(commands.later):
        commands.build(name)
    return parser


def _phase_parser(commands: Commands, name: str, text: str) -> None:
    sub = commands.add_parser(name, description=text, epilog=EPILOG)
    _unit_and_config(sub)
    _dry_run(sub)
    sub.add_argument(
        "--force",
        action="store_true",
        help="run by hand even while the unit is active (kills the running service)",
    )
    # Hidden, written by `gpugate run` on its hook lines: --force's leases warned about, not
    # refused; a caller that is not root: kill only its processes (docs/gpugate-run.md).
    sub.add_argument("--ignore-leases", action="store_true", help=argparse.SUPPRESS)
    sub.add_argument("--for-uid", type=_uid, metavar="UID", help=argparse.SUPPRESS)
    sub.set_defaults(run=_pre_post)


def _status_parser(commands: Commands, name: str, text: str) -> None:
    status = commands.add_parser(name)
    _unit_and_config(status)
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="stable JSON (see README)")
    shown.add_argument(
        "--watch", action="store_true", help="redraw the table every second, as watch(1) does"
    )
    status.set_defaults(run=_status)


def _sweep_parser(commands: Commands, name: str, text: str) -> None:
    sweep = commands.add_parser(name)
    _config(sweep)
    sweep.set_defaults(run=_sweep)


def _config_parser(commands: Commands, name: str, text: str) -> None:
    tools = commands.add_parser(name).add_subparsers(dest="config_command", required=True)
    check = tools.add_parser("check", help="validate and print the effective config")
    check.add_argument("path", nargs="?", type=_path, help="file to check (default: lookup)")
    check.add_argument("--unit", help="unit whose lookup to follow (default: default.toml)")
    check.set_defaults(run=_config_check)


def _dry_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="report what would be killed; kill nothing"
    )


def _slurm_parser(commands: Commands, name: str, text: str) -> None:
    slurm = commands.add_parser(name)
    phases = slurm.add_subparsers(dest="slurm_phase", required=True, metavar="PHASE")
    for phase, about in (
        ("prolog", "Prolog=: make the job's GPUs free before it starts"),
        ("epilog", "Epilog=: kill the job's leftovers on its GPUs and wait; fail to drain"),
    ):
        sub = phases.add_parser(phase, help=about, description=about, epilog=EPILOG)
        _config(sub)
        _dry_run(sub)
        sub.set_defaults(run=_slurm)
    about = (
        "say whether each job gets its own /dev/shm (job_container/tmpfs) and whether "
        "gres.conf resolves every GPU to an NVML GPU"
    )
    check = phases.add_parser("check", help=about, description=about, epilog=EPILOG)
    check.add_argument("--node", help="the node's Slurm name (default: the short host name)")
    check.set_defaults(run=_slurm_check)


def _install_parser(commands: Commands, name: str, text: str) -> None:
    sub = commands.add_parser(name)
    sub.add_argument("unit", nargs="?", help="a service (vllm.service) or template (vllm@.service)")
    containers = "instead of a unit: gpugate's OCI hook for podman, CRI-O and docker (hooks.d "
    containers += "files, docker's gpugate runtime; see docs/containers.md)"
    sub.add_argument("--containers", dest="oci", action="store_true", help=containers)
    sub.add_argument("--sweep", action="store_true", help="gpugate-sweep.timer, enabled")
    nri = "gpugate-nri.service, enabled: the NRI plugin (docs/containers.md, NRI)"
    sub.add_argument("--nri", action="store_true", help=nri)
    sub.add_argument("--force", action="store_true", help="replace or remove edited files")
    sub.add_argument("--dry-run", action="store_true", help="print what it would do; do it not")
    sub.add_argument("--no-reload", action="store_true", help="skip systemctl daemon-reload")
    sub.add_argument("--systemd-dir", type=_path, default="/etc/systemd/system")
    sub.add_argument("--config-dir", type=_path, default="/etc/gpugate")
    sub.set_defaults(run=_install)
    if name == "uninstall":
        return
    default = "with --containers: make gpugate containerd's CRI default runtime"
    sub.add_argument("--default", action="store_true", help=default)
    _gpus_and_ports(
        sub,
        "the unit's GPUs for the config: indices and/or UUIDs, comma-separated, or all",
        "a TCP port of the unit for the config (repeatable): pre frees it before the start",
    )
    sub.add_argument(
        "--container",
        dest="containers",
        action="append",
        type=_container,
        default=[],
        metavar="NAME",
        help="a container (name or id) whose processes are the unit's own, as `docker run "
        "--name NAME` in its ExecStart=; repeat for more",
    )
    sub.add_argument(
        "--gpugate-path",
        type=_path,
        help="the gpugate ExecStartPre= runs (default: /usr/bin/gpugate, else the one on PATH)",
    )


def _oci_hook_parser(commands: Commands, name: str, text: str) -> None:
    hook = commands.add_parser(name)
    hook.add_argument("stage", help="createRuntime, prestart or poststop (state on stdin)")
    hook.add_argument("--config", type=_path, help="default: /etc/gpugate/containers.toml")
    hook.set_defaults(run=_oci_hook)


def _nri_parser(commands: Commands, name: str, text: str) -> None:
    plugin = commands.add_parser(name, description=text + " (see docs/containers.md, NRI)")
    plugin.add_argument(
        "--socket", type=_path, default="/var/run/nri/nri.sock", help="the runtime's NRI socket"
    )
    plugin.add_argument("--config", type=_path, help="default: /etc/gpugate/containers.toml")
    plugin.set_defaults(run=_nri)


def _oci_runtime_parser(commands: Commands, name: str, text: str) -> None:
    runtime = commands.add_parser(name)
    runtime.add_argument("args", nargs=argparse.REMAINDER, help="runc's arguments")
    runtime.set_defaults(run=_oci_runtime)


def _launch_parser(commands: Commands, name: str, text: str) -> None:
    run = commands.add_parser(
        name,
        description=text + " (see docs/gpugate-run.md)",
        usage="gpugate run [-h] [--gpus LIST] [--port N]... [--name NAME] [--config PATH] "
        "[--share-gpus] [--force] -- COMMAND [ARGS...]",
        epilog=EPILOG,
    )
    _gpus_and_ports(
        run,
        "the GPUs (indices and/or UUIDs, or all); default: your CUDA_VISIBLE_DEVICES, else all",
        "a TCP port the command listens on (repeatable): pre frees it (needs root)",
    )
    run.add_argument("--name", help="the unit's name (default: gpugate-run-COMMAND-ID.service)")
    run.add_argument("--config", type=_path, help="config file for the hooks (default: lookup)")
    run.add_argument(
        "--share-gpus",
        action="store_true",
        help="share the GPUs on purpose with other workloads that share them (needs root)",
    )
    run.add_argument(
        "--force", action="store_true", help="run even onto GPUs leased to a running unit"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="COMMAND [ARGS...], after --")
    run.set_defaults(run=_launch)


COMMANDS = (
    ("pre", "ExecStartPre=: make the unit's GPUs free before it starts", _phase_parser),
    ("post", "ExecStopPost=: reap what is left after the unit stopped, and wait", _phase_parser),
    ("status", "GPUs and the processes holding them", _status_parser),
    ("sweep", "between starts: GPU memory nobody owns, said/reaped", _sweep_parser),
    ("config", "configuration tools", _config_parser),
    (
        "install",
        "put gpugate on a unit: /etc/systemd/system/UNIT.d/gpugate.conf, "
        "/etc/gpugate/UNIT.toml, daemon-reload",
        _install_parser,
    ),
    ("uninstall", "take gpugate off a unit (install, reversed)", _install_parser),
    (
        "oci-hook",
        "OCI runtime hook: free a container's GPUs before it starts, after it stops",
        _oci_hook_parser,
    ),
    (
        "oci-runtime",
        "runc with gpugate's hooks added to GPU containers (docker's runtime)",
        _oci_runtime_parser,
    ),
    (
        "nri",
        "NRI plugin (containerd 1.7+, CRI-O): gate a node's containers at CreateContainer",
        _nri_parser,
    ),
    (
        "run",
        "run COMMAND as a transient service with gpugate's hooks: its GPUs leased, its "
        "whole cgroup stopped and GPUs freed on Ctrl-C, a closed terminal or systemctl stop",
        _launch_parser,
    ),
    ("slurm", "slurm.conf's Prolog= and Epilog= (see README)", _slurm_parser),
)


def _unit_and_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "unit", nargs="?", help="the unit (%%n in a unit file); default: the unit gpugate runs in"
    )
    _config(parser)


def _config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=_path, help="config file (default: /etc/gpugate lookup)")


def _gpus_and_ports(parser: argparse.ArgumentParser, gpus: str, port: str) -> None:
    parser.add_argument("--gpus", type=_gpus, metavar="LIST", help=gpus)
    parser.add_argument("--port", type=_port, action="append", dest="ports", metavar="N", help=port)


def main(
    argv: Sequence[str] | None = None,
    *,
    driver_factory: Callable[[], GpuDriver] | None = None,
    reporter_factory: ReporterFactory | None = None,
    roots: HostRoots | None = None,
    unit_state: Callable[[str], str | None] | None = None,
    cgroup_layout: Callable[[HostRoots], CgroupLayout | None] | None = None,
) -> int:
    args = build_parser(lazy=True).parse_args(argv)
    try:
        from gpugate.front.hook import HostAccess  # noqa: PLC0415
        from gpugate.host.systemd import HostRoots  # noqa: PLC0415

        command: Callable[[argparse.Namespace, HostAccess], int] = args.run
        if args.host_roots is not None:
            roots = HostRoots.parse(args.host_roots)
        if args.nvml_library is not None and driver_factory is None:
            from gpugate.host.nvml import NvmlDriver  # noqa: PLC0415

            driver_factory = functools.partial(NvmlDriver, library=args.nvml_library)
        front = HostAccess(
            driver_factory=driver_factory,
            reporter_factory=reporter_factory,
            roots=roots,
            unit_state=unit_state,
            cgroup_layout=cgroup_layout,
        )
        return command(args, front)
    except GateError as exc:
        from gpugate.report import lines  # noqa: PLC0415 (an error's words only)
        from gpugate.untrusted import safe_line  # noqa: PLC0415

        print(lines.error(safe_line(exc.message)), file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("GPUGATE_DEBUG"):
            raise
        from gpugate.report import lines  # noqa: PLC0415 (an error's words only)

        print(lines.error(lines.internal_error_text(exc)), file=sys.stderr)
        return int(ExitCode.INTERNAL)


def _pre_post(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.pre_post import pre_post  # noqa: PLC0415

    return pre_post(args, front)


def _slurm(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.slurm import slurm  # noqa: PLC0415
    from gpugate.phase import Phase  # noqa: PLC0415

    return slurm(front, Phase(args.slurm_phase), args.config, dry_run=args.dry_run)


def _slurm_check(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.slurm import slurm_check  # noqa: PLC0415
    from gpugate.integrations.gres_conf import DeviceNodes  # noqa: PLC0415

    nodes = DeviceNodes(front.host_roots().dev)
    return slurm_check(front.environ, args.node, front.driver_factory, nodes)


def _sweep(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.sweep import sweep  # noqa: PLC0415

    return sweep(args.config, front)


def _status(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.status import status  # noqa: PLC0415

    return status(front, args.unit, args.config, as_json=args.json, watch=args.watch)


def _config_check(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.config_check import config_check  # noqa: PLC0415

    return config_check(front, args.path, args.unit)


def _install(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.install import install_command  # noqa: PLC0415

    return install_command(args)


def _oci_hook(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.oci_hook import main as oci_hook  # noqa: PLC0415

    return oci_hook(
        [args.stage],
        roots=front.host_roots(),
        config=args.config,
        driver_factory=front.driver_factory,
    )


def _nri(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.nri import nri  # noqa: PLC0415

    return nri(
        socket=args.socket,
        config=args.config,
        roots=front.host_roots(),
        driver_factory=front.driver_factory,
    )


def _oci_runtime(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.oci_runtime import main as oci_runtime  # noqa: PLC0415

    return oci_runtime(args.args)


def _launch(args: argparse.Namespace, front: HostAccess) -> int:
    from gpugate.front.commands.run import launch_command  # noqa: PLC0415

    return launch_command(args, front)


def _gpus(value: str) -> object:
    from gpugate.front.install import parse_gpus  # noqa: PLC0415

    try:
        return parse_gpus(value)
    except InvalidValue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _path(value: str) -> Path:
    from pathlib import Path  # noqa: PLC0415  (pathlib is not needed for --help)

    return Path(value)


def _uid(value: str) -> int:
    from gpugate.front.hook import parse_uid  # noqa: PLC0415

    uid = parse_uid(value)
    if uid is None:
        raise argparse.ArgumentTypeError(f"{value[:20]!r} is not a uid")
    return uid


def _port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (1-65535)")
    return int(value)


def _container(value: str) -> str:
    from gpugate.config.values import CONTAINER_NAME  # noqa: PLC0415
    from gpugate.untrusted import for_error  # noqa: PLC0415

    if not CONTAINER_NAME.fullmatch(value):
        what = "is not a container name or id (letters, digits, _.-)"
        raise argparse.ArgumentTypeError(f"{for_error(value)} {what}")
    return value
