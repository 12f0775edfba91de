"""Unit names as an operator types them: systemctl's reading, trailing newlines, and units
systemd does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpugate.errors import UnknownUnit
from gpugate.front.install import plan_install
from gpugate.host.systemd import UnitState, unit_argument, validate_unit_name
from tests.fakes import raises_error


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("vllm", "vllm.service"),
        ("vllm@a", "vllm@a.service"),
        ("vllm@", "vllm@.service"),
        ("sglang-7b", "sglang-7b.service"),
        ("my.app", "my.app.service"),
        ("vllm.service", "vllm.service"),
        ("run-u12.scope", "run-u12.scope"),
        ("vllm@a.service", "vllm@a.service"),
        ("x.timer", "x.timer"),
    ],
)
def test_a_name_without_a_unit_type_is_a_service(typed: str, meant: str) -> None:
    assert unit_argument(typed) == meant


@pytest.mark.parametrize(
    "name",
    ["vllm.service\n", "vllm.service\n\n", "vllm@a.service\n", "run-u1.scope\n", "\nvllm.service"],
)
def test_trailing_or_leading_newline_is_no_unit_name(name: str) -> None:
    with pytest.raises(UnknownUnit):
        validate_unit_name(name)
    with pytest.raises(UnknownUnit):
        validate_unit_name(unit_argument(name))


def states(load_state: str) -> dict[str, UnitState]:
    return {
        name: UnitState(load_state, "inactive", None)
        for name in ("nosuch.service", "vllm.service", "vllm@a.service")
    }


@pytest.mark.parametrize("unit", ["nosuch.service", "vllm@a.service"])
def test_install_on_a_unit_systemd_does_not_know_refuses_without_force(
    unit: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = {"systemd_dir": tmp_path / "systemd", "config_dir": tmp_path / "gpugate"}
    known = states("not-found")
    with raises_error(UnknownUnit):
        plan_install(unit, query=known.get, **dirs)
    capsys.readouterr()
    changes = plan_install(unit, query=known.get, force=True, **dirs)
    assert len(changes) == 2
    warned = capsys.readouterr().err
    assert unit in warned and warned.count("\n") == 1  # one warning


@pytest.mark.parametrize("load_state", ["loaded", "masked", "bad-setting"])
def test_install_on_a_unit_systemd_knows_says_nothing(
    load_state: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = {"systemd_dir": tmp_path / "systemd", "config_dir": tmp_path / "gpugate"}
    assert plan_install("vllm.service", query=states(load_state).get, **dirs)
    assert capsys.readouterr().err == ""


def test_install_without_systemd_to_ask_and_on_templates_goes_on(tmp_path: Path) -> None:
    dirs = {"systemd_dir": tmp_path / "systemd", "config_dir": tmp_path / "gpugate"}
    assert plan_install("vllm.service", query=lambda name: None, **dirs)
    asked: list[str] = []
    plan_install("vllm@.service", query=lambda name: asked.append(name) or None, **dirs)
    assert asked == []
