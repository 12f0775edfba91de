"""Every word an operator reads is made in `report/`: read with `ast`, no module outside it puts
prose in what reaches an operator (an exception's message, print(), a stream's write(), a
journal entry, STATUS=), and every gpugate error is raised with a `Problem` code and facts,
which `report.error_text` words. The exceptions are named below, each with why."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpugate.errors import GateError, Problem
from gpugate.report.error_text import WORDS
from gpugate.report.lines import CHANGE_NOTES

SRC = Path(__file__).resolve().parents[2] / "src" / "gpugate"
# Calls whose text an operator reads: print(), a stream's write(), the journal and sd_notify
# (Reporter.event/fail/status, Journal.send, Notifier.notify), sys.exit(TEXT).
# install's plan (Change: its note is a code that report.lines words).
SAID_BY = {"print", "write", "event", "fail", "status", "send", "notify", "exit", "Change"}
# Two words of letters with a space between: prose, not a code ("config-not-toml"), a path
# or a format's punctuation ("{path}: {cause}").
PROSE = re.compile(r"[A-Za-z]{2,} [A-Za-z]{2,}")
# (module, the literal's start): prose allowed there, and why.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("host/programs.py", ": not an absolute path (find_program)"): (
        "a caller's bug (a ValueError), for the traceback GPUGATE_DEBUG=1 shows; no operator "
        "meets it"
    ),
}
# Modules whose prose is another branch's to move this round; the rule holds them as soon
# as they are off this list.
IN_FLIGHT: set[str] = {"host/scan_split.py"}  # issue 40: messages formed where raised
FIX = (
    "the words belong in report/: raise the error with a Problem code and its facts "
    "(`raise XError(Problem.NAME, path=path)`, errors.Problem) and add its words to "
    "report/error_text.WORDS; a line printed or sent to the journal is a function in "
    "report/lines.py (or report/narrate*.py) that this module calls with the facts. A literal "
    "that is no operator's text goes in EXCEPTIONS in tests/core/test_wording.py, with why."
)


def gate_errors() -> set[str]:
    """The names of GateError and every subclass defined in src (RunError, SlurmEnvError...)."""
    names = {"GateError"}
    classes: list[ast.ClassDef] = []
    for path in SRC.rglob("*.py"):
        classes += [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for node in classes:
            bases = {getattr(base, "id", getattr(base, "attr", "")) for base in node.bases}
            if node.name not in names and bases & names:
                names.add(node.name)
                grew = True
    return names


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def literal_texts(node: ast.AST) -> Iterator[str]:
    """The literal text in an argument: a string, an f-string's constant parts (joined, the
    placeholders as {}), strings joined with +."""
    if isinstance(node, ast.JoinedStr):
        yield "".join(
            part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
        )
        for part in node.values:  # a placeholder's own literals: f"{'a b' if x else ''}"
            if isinstance(part, ast.FormattedValue):
                yield from literal_texts(part.value)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif not isinstance(node, ast.Lambda):
        for child in ast.iter_child_nodes(node):
            yield from literal_texts(child)


def spoken_calls(tree: ast.Module) -> Iterator[tuple[ast.Call, str]]:
    """Calls whose arguments an operator reads: raised exceptions and SAID_BY calls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            yield node.exc, "raise"
        elif isinstance(node, ast.Call) and called_name(node) in SAID_BY:
            yield node, called_name(node)


def prose_outside_report(
    tree: ast.Module, module: str, errors: set[str]
) -> Iterator[tuple[int, str]]:
    """(line, what is wrong) for each piece of operator wording made in this module."""
    for call, kind in spoken_calls(tree):
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            for text in literal_texts(arg):
                if PROSE.search(text) and not any(
                    module == where and part in text for where, part in EXCEPTIONS
                ):
                    yield call.lineno, f"{kind} {called_name(call)}(...) words it here: {text!r}"
        # StateUnwritable's problem defaults to STATE_OS_ERROR
        named = called_name(call)
        if kind == "raise" and named in errors - {"StateUnwritable"} and not has_problem_code(call):
            yield call.lineno, f"{called_name(call)}(...) is raised without a Problem code"


def has_problem_code(call: ast.Call) -> bool:
    return any(
        isinstance(arg, ast.Attribute) and getattr(arg.value, "id", "") == "Problem"
        for arg in call.args
    )


def modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        module = str(path.relative_to(SRC))
        if not module.startswith("report/") and module not in IN_FLIGHT:
            yield module, ast.parse(path.read_text(), module)


def test_operator_wording_is_made_in_report_only() -> None:
    errors = gate_errors()
    found = [
        f"src/gpugate/{module}:{line}: {what}"
        for module, tree in modules()
        for line, what in prose_outside_report(tree, module, errors)
    ]
    assert not found, "\n".join([*found, "", FIX])


BROKEN = """
import sys
from gpugate.errors import GateError, Problem, UnknownUnit

class RunError(GateError):
    pass

def f(unit, reporter, stream, exc):
    raise UnknownUnit(f"unit {unit!r}: systemd knows no such unit")
    raise RunError(Problem.LAUNCH_NO_COMMAND)
    raise RunError(exc.message)
    print("gpugate: warning: metrics not written", file=sys.stderr)
    print(f"{unit}: {exc}")
    stream.write("takes effect at the " + "next start\\n")
    reporter.event(kind, f"sparing PID {unit}", reason="cgroup")
    reporter.status(f"waiting for {unit}")
    raise ValueError(f"{unit!r}: not an absolute path (find_program)")
"""


def test_the_rule_catches_wording_outside_report() -> None:
    tree = ast.parse(BROKEN)
    errors = {"GateError", "UnknownUnit", "RunError"}
    found = sorted(prose_outside_report(tree, "front/broken.py", errors))
    assert [line for line, _ in found] == [9, 9, 11, 12, 14, 14, 15, 16, 17]
    assert found[0][1] == "UnknownUnit(...) is raised without a Problem code"
    assert "systemd knows no such unit" in found[1][1]
    assert found[2][1] == "RunError(...) is raised without a Problem code"  # words from elsewhere
    # the exception is named for one module only
    allowed = list(prose_outside_report(tree, "host/programs.py", errors))
    assert 17 not in [line for line, _ in allowed]


def test_every_problem_has_words_and_is_raised_somewhere() -> None:
    assert set(WORDS) == set(Problem)
    used = {
        node.attr
        for path in SRC.rglob("*.py")
        if path.name != "error_text.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "Problem"
    }
    unused = {problem.name for problem in Problem} - used - {"WORDED"}
    assert not unused, f"Problem codes no module raises: {sorted(unused)}"


@pytest.mark.parametrize("problem", list(Problem))
def test_each_problem_is_one_line_of_words(problem: Problem) -> None:
    """Worded with facts of the raise sites' types (absent ones read as empty)."""
    facts: dict[str, object] = {"kill_s": 12.0, "wait_timeout_s": 10.0, "timeout_s": 30.0}
    facts.update(would_kill=["PID 1 (x)"] * 7, listed=[0, 1], paths=["/a", "/b"], value="x")
    facts.update(detail="Input should be a valid integer", cause="No space left", text="words")
    text = GateError(problem, **facts).message
    assert text and "\n" not in text and problem.value not in text


def test_every_install_note_code_is_worded() -> None:
    """install's plan carries its notes as codes (Change's fourth argument or note=, or a
    variable `note` passed there): each one used in src is in report.lines.CHANGE_NOTES,
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
