"""`gpugate config check [PATH] [--unit UNIT]`: validate and print the effective config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpugate.config.file import to_toml
from gpugate.errors import ExitCode, GateError
from gpugate.front.hook import HostAccess, warn_environment_files
from gpugate.host.systemd import unit_argument, validate_unit_name
from gpugate.integrations.config_files import load_config
from gpugate.report import lines


def config_check(front: HostAccess, path: Path | None, unit_given: str | None) -> int:
    unit = validate_unit_name(unit_argument(unit_given)) if unit_given else None
    loaded = load_config(unit, path)
    print(f"# effective configuration, from {loaded.source}")
    if unit is not None:
        from gpugate.integrations.unit import choose_gpus, with_chosen_gpus  # noqa: PLC0415

        choice = choose_gpus(unit, loaded, ask_systemd=front.given_roots.ask_systemd)
        gpus = choice.gpus
        shown = gpus if isinstance(gpus, str) else ", ".join(map(str, gpus)) or "none"
        print(f"# {unit}'s GPUs: {shown}, from {choice.source}")
        loaded = with_chosen_gpus(loaded, choice)
        if front.given_roots.ask_systemd:
            warn_environment_files(unit)
    show_wrapped_runtime()
    print(to_toml(loaded.config.model_dump()))
    return int(ExitCode.OK)


def show_wrapped_runtime(record: Path | None = None) -> None:
    """The runtime gpugate-oci-runtime runs, where install --containers recorded one."""
    from gpugate.host import wrapped_runtime as wrapped  # noqa: PLC0415

    record = record or wrapped.RECORD
    if not os.path.lexists(record):
        return
    try:
        recorded = wrapped.read_record(record)
    except GateError as exc:
        print(lines.warning(exc.message), file=sys.stderr)
        return
    chosen = wrapped.choose(recorded, {})
    runs = chosen.path or f"no {chosen.name} installed"
    instead = "" if chosen.name == recorded else f"; {recorded} is not installed or is the caller"
    where = f'runtime = "{recorded}" in {record}{instead}'
    print(f"# containers: gpugate-oci-runtime runs {runs} ({where})")
