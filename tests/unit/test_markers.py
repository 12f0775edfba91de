"""A test that needs root says so with the `root` marker (registered in pyproject.toml, skipped
saying why when not root by tests/conftest.py), never with a `skipif` on the euid of its own:
read with `ast` over tests/unit and tests/commands."""

from __future__ import annotations

import ast
import re
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


# A test asserts behaviour (exit codes, journal fields, Rule codes, JSON fields, processes and
# files); only the tests of a message itself, marked `message`, assert its words. Prose here: a
# string literal of two words joined by a space (not a path, an option or key=value) in an
# assert's test or a `match=`.
PROSE = re.compile(r"\b[A-Za-z]{2,}[,:;]? [A-Za-z']{2,}\b")
PROSE_SHARE = 0.05


def is_prose(text: str) -> bool:
    return bool(PROSE.search(text)) and "=" not in text and not text.lstrip().startswith(("/", "-"))


def literal_prose(node: ast.AST) -> str | None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            text = sub.value
        elif isinstance(sub, ast.JoinedStr):
            text = "".join(str(part.value) for part in sub.values if isinstance(part, ast.Constant))
        else:
            continue
        if is_prose(text):
            return text
    return None


def asserted_prose(function: ast.AST) -> str | None:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert) and (found := literal_prose(node.test)):
            return found
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "match" and (found := literal_prose(keyword.value)):
                    return found
    return None


def is_message_mark(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) == "pytest.mark.message"


def module_is_message(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets
        ):
            value = node.value
            marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            return any(is_message_mark(mark) for mark in marks)
    return False


def found_tests(node: ast.AST, message: bool) -> list[tuple[ast.AST, bool]]:
    """Every `test*` function under node (methods and nested ones too), with whether a
    `message` mark on it, its class or its module covers it."""
    found: list[tuple[ast.AST, bool]] = []
    for child in ast.iter_child_nodes(node):
        marked = message
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            marked = message or any(is_message_mark(d) for d in child.decorator_list)
            if not isinstance(child, ast.ClassDef) and child.name.startswith("test"):
                found.append((child, marked))
        found.extend(found_tests(child, marked))
    return found


def prose_offenders(root: Path) -> tuple[int, list[str]]:
    """How many test functions under root carry no `message` mark, and those of them that
    assert prose, as `path::name: 'the prose'`."""
    unmarked = 0
    offenders: list[str] = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for function, marked in found_tests(tree, module_is_message(tree)):
            if marked:
                continue
            unmarked += 1
            if found := asserted_prose(function):
                name = getattr(function, "name", "")
                offenders.append(f"{path.relative_to(root)}::{name}: {found[:60]!r}")
    return unmarked, offenders


def too_many(unmarked: int, offenders: list[str]) -> bool:
    return len(offenders) > PROSE_SHARE * unmarked


def test_behaviour_tests_assert_behaviour_not_prose() -> None:
    unmarked, offenders = prose_offenders(TESTS)
    listed = "\n".join(offenders)
    assert not too_many(unmarked, offenders), (
        f"{len(offenders)} of {unmarked} test functions without the message marker assert "
        f"prose (at most {PROSE_SHARE:.0%}): assert codes, fields, processes or files, or mark "
        f"a test of a message itself @pytest.mark.message:\n{listed}"
    )


def test_the_message_marker_is_registered() -> None:
    pyproject = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("message:") for marker in markers)


MARKED_MODULE = """
import pytest
pytestmark = [pytest.mark.slow, pytest.mark.message]
def test_words(): assert said() == "the unit is gone"
"""
UNMARKED_MODULE = """
import pytest
def test_says(): assert said() == "the unit is gone"
def test_matches():
    with pytest.raises(ValueError, match="no such unit"):
        said()
def test_code(): assert code() == 69 and path() == "/run/gpugate locks"
def test_field(): assert entry["GPUGATE_RULE"] == "cgroup" and opt == "--dry-run now"
@pytest.mark.message
def test_marked(): assert said() == "the unit is gone"
class TestBox:
    def test_method(self): assert said().startswith("stopped by SIGTERM")
@pytest.mark.message
class TestMarked:
    def test_method(self): assert said() == "the unit is gone"
"""


def test_the_prose_rule_catches_a_tree_of_prose_tests(tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(MARKED_MODULE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_unmarked.py").write_text(UNMARKED_MODULE)
    unmarked, offenders = prose_offenders(tmp_path)
    names = [offender.split(":")[2] for offender in offenders]
    assert (unmarked, names) == (5, ["test_says", "test_matches", "test_method"])
    assert too_many(unmarked, offenders)
    assert not too_many(60, offenders)
