"""README.md is for operators and short; docs/ holds the rest. The exit codes and config fields
they name are the code's, and every one of the code's is named."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpugate.config.schema import GateConfig, PhasePolicy, SweepPolicy
from gpugate.core.decide import Rule
from gpugate.errors import ExitCode
from gpugate.front.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PHASE_TABLES = {"pre", "post", "prolog", "epilog"}


def documents() -> dict[str, str]:
    paths = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
    return {str(path.relative_to(REPO)): path.read_text() for path in paths}


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


def systemd_labels(text: str) -> dict[int, str]:
    """`| 21 | MEMORY_TIMEOUT | `status=21/n/a` | ...`: the label systemd logs, by code."""
    rows = re.findall(r"^\| (\d+) \| [A-Z_]+ \| `status=([^`]+)` \|", text, re.MULTILINE)
    return {int(code): label for code, label in rows}


def test_exit_codes_in_the_docs_are_the_codes() -> None:
    documented: dict[int, str] = {}
    for text in documents().values():
        documented.update(exit_code_rows(text))
    assert documented == {int(code): code.name for code in ExitCode}
    # README's table, the one full account of them: each code's systemd label is the code's
    labels = systemd_labels(README.read_text())
    assert labels == {int(code): code.systemd_label for code in ExitCode}
    # and every "exit N" in prose in gpugate's ranges (20-29, 64-81; others are a COMMAND's
    # own status, as `gpugate run` passes it on) is a code
    codes = {int(code) for code in ExitCode}
    for name, text in documents().items():
        for number in map(int, re.findall(r"\bexits? (\d+)\b", text)):
            if 20 <= number <= 29 or 64 <= number <= 81:
                assert number in codes, f"{name}: exit {number}"


@dataclass(frozen=True)
class Table:
    """A markdown table: its header's cells, and each row's cells with its line number."""

    source: str
    line: int
    header: list[str]
    rows: list[tuple[int, list[str]]]


def cells(line: str) -> list[str]:
    """A table row's cells, split on `|` but not on `\\|` (GFM: an escaped bar is a bar in the
    cell, also inside a code span: `prolog\\|epilog`)."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", inner)]


def tables(text: str, source: str = "<text>") -> list[Table]:
    """Every table: a run of lines that start with `|`, the second its `| --- |` line."""
    found: list[Table] = []
    block: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.lstrip().startswith("|"):
            block.append((number, line))
            continue
        if block:
            rows = [(n, cells(row)) for n, row in block]
            delimiter = len(rows) > 1 and all(re.fullmatch(r":?-{3,}:?", c) for c in rows[1][1])
            found.append(Table(source, block[0][0], rows[0][1], rows[2 if delimiter else 1 :]))
            block = []
    return found


def section(text: str, title: str) -> str:
    """The text under `## title`, to the next `## ` heading ("" when there is none)."""
    parts = text.split(f"\n## {title}\n", 1)
    return parts[1].split("\n## ", 1)[0] if len(parts) > 1 else ""


def ragged_rows(table: Table) -> list[str]:
    """Rows whose number of cells is not the header's: a cell that ran into the next column,
    or a stray row (`| just one cell |`)."""
    width = len(table.header)
    return [
        f"{table.source}:{line}: {len(row)} cell(s), the header has {width}"
        for line, row in table.rows
        if len(row) != width
    ]


def test_every_table_row_has_its_headers_cells() -> None:
    ragged = [
        problem
        for name, text in documents().items()
        for table in tables(text, name)
        for problem in ragged_rows(table)
    ]
    assert not ragged, "\n".join(ragged)


def config_names(text: str) -> list[str]:
    """The names in the first column of the Configuration section's table, in order, each time
    it names them (`[pre]`, `[post]` name the per-phase tables)."""
    names: list[str] = []
    for table in tables(section(text, "Configuration")):
        for _, row in table.rows:
            names.extend(re.findall(r"`\[?([a-z_]+)\]?`", row[0]))
    return names


def config_problems(text: str, fields: set[str]) -> list[str]:
    names = config_names(text)
    twice = sorted({name for name in names if names.count(name) > 1})
    problems = [
        f"`{name}` is in the configuration table {names.count(name)} times" for name in twice
    ]
    problems += [
        f"`{name}` is not in the configuration table" for name in sorted(fields - set(names))
    ]
    problems += [f"`{name}` is in the table but no field" for name in sorted(set(names) - fields)]
    return problems


def config_fields() -> set[str]:
    return (
        set(GateConfig.model_fields)
        | set(PhasePolicy.model_fields)
        | set(SweepPolicy.model_fields)
        | PHASE_TABLES
    )


def test_the_configuration_table_names_every_field_once() -> None:
    assert config_problems(README.read_text(), config_fields()) == []


def cli_commands() -> list[str]:
    """Every command the parser knows, subcommands spelled out: `config check`, `slurm prolog`."""

    def walk(parser: argparse.ArgumentParser, prefix: str) -> Iterator[str]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{prefix} {name}".strip())
                return
        yield prefix

    return list(walk(build_parser(), ""))


def command_problems(text: str, commands: list[str]) -> list[str]:
    """Commands the README's Commands table has no row for; `slurm prolog\\|epilog` stands for
    both, as `install\\|uninstall --containers` does; a cell may name several, comma-separated."""
    rows = [row[0] for table in tables(section(text, "Commands")) for _, row in table.rows]
    spelled = []
    for cell in rows:
        for match in re.finditer(
            r"(?:^|, )`gpugate ([a-z-]+(?:\\\|[a-z-]+)*(?: [a-z][a-z|\\-]*)?)", cell
        ):
            words = match.group(1).replace("\\|", "|").split(" ")
            subs = words[1].split("|") if len(words) > 1 else [""]
            spelled += [f"{top} {sub}".strip() for top in words[0].split("|") for sub in subs]
    return [
        f"`gpugate {command}` has no row in README's Commands table"
        for command in commands
        if command not in spelled and command.split(" ")[0] not in spelled
    ]


