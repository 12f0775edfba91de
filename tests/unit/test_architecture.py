"""The shape of src/gpugate, read with `ast`: which subpackage may import which, no phase told
by its name outside the phase type, no write to psutil's module-global root, and functions
short enough to read. The rules are CONTRIBUTING.md's "Layout"."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "gpugate"
# beside every layer: exit codes, phases, back-ports, the escaping of untrusted text
BASE = {"errors", "phase", "compat", "untrusted"}
# A layer may import itself and what is listed; `front` may import anything.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "phase": set(),
    "compat": set(),
    "untrusted": set(),
    "host": {"errors", "compat", "untrusted"},
    "config": BASE | {"host"},
    "core": BASE | {"config", "host"},
    "report": BASE | {"config", "host", "core"},
    "integrations": BASE | {"config", "host", "core", "report"},
}
PHASE_NAMES = {"pre", "post", "prolog", "epilog"}
MAX_FUNCTION_LINES = 50  # def line to last line, docstring included


def modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def layer(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def imported_layers(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every import of a gpugate layer, also those for annotations only (TYPE_CHECKING):
    a type from a layer above is a dependency on it all the same."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "gpugate" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_imports_go_down_the_layers_only() -> None:
    wrong = []
    for path, tree in modules():
        own = layer(path)
        if own not in ALLOWED:
            continue  # front, __init__, __main__: the top
        for line, target in imported_layers(tree):
            if target != own and target not in ALLOWED[own]:
                wrong.append(f"{path.relative_to(SRC)}:{line}: {own} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_rule_catches_a_core_module_importing_an_integration() -> None:
    tree = ast.parse("from gpugate.integrations.unit import leases\nimport gpugate.front.cli\n")
    assert [target for _, target in imported_layers(tree)] == ["integrations", "front"]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gpugate.front.cli\n"
    assert [target for _, target in imported_layers(ast.parse(guarded))] == ["front"]


def phase_name_comparisons(tree: ast.Module) -> Iterator[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                if isinstance(operand, ast.Constant) and operand.value in PHASE_NAMES:
                    yield node.lineno
                if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) and any(
                    isinstance(e, ast.Constant) and e.value in PHASE_NAMES for e in operand.elts
                ):
                    yield node.lineno


def test_no_phase_is_told_by_its_name_outside_the_phase_type() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path, tree in modules()
        if path.name != "phase.py"
        for line in phase_name_comparisons(tree)
    ]
    assert not found, found
    assert list(phase_name_comparisons(ast.parse('if phase == "pre": pass'))) == [1]


def test_nothing_writes_psutils_proc_root() -> None:
    writes = []
    for path, tree in modules():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                targets = [node.args[1]] if len(node.args) > 1 else []
            for target in targets:
                text = ast.unparse(target)
                if "PROCFS_PATH" in text:
                    writes.append(f"{path.relative_to(SRC)}:{node.lineno}: {text}")
    assert not writes, writes


def long_functions(tree: ast.Module, limit: int) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                yield node.name, length


def test_no_function_is_longer_than_a_screen() -> None:
    found = [
        f"{path.relative_to(SRC)}: {name} ({length} lines)"
        for path, tree in modules()
        for name, length in long_functions(tree, MAX_FUNCTION_LINES)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("body_lines, flagged", [(49, False), (50, True)])
def test_the_length_rule_counts_from_def_to_the_last_line(body_lines: int, flagged: bool) -> None:
    source = "def f():\n    x = 1\n" + "    x += 1\n" * (body_lines - 1)
    assert bool(list(long_functions(ast.parse(source), MAX_FUNCTION_LINES))) is flagged


# The phase run's stage machine: its state and stages are the core's; the front sees a run
# through core.run (PhaseRun, its Progress and transitions) and core.outcome's codes.
MACHINE_INSIDES = {
    "RunState",
    "StageStep",
    "Looking",
    "Locking",
    "Stopping",
    "Waiting",
    "Finishing",
}
MAX_CORE_CLASS_LINES = 150


def machine_imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "gpugate.core.run":
            for alias in node.names:
                if alias.name in MACHINE_INSIDES:
                    yield node.lineno, f"{node.module}.{alias.name}"


def test_only_the_core_reads_the_stage_machine() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}: {module}"
        for path, tree in modules()
        if layer(path) != "core"
        for line, module in machine_imports(tree)
    ]
    private = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path, tree in modules()
        if layer(path) != "core"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in {"_state", "_transitions"}
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert not found and not private, found + private
    assert list(machine_imports(ast.parse("from gpugate.core.run import Looking, RunDeps"))) == [
        (1, "gpugate.core.run.Looking")
    ]


def test_no_core_class_is_longer_than_the_limit() -> None:
    found = [
        f"{path.relative_to(SRC)}: {node.name} ({(node.end_lineno or 0) - node.lineno + 1} lines)"
        for path, tree in modules()
        if layer(path) == "core"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_CORE_CLASS_LINES
    ]
    assert not found, "\n".join(found)


def module_name(path: Path, src: Path = SRC) -> str:
    parts = ["gpugate", *path.relative_to(src).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.Module, known: set[str]) -> Iterator[str]:
    """Every gpugate module a module imports, wherever the import stands (a function body,
    `if TYPE_CHECKING:`): `from gpugate.front import install` is gpugate.front.install."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                yield candidate if candidate in known else node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    known = set(trees)
    return {
        name: {target for target in imported_modules(tree, known) if target in known} - {name}
        for name, tree in trees.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle once, as the modules around it (Tarjan's strongly connected components of
    more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle() -> None:
    """Also imports inside functions and for annotations: a cycle is two modules that cannot
    be read, tested or moved one without the other. Break it by moving what both need into a
    third module below them (a protocol, a dataclass)."""
    trees = {module_name(path): tree for path, tree in modules()}
    cycles = import_cycles(import_graph(trees))
    assert not cycles, "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_rule_catches_a_cycle_in_a_fixture_tree(tmp_path: Path) -> None:
    files = {
        "front/__init__.py": "",
        "front/a.py": "def f():\n    from gpugate.front.b import g\n",
        "front/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpugate.front import a\n",
        "front/c.py": "import gpugate.front.a\n",
        "host/__init__.py": "",
        "host/x.py": "from gpugate.host import y\n",
        "host/y.py": "from gpugate.host.z import w\n",
        "host/z.py": "import gpugate.host.x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    trees = {
        module_name(path, tmp_path): ast.parse(path.read_text())
        for path in sorted(tmp_path.rglob("*.py"))
    }
    assert import_cycles(import_graph(trees)) == [
        ["gpugate.front.a", "gpugate.front.b"],
        ["gpugate.host.x", "gpugate.host.y", "gpugate.host.z"],
    ]
    del trees["gpugate.front.b"]
    assert len(import_cycles(import_graph(trees))) == 1


# The command line's modules: the parser and the console scripts call the commands; every
# command is a module (or package) of front/commands; what two commands share is below them.
COMMANDS = "gpugate.front.commands"
ABOVE_COMMANDS = {"gpugate.front.cli", "gpugate.front.entry"}


def command_of(module: str) -> str | None:
    """The command whose module (or package) this is; None: no command's."""
    prefix = COMMANDS + "."
    return module[len(prefix) :].split(".", maxsplit=1)[0] if module.startswith(prefix) else None


def commands_crossed(graph: dict[str, set[str]]) -> list[str]:
    """A command importing another command, and a module below the commands (front's shared
    helpers, every layer under front) importing any command."""
    wrong = []
    for name, targets in sorted(graph.items()):
        if name in ABOVE_COMMANDS:
            continue
        own = command_of(name)
        for target in sorted(targets):
            command = command_of(target)
            if command is not None and command != own:
                wrong.append(f"{name} imports {target}")
    return wrong


def test_no_command_imports_another_and_no_helper_imports_a_command() -> None:
    trees = {module_name(path): tree for path, tree in modules()}
    wrong = commands_crossed(import_graph(trees))
    assert not wrong, "\n".join(wrong)
    assert {command_of(name) for name in trees} >= {"pre_post", "run", "sweep", "oci_hook"}


def test_the_command_rule_catches_a_command_and_a_helper_importing_commands(
    tmp_path: Path,
) -> None:
    files = {
        "front/__init__.py": "",
        "front/cli.py": "from gpugate.front.commands import a\nimport gpugate.front.commands.b\n",
        "front/helper.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from gpugate.front.commands.a import f\n",
        "front/commands/__init__.py": "",
        "front/commands/a.py": "from gpugate.front.helper import g\n",
        "front/commands/b.py": "def h():\n    from gpugate.front.commands import a\n",
        "front/commands/c/__init__.py": "from gpugate.front.commands.c import run\n",
        "front/commands/c/run.py": "import gpugate.front.helper\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    trees = {
        module_name(path, tmp_path): ast.parse(path.read_text())
        for path in sorted(tmp_path.rglob("*.py"))
    }
    assert commands_crossed(import_graph(trees)) == [
        "gpugate.front.commands.b imports gpugate.front.commands.a",
        "gpugate.front.helper imports gpugate.front.commands.a",
    ]
