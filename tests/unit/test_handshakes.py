"""Tests synchronise on handshakes (ready files, pipes, pidfds, waitid, `journalctl --sync`),
never on sleeps: read with `ast`, a `time.sleep` in tests/ stands only inside a loop that waits
on a condition (a poll with a deadline, where nothing offers a handshake) or holds a process
until it is killed (a constant of a minute or more)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HOLD_S = 60  # a sleep this long holds a process until the test kills it; it synchronises nothing


def is_sleep(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and getattr(func.value, "id", "") == "time"
    return False


def bare_sleeps(tree: ast.Module) -> Iterator[int]:
    """Lines of sleeps outside any loop, other than a hold."""

    def visit(node: ast.AST, in_loop: bool) -> Iterator[int]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, False)
                continue
            looping = in_loop or isinstance(child, (ast.While, ast.For))
            if isinstance(child, ast.Call) and is_sleep(child) and not looping:
                held = (
                    child.args
                    and isinstance(child.args[0], ast.Constant)
                    and isinstance(child.args[0].value, (int, float))
                    and child.args[0].value >= HOLD_S
                )
                if not held:
                    yield child.lineno
            yield from visit(child, looping)

    yield from visit(tree, False)


def test_no_test_sleeps_to_synchronise() -> None:
    found = [
        f"{path.relative_to(TESTS.parent)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in bare_sleeps(ast.parse(path.read_text()))
    ]
    assert not found, (
        "a sleep that waits for something to have happened: "
        + ", ".join(found)
        + "; wait on a handshake instead (a ready file or pipe the other side writes, "
        "waitid/pidfd for an exit, `journalctl --sync`), or poll the condition itself in a "
        "loop with a deadline where nothing offers one"
    )


def test_the_rule_tells_a_sleep_from_a_poll_and_a_hold() -> None:
    source = (
        "import time\n"
        "def f(ready):\n"
        "    time.sleep(0.5)\n"  # 3: flagged
        "    while not ready():\n"
        "        time.sleep(0.05)\n"
        "    time.sleep(3600)\n"
        "    for _ in range(3):\n"
        "        time.sleep(1)\n"
        "    def g():\n"
        "        time.sleep(0.2)\n"  # 10: flagged, a function of its own inside the function
    )
    assert list(bare_sleeps(ast.parse(source))) == [3, 10]
