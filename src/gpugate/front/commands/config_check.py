"""`gpugate config check [PATH] [--unit UNIT]`: validate and print the effective config."""

from __future__ import annotations

import sys
from pathlib import Path

from gpugate.config.toml_text import to_toml
from gpugate.errors import ExitCode
from gpugate.front.commands import Front
from gpugate.host.systemd import unit_argument, validate_unit_name
from gpugate.integrations.config_files import load_config
from gpugate.report import lines


def config_check(front: Front, path: Path | None, unit_given: str | None) -> int:
    unit = validate_unit_name(unit_argument(unit_given)) if unit_given else None
    loaded = load_config(unit, path)
    print(lines.effective_config(loaded.source))
    if unit is not None:
        from gpugate.integrations.unit.gpu_source import choose_gpus, with_chosen_gpus  # noqa: PLC0415

        environment = None if front.given_roots.ask_systemd else (lambda _: None)
        choice = choose_gpus(unit, loaded, environment)
        print(lines.unit_gpus(unit, choice.gpus, choice.source))
        loaded = with_chosen_gpus(loaded, choice)
        if front.given_roots.ask_systemd:
            warn_environment_files(unit)
    print(to_toml(loaded.config.model_dump(mode="json")))
    return int(ExitCode.OK)


def warn_environment_files(unit: str) -> None:
    """What the unit's EnvironmentFile= lines would let another account change (stderr)."""
    from gpugate.integrations.unit.env_files import unit_environment_warnings  # noqa: PLC0415

    for line in unit_environment_warnings(unit):
        print(lines.error(line), file=sys.stderr)
