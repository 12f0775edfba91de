"""A test that needs root says so with the `root` marker (registered in pyproject.toml, skipped
saying why when not root by tests/conftest.py), never with a `skipif` on the euid of its own:
read with `ast` over tests/unit and tests/commands."""

from __future__ import annotations

import ast
from pathlib import Path

from gpugate.compat import tomllib

TESTS = Path(__file__).resolve().parents[1]


def euid_skipifs(tree: ast.Module) -> list[int]:
    """Lines of `pytest.mark.skipif(...)` whose condition reads the euid."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "skipif"
        and node.args
        and "geteuid" in ast.unparse(node.args[0])
    ]


def test_root_is_said_by_the_marker() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for folder in ("unit", "commands")
        for path in sorted((TESTS / folder).glob("test_*.py"))
        for line in euid_skipifs(ast.parse(path.read_text()))
    ]
    assert not found, f"use @pytest.mark.root('why') instead: {found}"


def test_the_root_marker_is_registered() -> None:
    pyproject = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("root(why):") for marker in markers)


def test_the_rule_catches_a_skipif_on_the_euid() -> None:
    source = (
        "import os, pytest\n"
        "@pytest.mark.skipif(os.geteuid() != 0, reason='x')\n"
        "def test_a(): pass\n"
        "@pytest.mark.skipif(os.name == 'nt', reason='y')\n"
        "def test_b(): pass\n"
        "@pytest.mark.root('z')\n"
        "def test_c(): pass\n"
    )
    assert euid_skipifs(ast.parse(source)) == [2]


# A test of a message's own words carries the `message` marker; every other test asserts
# codes, fields, processes and files.
def test_the_message_marker_is_registered() -> None:
    pyproject = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("message:") for marker in markers)
