"""The one config model: its built-in defaults are what pydantic's engine makes of an empty file
and pass their own validation; each phase's table keeps its own defaults; every field has a type
the engine knows and words; pydantic_core is loaded only where a file sets something, and
pydantic's BaseModel never."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpugate.config.file import parse_config, replaced, to_toml
from gpugate.config.schema import DEFAULTS, GateConfig, Model, PhasePolicy, SweepPolicy, setting
from gpugate.config.values import BUILTIN_SOURCE
from gpugate.integrations.config_files import load_config
from gpugate.phase import Phase


def _typed(model: Model) -> dict[str, Any]:
    return {
        name: (_typed(value) if isinstance(value, Model) else (value, type(value)))
        for name, value in model
    }


def test_the_defaults_are_what_the_engine_makes_of_an_empty_table() -> None:
    assert _typed(GateConfig.model_validate({})) == _typed(DEFAULTS)
    assert GateConfig() == DEFAULTS


def test_the_defaults_pass_their_own_validation_written_out_and_read_back() -> None:
    """Each declared default fits its own type and bounds: dumped as TOML, read back the same."""
    text = to_toml(DEFAULTS.model_dump())
    assert _typed(parse_config(text, "f.toml")) == _typed(DEFAULTS)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_partial_phase_table_keeps_that_phases_defaults(phase: Phase) -> None:
    built_in = DEFAULTS.policy(phase)
    assert built_in.kill_orphans is phase.traits.kills_orphans
    config = parse_config(f"[{phase.value}]\nsigterm_grace_s = 2\n", "f.toml")
    expected = replaced(built_in, sigterm_grace_s=2.0)
    assert _typed(config.policy(phase)) == _typed(expected)


@pytest.mark.parametrize("model", [GateConfig, PhasePolicy, SweepPolicy])
def test_every_field_is_declared_once_with_a_type_the_engine_knows(model: type[Model]) -> None:
    assert list(model.model_fields) == [name for name, _ in model.built_in()]
    for name, field in model.model_fields.items():
        assert field.name == name and field.description.strip(), name
    model.model_validate({})  # every annotation has its core schema


def test_a_type_without_a_core_schema_is_refused_when_the_validator_is_built() -> None:
    class Odd(Model):
        when: complex = setting(0j, "Not a type a config file can hold.")

    with pytest.raises(TypeError, match="when: complex"):
        Odd.model_validate({})


def test_a_config_is_frozen_and_copies_keep_what_the_file_set() -> None:
    config = parse_config("free_mib = 5\n", "f.toml")
    assert config.model_fields_set == {"free_mib"}
    with pytest.raises(ValueError):
        config.free_mib = 6  # type: ignore[misc]
    assert config.free_mib == 5
    chosen = replaced(config, gpus=(1, 0))
    assert (chosen.gpus, chosen.free_mib, config.gpus) == ((1, 0), 5, "auto")
    assert chosen.model_fields_set == {"free_mib", "gpus"}
    assert hash(chosen) != hash(config) and chosen != config


def test_changed_validates_as_a_file_does() -> None:
    changed = DEFAULTS.changed(ports=[8000], gpus=(0, 1))
    assert (changed.ports, changed.gpus) == ((8000,), (0, 1))
    assert changed.model_dump(exclude_defaults=True) == {
        "gpus": [0, 1],
        "ports": [8000],
    }
    assert DEFAULTS.changed(lock_dir=Path("/run/x")).lock_dir == Path("/run/x")


@pytest.mark.parametrize("text", ["", "\n\n", "# gpus = [0]\n", "# a comment\n\n# another\n"])
def test_a_file_that_sets_nothing_is_the_defaults(text: str) -> None:
    assert parse_config(text, "/etc/gpugate/x.toml") is DEFAULTS


def test_no_file_is_the_defaults(tmp_path: Path) -> None:
    loaded = load_config("x.service", config_dir=tmp_path)
    assert (loaded.config, loaded.source) == (DEFAULTS, BUILTIN_SOURCE)


# Each in a fresh interpreter: which of pydantic's packages a load leaves in sys.modules.
PROBE = """
import json, sys
from pathlib import Path
from gpugate.integrations.config_files import load_config
explicit = Path(sys.argv[2]) if sys.argv[2] else None
loaded = load_config("x.service", explicit, config_dir=Path(sys.argv[1]))
print(json.dumps({
    "pydantic": "pydantic" in sys.modules,
    "pydantic_core": "pydantic_core" in sys.modules,
    "free_mib": loaded.config.free_mib,
}))
"""


def _probe(config_dir: Path, explicit: Path | None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(config_dir), str(explicit or "")],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("text", [None, "", "# free_mib = 5\n"])
def test_nothing_set_loads_no_pydantic(tmp_path: Path, text: str | None) -> None:
    explicit = None
    if text is not None:
        explicit = tmp_path / "x.toml"
        explicit.write_text(text)
    found = _probe(tmp_path, explicit)
    assert found == {"pydantic": False, "pydantic_core": False, "free_mib": 1024}


def test_a_file_loads_pydantics_engine_alone(tmp_path: Path) -> None:
    explicit = tmp_path / "x.toml"
    explicit.write_text("free_mib = 5\n")
    found = _probe(tmp_path, explicit)
    assert found == {"pydantic": False, "pydantic_core": True, "free_mib": 5}
