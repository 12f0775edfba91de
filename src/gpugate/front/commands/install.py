"""`gpugate install|uninstall UNIT` (a unit's drop-in and config, daemon-reload),
`gpugate install|uninstall --containers` (hooks.d files, docker's runtime), `--sweep`
(gpugate-sweep.timer) and `--nri` (gpugate-nri.service)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpugate.errors import ExitCode
from gpugate.front import install as plan
from gpugate.front.hook import warn_environment_files
from gpugate.host.systemd import systemd_running, unit_argument
from gpugate.report import lines


def install_command(args: argparse.Namespace) -> int:
    """install and uninstall (uninstall's parser has no --gpugate-path, --default, --gpus,
    --port, --container)."""
    installing = args.command == "install"
    given: Path | None = args.gpugate_path if installing else None
    chosen = [bool(args.unit), args.oci, args.sweep, args.nri]
    if chosen.count(True) != 1:
        print(
            f"gpugate {args.command}: give a UNIT, --containers, --sweep or --nri, one of them",
            file=sys.stderr,
        )
        return int(ExitCode.USAGE)
    if args.oci:
        return containers_setup(args, installing, given)
    # the hook lines' gpugate: --gpugate-path, else this very one
    command = plan.command_for(str(given)) if given else plan.gpugate_command()
    return (shipped_setup if args.sweep or args.nri else unit_setup)(args, installing, command)


def unit_setup(args: argparse.Namespace, installing: bool, command: tuple[str, ...]) -> int:
    unit = unit_argument(args.unit)  # `install vllm` is vllm.service, as for systemctl
    reload = (lambda: False) if args.no_reload else plan.systemctl_daemon_reload
    dirs = {"systemd_dir": args.systemd_dir, "config_dir": args.config_dir}
    if not installing:
        changes = plan.plan_uninstall(unit, force=args.force, **dirs)
        plan.apply(changes, dry_run=args.dry_run, reload=reload)
        return int(ExitCode.OK)
    changes = plan.plan_install(
        unit,
        gpus=args.gpus,
        ports=args.ports,
        containers=args.containers,
        gpugate_path=command,
        force=args.force,
        **dirs,
    )
    if not os.access(command[0], os.X_OK) and not args.dry_run:
        print(lines.warning(f"{command[0]} is not an executable here"), file=sys.stderr)
    if systemd_running():
        warn_environment_files(unit)
    if plan.apply(changes, dry_run=args.dry_run, reload=reload):
        print(f"takes effect at the next start: systemctl restart {unit}")
    return int(ExitCode.OK)


def shipped_setup(args: argparse.Namespace, installing: bool, command: tuple[str, ...]) -> int:
    """--sweep or --nri: a unit file of gpugate's own written (none where the package carries
    it) and enabled, --now where systemd runs; or disabled, then removed."""
    unit = plan.TIMER if args.sweep else plan.NRI_SERVICE
    _, disabled, enabled = plan.SHIPPED[unit]
    changes = plan.plan_shipped(unit, args.systemd_dir, command, installing=installing)
    now = ["--now"] if systemd_running() else []
    there = any((folder / unit).exists() for folder in (plan.PACKAGED_DIR, args.systemd_dir))
    if not installing and not args.dry_run and there:  # none there: nothing to disable
        plan.systemctl_or_fail("disable", *now, unit)
        print(disabled)
    reload = None if args.no_reload else plan.systemctl_daemon_reload
    plan.apply(changes, dry_run=args.dry_run, reload=reload)
    if installing and not args.dry_run:
        plan.systemctl_or_fail("enable", *now, unit)
        print(enabled)
    return int(ExitCode.OK)


def containers_setup(args: argparse.Namespace, installing: bool, given: Path | None) -> int:
    """`gpugate install|uninstall --containers`; --default: gpugate containerd's CRI default."""
    from gpugate.front import install_containers as oci  # noqa: PLC0415

    host = oci.detect()
    # This very gpugate: the script it was run as (the packages' launcher isolates Python
    # itself; a venv's console script is run as it is, see docs/containers.md).
    script = str(given) if given else os.path.abspath(sys.argv[0])
    changes = oci.plan_hooks(host, script, install=installing, force=args.force)
    wrapped = host.daemon_json is not None or host.containerd_config is not None
    wrapper = oci.wrapper_beside(script) if installing and wrapped else ""
    nvidia = installing and oci.nvidia_in_place(host)
    default = installing and args.default
    changes += oci.plan_daemon_json(host, wrapper, install=installing)
    changes += oci.plan_containerd(host, wrapper, install=installing, default=default)
    changes += oci.plan_record(host, install=installing, nvidia=nvidia)
    if not changes:
        print("no podman, CRI-O, docker or containerd here: nothing to do")
        return int(ExitCode.OK)
    plan.apply(changes, dry_run=args.dry_run, reload=None)
    written = {c.path for c in changes if c.action in (plan.Action.WRITE, plan.Action.REMOVE)}
    if host.containerd_config in written and not args.dry_run:
        print(
            "containerd reads its config only when it starts: systemctl restart containerd "
            "(running containers keep running)"
        )
    if host.daemon_json in written and not args.dry_run and not args.no_reload:
        print(oci.reload_docker())
    return int(ExitCode.OK)
