"""The promises of src/gpugate's layout, read with `ast`: which subpackage may import which, no
import cycle, no phase told by its name outside the phase type, no write to psutil's
module-global root. The rules are CONTRIBUTING.md's "Layout"."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import gpugate
from gpugate.errors import ExitCode, GateError

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


# One exception family: every class gpugate raises is defined in errors.py, so each exit code
# has one class and each class one code (CONTRIBUTING.md, "Adding an exit code").
BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def base_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


def exception_classes(trees: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(module, class) of every class deriving, in these trees, from a built-in exception."""
    classes = [
        (name, node)
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    known = set(BUILTIN_EXCEPTIONS)
    found: set[tuple[str, str]] = set()
    while True:
        new = {(name, node.name) for name, node in classes if base_names(node) & known}
        if new <= found:
            return found
        found |= new
        known |= {cls for _, cls in new}


def test_every_exception_class_is_defined_in_errors() -> None:
    trees = {module_name(path): tree for path, tree in modules()}
    elsewhere = {(m, c) for m, c in exception_classes(trees) if m != "gpugate.errors"}
    assert not elsewhere, sorted(elsewhere)


def gate_errors() -> list[type[GateError]]:
    """GateError and its subclasses, every gpugate module loaded."""
    for info in pkgutil.walk_packages(gpugate.__path__, "gpugate."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    pending, seen = [GateError], []
    while pending:
        cls = pending.pop()
        seen.append(cls)
        pending.extend(cls.__subclasses__())
    return [cls for cls in seen if cls.__module__.startswith("gpugate")]


def test_every_gate_error_is_defined_in_errors() -> None:
    """At run time too: a subclass made under another name (an alias, a base by attribute)."""
    found = gate_errors()
    assert len(found) > 10
    assert [cls for cls in found if cls.__module__ != "gpugate.errors"] == []


# Two classes share a code only where a caller must tell them apart: on_nvml_error = "warn"
# goes on without NVML, never without systemctl. A subclass that keeps its base's code (GpuError:
# which GPU) is its base's refinement, not a second class for the code.
SHARED_CODES = {ExitCode.NVML_UNAVAILABLE: {"NvmlUnavailable", "ProgramUnavailable"}}


def shared_codes(classes: list[type[GateError]]) -> dict[ExitCode, set[str]]:
    """The codes that more than one class sets for itself."""
    by_code: dict[ExitCode, set[str]] = {}
    for cls in classes:
        if "exit_code" in vars(cls):
            by_code.setdefault(cls.exit_code, set()).add(cls.__name__)
    return {code: names for code, names in by_code.items() if len(names) > 1}


def test_one_class_per_exit_code() -> None:
    assert shared_codes(gate_errors()) == SHARED_CODES


def test_the_one_class_rule_catches_a_second_class_for_a_code() -> None:
    class OciInput(GateError):
        exit_code = ExitCode.USAGE

    class SlurmEnv(GateError):
        exit_code = ExitCode.USAGE

    class Refined(OciInput):
        pass

    assert shared_codes([OciInput, SlurmEnv, Refined]) == {ExitCode.USAGE: {"OciInput", "SlurmEnv"}}


def test_the_exception_rule_catches_a_class_in_a_fixture_tree() -> None:
    errors = ast.parse("class GateError(Exception): ...\nclass Fine(GateError): ...\n")
    broken = ast.parse(
        "from gpugate import errors\n"
        "from gpugate.errors import GateError\n"
        "class Mine(GateError): ...\n"
        "class Deeper(Mine): ...\n"
        "class ByAttribute(errors.GateError): ...\n"
        "class Own(OSError): ...\n"
        "class Plain: ...\n"
        "class Derived(Plain): ...\n"
    )
    found = exception_classes({"gpugate.errors": errors, "gpugate.host.x": broken})
    assert {c for m, c in found if m != "gpugate.errors"} == {
        "Mine",
        "Deeper",
        "ByAttribute",
        "Own",
    }


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
