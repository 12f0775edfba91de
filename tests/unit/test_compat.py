"""gpugate.compat: what 3.11 added, the same on every interpreter from 3.9."""

from __future__ import annotations

import json

import pytest

from gpugate.compat import StrEnum, tomllib
from gpugate.core.discover import Source
from gpugate.core.roles import Role


class Colour(StrEnum):
    DARK_RED = "dark-red"


@pytest.mark.parametrize("member", [Colour.DARK_RED, Source.DEVICE_FD, Role.ORPHAN])
def test_string_enums_read_and_print_as_their_values(member: StrEnum) -> None:
    value = member.value
    assert isinstance(member, str)
    assert member == value and hash(member) == hash(value)
    assert str(member) == f"{member}" == "%s" % member == value  # noqa: UP031
    assert f"{member:>20}" == f"{value:>20}"
    assert json.dumps({"k": member}) == json.dumps({"k": value})
    assert type(member)(value) is member
    assert value.upper() == member.upper()


def test_toml_is_parsed_and_its_errors_are_one_class() -> None:
    assert tomllib.loads('a = 1\n[b]\nc = "d"\n') == {"a": 1, "b": {"c": "d"}}
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads("a = \n")
    with pytest.raises(ValueError):  # TOMLDecodeError is a ValueError in tomli and tomllib
        tomllib.loads("[a\n")


def test_model_annotations_evaluate_on_python_3_9() -> None:
    """pydantic evaluates a model's field annotations at run time, where `X | None` needs 3.10:
    the config models spell unions Optional[...] / Union[...] (checked here on every Python)."""
    import ast
    from pathlib import Path

    from gpugate.config import schema

    tree = ast.parse(Path(schema.__file__).read_text())
    offenders = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign):
                for part in ast.walk(statement.annotation):
                    if isinstance(part, ast.BinOp) and isinstance(part.op, ast.BitOr):
                        offenders.append(f"{node.name}.{ast.unparse(statement.target)}")
    assert offenders == []


@pytest.mark.parametrize("text", ["\n", "a\tb", 'q"uote\\', "\x00\x1f\x7f", "\r\n\b\f", "é ü 🚀"])
def test_a_string_as_toml_parses_back_and_stays_one_line(text: str) -> None:
    """Found by the property test on Python 3.12: an echoed string with a newline broke the
    one-line error. TOML's own escapes keep it on one line, on every interpreter."""
    from gpugate.config.file import toml_value

    written = toml_value(text)
    assert "\n" not in written and "\r" not in written
    assert tomllib.loads(f"k = {written}\n") == {"k": text}
