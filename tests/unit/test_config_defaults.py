"""The built-in defaults without pydantic: the same fields, values and types as pydantic's model
of an empty file; pydantic loaded only where a file sets something, with its plugin scan off."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.config.file import parse_config, pydantic_config, replaced, validated
from gpugate.config.values import BUILTIN_SOURCE, DEFAULTS, DefaultConfig
from gpugate.integrations.config_files import load_config
from gpugate.phase import Phase


def _fields(obj: object) -> dict[str, object]:
    return {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}  # type: ignore[arg-type]


def test_defaults_are_the_models_defaults() -> None:
    model = pydantic_config()()
    defaults = _fields(DEFAULTS)
    assert list(defaults) == list(type(model).model_fields)
    for name, value in defaults.items():
        built = getattr(model, name)
        if dataclasses.is_dataclass(value):  # a phase's policy, sweep's
            assert list(_fields(value)) == list(type(built).model_fields)
            for key, item in _fields(value).items():
                assert (key, item, type(item)) == (
                    key,
                    getattr(built, key),
                    type(getattr(built, key)),
                )
        else:
            assert (name, value, type(value)) == (name, built, type(built))


@pytest.mark.parametrize("phase", list(Phase))
def test_each_phases_policy_is_the_models(phase: Phase) -> None:
    assert _fields(DEFAULTS.policy(phase)) == dict(pydantic_config()().policy(phase))


@pytest.mark.parametrize("text", ["", "\n\n", "# gpus = [0]\n", "# a comment\n\n# another\n"])
def test_a_file_that_sets_nothing_is_the_defaults(text: str) -> None:
    assert parse_config(text, "/etc/gpugate/x.toml") is DEFAULTS


def test_no_file_is_the_defaults(tmp_path: Path) -> None:
    loaded = load_config("x.service", config_dir=tmp_path)
    assert (loaded.config, loaded.source) == (DEFAULTS, BUILTIN_SOURCE)


def test_defaults_with_gpus_and_validated() -> None:
    chosen = replaced(DEFAULTS, gpus=(1, 0))
    assert isinstance(chosen, DefaultConfig)
    assert (chosen.gpus, chosen.selection(), DEFAULTS.selection()) == ((1, 0), (1, 0), "all")
    model = validated(chosen)
    assert model.gpus == (1, 0)
    assert model.changed(ports=(8000,)).ports == (8000,)
    assert validated(model) is model


# Each in a fresh interpreter: which modules a load leaves in sys.modules, and whether pydantic
# asked importlib.metadata for the installed distributions' entry points (its plugin scan).
PROBE = """
import importlib.metadata, json, os, sys
from pathlib import Path
scans = []
real = importlib.metadata.entry_points
importlib.metadata.entry_points = lambda **kw: scans.append(kw) or real(**kw)
from gpugate.integrations.config_files import load_config
explicit = Path(sys.argv[2]) if sys.argv[2] else None
loaded = load_config("x.service", explicit, config_dir=Path(sys.argv[1]))
print(json.dumps({
    "pydantic": "pydantic" in sys.modules,
    "scans": len(scans),
    "variable": os.environ.get("PYDANTIC_DISABLE_PLUGINS"),
    "free_mib": loaded.config.free_mib,
}))
"""


def _probe(config_dir: Path, explicit: Path | None, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(config_dir), str(explicit or "")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("text", [None, "", "# free_mib = 5\n"])
def test_nothing_set_loads_no_pydantic(tmp_path: Path, text: str | None) -> None:
    explicit = None
    if text is not None:
        explicit = tmp_path / "x.toml"
        explicit.write_text(text)
    found = _probe(tmp_path, explicit, {"PATH": "/usr/bin:/bin"})
    assert found == {"pydantic": False, "scans": 0, "variable": None, "free_mib": 1024}


@pytest.mark.parametrize("given", [None, "logfire"])
def test_a_file_loads_pydantic_without_its_plugin_scan(tmp_path: Path, given: str | None) -> None:
    explicit = tmp_path / "x.toml"
    explicit.write_text("free_mib = 5\n")
    env = {"PATH": "/usr/bin:/bin"}
    if given is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = given  # one plugin off: the scan would still run
    found = _probe(tmp_path, explicit, env)
    assert found == {"pydantic": True, "scans": 0, "variable": given, "free_mib": 5}
