"""`gpugate install|uninstall UNIT` (a unit's drop-in and config, daemon-reload) and
`gpugate install|uninstall --containers` (hooks.d files, docker's runtime)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpugate.config.file import DEFAULT_CONFIG_DIR
from gpugate.errors import ExitCode
from gpugate.front import install as plan
from gpugate.front.hook import warn_environment_files
from gpugate.front.install import DEFAULT_SYSTEMD_DIR, Gpus
from gpugate.host.systemd import systemd_running, unit_argument
from gpugate.report import lines


def install(
    unit_given: str,
    *,
    force: bool = False,
    dry_run: bool = False,
    no_reload: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
    gpus: Gpus | None = None,
    ports: Sequence[int] | None = None,
    containers: Sequence[str] = (),
    gpugate_path: Path | None = None,
) -> int:
    unit = unit_argument(unit_given)  # `install vllm` is vllm.service, as for systemctl
    command = plan.command_for(str(gpugate_path)) if gpugate_path else plan.gpugate_command()
    changes = plan.plan_install(
        unit,
        gpus=gpus,
        ports=ports,
        containers=containers,
        gpugate_path=command,
        force=force,
        systemd_dir=systemd_dir,
        config_dir=config_dir,
    )
    if not os.access(command[0], os.X_OK) and not dry_run:
        print(lines.warning(f"{command[0]} is not an executable here"), file=sys.stderr)
    if systemd_running():
        warn_environment_files(unit)
    if _apply(changes, dry_run=dry_run, no_reload=no_reload):
        print(f"takes effect at the next start: systemctl restart {unit}")
    return int(ExitCode.OK)


def uninstall(
    unit_given: str,
    *,
    force: bool = False,
    dry_run: bool = False,
    no_reload: bool = False,
    systemd_dir: Path = DEFAULT_SYSTEMD_DIR,
    config_dir: Path = DEFAULT_CONFIG_DIR,
) -> int:
    unit = unit_argument(unit_given)
    changes = plan.plan_uninstall(unit, force=force, systemd_dir=systemd_dir, config_dir=config_dir)
    _apply(changes, dry_run=dry_run, no_reload=no_reload)
    return int(ExitCode.OK)


def _apply(changes: list[plan.Change], *, dry_run: bool, no_reload: bool) -> bool:
    reload = (lambda: False) if no_reload else plan.systemctl_daemon_reload
    return plan.apply(changes, dry_run=dry_run, reload=reload)


def containers_setup(
    installing: bool,
    *,
    force: bool,
    dry_run: bool,
    no_reload: bool,
    given: Path | None = None,
    default: bool = False,
) -> int:
    """`gpugate install|uninstall --containers`; default: gpugate containerd's CRI default."""
    from gpugate.front import install_containers as oci  # noqa: PLC0415

    host = oci.detect()
    # This very gpugate: the script it was run as (the packages' launcher isolates Python
    # itself; a venv's console script is run as it is, see docs/containers.md).
    script = str(given) if given else os.path.abspath(sys.argv[0])
    changes = oci.plan_hooks(host, script, install=installing, force=force)
    wrapped = host.daemon_json is not None or host.containerd_config is not None
    wrapper = oci.wrapper_beside(script) if installing and wrapped else ""
    nvidia = installing and oci.nvidia_in_place(host)
    changes += oci.plan_daemon_json(host, wrapper, install=installing)
    changes += oci.plan_containerd(host, wrapper, install=installing, default=default)
    changes += oci.plan_record(host, install=installing, nvidia=nvidia)
    if not changes:
        print("no podman, CRI-O, docker or containerd here: nothing to do")
        return int(ExitCode.OK)
    plan.apply(changes, dry_run=dry_run, reload=lambda: False)
    written = {c.path for c in changes if c.action in (plan.Action.WRITE, plan.Action.REMOVE)}
    if host.containerd_config in written and not dry_run:
        print(
            "containerd reads its config only when it starts: systemctl restart containerd "
            "(running containers keep running)"
        )
    if host.daemon_json in written and not dry_run and not no_reload:
        print(oci.reload_docker())
    return int(ExitCode.OK)
