"""Every error that reaches an operator is one line, escaped and bounded: on stderr (`gpugate:
...`), in the journal's error entry and in STATUS=. Each raise site forms its own words; what
another account could have written in them (a unit name, a path, a value in a config file) is
escaped by `gpugate.untrusted`, and the channels' last guard (`untrusted.safe_line`) bounds the
whole. The tests here give hostile text to real raise sites and to each channel."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest

from gpugate.errors import ExitCode, GateError, UnknownUnit
from gpugate.front.cli import main
from gpugate.front.install import CHANGE_NOTES
from gpugate.untrusted import LINE_CHARS
from tests.unit.test_report import make

SRC = Path(__file__).resolve().parents[2] / "src" / "gpugate"
HOSTILE = "\x1b[2Jx\ny\rz\u202e\x00" + "w" * 20_000  # controls, bidi, NUL, length


def one_operator_line(text: str) -> str:
    """The one line text holds: printable, within the bound (the `gpugate: ` prefix aside)."""
    assert text.endswith("\n") and text.count("\n") == 1, text[:200]
    line = text[:-1]
    assert line.isprintable(), line[:200]
    assert len(line) <= LINE_CHARS + len("gpugate: "), len(line)
    return line


def config_with_a_hostile_key(tmp_path: Path) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_text(f'"{HOSTILE[:30].encode("unicode_escape").decode()}" = 1\n')
    return ["config", "check", str(path)]


def config_with_a_hostile_value(tmp_path: Path) -> list[str]:
    path = tmp_path / "c.toml"
    text = HOSTILE.encode("unicode_escape").decode().replace('"', "")
    path.write_text(f'protected_executables = ["{text}"]\n')
    return ["config", "check", str(path)]


def a_missing_config_with_a_hostile_name(tmp_path: Path) -> list[str]:
    return ["config", "check", str(tmp_path / HOSTILE[:300].replace("\x00", ""))]


def a_hostile_unit_name(tmp_path: Path) -> list[str]:
    return ["pre", HOSTILE[:500].replace("\x00", "") + ".service", "--dry-run"]


CASES = [
    (config_with_a_hostile_key, ExitCode.CONFIG),
    (config_with_a_hostile_value, ExitCode.CONFIG),
    (a_missing_config_with_a_hostile_name, ExitCode.CONFIG),
    (a_hostile_unit_name, ExitCode.UNKNOWN_UNIT),
]


@pytest.mark.parametrize(("argv", "code"), CASES, ids=[case.__name__ for case, _ in CASES])
def test_hostile_text_at_a_raise_site_reaches_stderr_as_one_bounded_line(
    argv: object, code: ExitCode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv(tmp_path)) == code  # type: ignore[operator]
    captured = capsys.readouterr()
    assert captured.out == ""
    assert one_operator_line(captured.err).startswith("gpugate: ")


@pytest.mark.parametrize("message", [HOSTILE, "plain", "x" * (3 * LINE_CHARS)])
def test_each_channel_carries_an_error_as_one_escaped_bounded_line(message: str) -> None:
    from gpugate.report.narrate import Narrator

    reporter, journal, notifier, _ = make()
    stream = io.StringIO()
    Narrator(reporter).failed(UnknownUnit(message), stream)
    ((entry, fields),) = journal.entries
    assert fields["GPUGATE_EXIT_CODE"] == str(int(ExitCode.UNKNOWN_UNIT))
    for text in (entry, notifier.states[-1], stream.getvalue().rstrip("\n")):
        assert "\n" not in text and text.isprintable(), text[:200]
        assert len(text) <= LINE_CHARS + len("STATUS=gpugate pre: failed: ")


def gate_error_classes() -> set[str]:
    """GateError and every subclass defined in src (BadInput, HeldByOthers, ...)."""
    names = {"GateError"}
    classes = [
        node
        for path in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    grew = True
    while grew:
        grew = False
        for node in classes:
            bases = {getattr(base, "id", getattr(base, "attr", "")) for base in node.bases}
            if node.name not in names and bases & names:
                names.add(node.name)
                grew = True
    return names


def test_every_error_class_keeps_a_documented_exit_code() -> None:
    """Each class's exit code is one of ExitCode's (README lists them; tests/test_docs.py)."""
    import gpugate.front.commands.run
    import gpugate.front.commands.slurm
    import gpugate.host.nvml
    import gpugate.host.oci
    import gpugate.integrations.records  # noqa: F401  (their error classes)

    def subclasses(kind: type[GateError]) -> list[type[GateError]]:
        return [kind, *(s for sub in kind.__subclasses__() for s in subclasses(sub))]

    found = {kind.__name__: kind.exit_code for kind in subclasses(GateError)}
    assert set(found) == gate_error_classes()
    assert all(isinstance(code, ExitCode) for code in found.values())
    assert found["GateError"] is ExitCode.INTERNAL
    assert {name for name, code in found.items() if code is ExitCode.INTERNAL} == {"GateError"}


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def test_every_install_note_code_is_worded() -> None:
    """install's plan carries its notes as codes (Change's fourth argument or note=, or a
    variable `note` passed there): each one used in src is in front.install.CHANGE_NOTES,
    which words it (a missing one would end install with an internal error)."""
    used: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and called_name(node) == "Change":
                given = [*node.args[3:4], *(k.value for k in node.keywords if k.arg == "note")]
            elif isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "note" for target in node.targets
            ):
                value = node.value
                given = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            else:
                continue
            used |= {n.value for n in given if isinstance(n, ast.Constant)}
    used.discard("")
    assert {"edited", "edited-forced", "runtime-added", "runtime-removed"} <= used
    assert used <= set(CHANGE_NOTES), used - set(CHANGE_NOTES)
