"""README.md is for operators and short; docs/ holds the rest. The exit codes and config fields
they name are the code's, and every one of the code's is named."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gpugate.config.models import GateConfig, PhasePolicy
from gpugate.core.decide import Rule
from gpugate.errors import ExitCode

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300
PHASE_TABLES = {"pre", "post", "prolog", "epilog"}


def documents() -> dict[str, str]:
    paths = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
    return {str(path.relative_to(REPO)): path.read_text() for path in paths}


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_quick_start_is_the_two_commands() -> None:
    section = README.read_text().split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^    (\S.*)$", section, re.MULTILINE)
    assert commands == ["./scripts/demo", "./scripts/test"]


def test_every_local_link_resolves() -> None:
    broken = []
    for name, text in documents().items():
        base = (REPO / name).parent
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (base / target).exists():
                broken.append(f"{name}: {target}")
    assert not broken, broken


def exit_code_rows(text: str) -> dict[int, str]:
    """`| 21 | MEMORY_TIMEOUT | ...` rows of an exit-code table."""
    rows = re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", text, re.MULTILINE)
    return {int(code): name for code, name in rows}


def test_exit_codes_in_the_docs_are_the_codes() -> None:
    documented: dict[int, str] = {}
    for text in documents().values():
        documented.update(exit_code_rows(text))
    assert documented == {int(code): code.name for code in ExitCode}
    # and every "exit N" in prose in gpugate's ranges (20-29, 64-81; others are a COMMAND's
    # own status, as `gpugate run` passes it on) is a code
    codes = {int(code) for code in ExitCode}
    for name, text in documents().items():
        for number in map(int, re.findall(r"\bexits? (\d+)\b", text)):
            if 20 <= number <= 29 or 64 <= number <= 81:
                assert number in codes, f"{name}: exit {number}"


def config_rows(text: str) -> set[str]:
    section = text.split("\n## Configuration", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for cell in re.findall(r"^\| ([^|]+) \|", section, re.MULTILINE):
        names.update(re.findall(r"`\[?([a-z_]+)\]?`", cell))
    return names


def test_config_fields_in_the_readme_are_the_fields() -> None:
    fields = set(GateConfig.model_fields) | set(PhasePolicy.model_fields)
    assert config_rows(README.read_text()) == fields | PHASE_TABLES


def test_the_rules_catch_a_wrong_row() -> None:
    assert exit_code_rows("| 99 | NOPE | x |\n") == {99: "NOPE"}
    assert config_rows("\n## Configuration\n| `frobnicate` | 1 | x |\n") == {"frobnicate"}


def event_calls() -> list[ast.Call]:
    calls = []
    for path in sorted((REPO / "src" / "gpugate" / "report").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "event":
                calls.append(node)
    return calls


def test_every_journal_field_and_reason_code_is_documented() -> None:
    journal = (REPO / "docs" / "journal.md").read_text()
    calls = event_calls()
    assert len(calls) > 20  # the narration's entries were found
    fields = {f"GPUGATE_{k.arg.upper()}" for c in calls for k in c.keywords if k.arg}
    fields -= {"GPUGATE_PRIORITY", "GPUGATE_GPUS"}  # PRIORITY= itself; gpus= is GPUGATE_GPU
    codes = {
        k.value.value
        for c in calls
        for k in c.keywords
        if k.arg == "reason" and isinstance(k.value, ast.Constant)
    }
    codes |= {rule.value for rule in Rule}
    missing = {f for f in fields if f not in journal} | {
        c for c in codes if f"`{c}`" not in journal
    }
    assert not missing, sorted(missing)