def test_every_command_has_a_row_in_the_commands_table() -> None:
    commands = cli_commands()
    assert {"pre", "post", "run", "config check", "slurm prolog"} <= set(commands)
    assert command_problems(README.read_text(), commands) == []


BROKEN_README = """
## Documentation

| file | what it covers |
| --- | --- |
| [docs/slurm.md](docs/slurm.md) | `gpugate run [--gpus LIST] -- COMMAND` | start a server by hand | x |
| `gpugate slurm prolog\\|epilog` on a Slurm GPU node; drain reasons |

## Commands

| command | what it does |
| --- | --- |
| `gpugate pre [UNIT]` | for `ExecStartPre=` |
| `gpugate slurm prolog\\|epilog [--dry-run]` | for slurm.conf |

## Configuration

| field | default | meaning |
| --- | --- | --- |
| `gpus` | `"auto"` | the unit's GPUs |
| `remove_shm` | `true` | remove the killed's files |
| `remove_shm` | `true` | remove the files (POSIX shared memory, semaphores) |
"""


def test_the_docs_rules_catch_each_defect_of_a_broken_readme() -> None:
    ragged = [p for t in tables(BROKEN_README, "README.md") for p in ragged_rows(t)]
    assert ragged == [
        "README.md:6: 4 cell(s), the header has 2",
        "README.md:7: 1 cell(s), the header has 2",
    ]
    commands = ["pre", "run", "slurm prolog", "slurm epilog"]
    assert command_problems(BROKEN_README, commands) == [
        "`gpugate run` has no row in README's Commands table"
    ]
    assert config_problems(BROKEN_README, {"gpus", "remove_shm", "free_mib"}) == [
        "`remove_shm` is in the configuration table 2 times",
        "`free_mib` is not in the configuration table",
    ]
    fixed = BROKEN_README.replace("| `remove_shm` | `true` | remove the killed's files |\n", "")
    assert config_problems(fixed, {"gpus", "remove_shm"}) == []


def test_the_rules_catch_a_wrong_row() -> None:
    assert exit_code_rows("| 99 | NOPE | x |\n") == {99: "NOPE"}
    assert config_names("\n## Configuration\n| f | d |\n| --- | --- |\n| `frobnicate` | 1 |\n") == [
        "frobnicate"
    ]
    assert cells("| `a\\|b` | c |") == ["`a\\|b`", "c"]


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
    # PRIORITY= itself; gpus= is GPUGATE_GPU; echo= says whether the entry goes to stderr too
    fields -= {"GPUGATE_PRIORITY", "GPUGATE_GPUS", "GPUGATE_ECHO"}
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


def layout_rows(text: str) -> dict[str, str]:
    """CONTRIBUTING's Layout: each `### ` subsection's whole text, by its heading."""
    parts = section(text, "Layout").split("\n### ")[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


def unnamed_modules(text: str, modules: list[str]) -> list[str]:
    """Modules (`host/scan.py`, `integrations/unit/leases.py`, `errors.py`) that the Layout
    subsection of their top folder (or, for a top-level module, the subsection whose heading names
    it) does not name; a module in a subfolder is named beside the subfolder (`unit/`). A
    package's `__init__.py` is named by its folder."""
    rows = layout_rows(text)
    problems = []
    for module in modules:
        parts = module.split("/")
        if parts[-1] == "__init__.py":
            continue
        first = f"`{parts[0]}/`" if len(parts) > 1 else f"`{parts[0]}`"
        row = next((whole for cell, whole in rows.items() if first in cell), "")
        needed = [parts[-1], *(f"{sub}/" for sub in parts[1:-1])]
        if not row or not all(re.search(rf"(?<![\w/]){re.escape(n)}", row) for n in needed):
            problems.append(f"`{module}` is not named in CONTRIBUTING's Layout")
    return problems


def gpugate_modules() -> list[str]:
    package = REPO / "src" / "gpugate"
    return sorted(str(path.relative_to(package)) for path in package.rglob("*.py"))


def test_the_layout_names_every_module() -> None:
    modules = gpugate_modules()
    assert {"errors.py", "host/scan.py", "integrations/records.py"} <= set(modules)
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    assert unnamed_modules(contributing, modules) == []


BROKEN_LAYOUT = """
## Layout

### The base: `errors.py`

- `errors.py`: exit codes

### `host/`: the machine

- `scan.py`: the pass
- `narrate_scan.py`: words

### `integrations/`

- `unit/`: `leases.py`
"""


def test_the_layout_rule_catches_an_unnamed_module() -> None:
    modules = [
        "errors.py",
        "phase.py",
        "host/__init__.py",
        "host/scan.py",
        "host/narrate.py",
        "host/scan_watch.py",
        "integrations/unit/leases.py",
        "integrations/slurm/leases.py",
        "report/narrate.py",
    ]
    assert unnamed_modules(BROKEN_LAYOUT, modules) == [
        f"`{name}` is not named in CONTRIBUTING's Layout"
        for name in (
            "phase.py",
            "host/narrate.py",
            "host/scan_watch.py",
            "integrations/slurm/leases.py",
            "report/narrate.py",
        )
    ]
