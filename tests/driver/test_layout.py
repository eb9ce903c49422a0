"""The driver's shape, pinned: no import cycle among e2's modules, no module or
function past the sizes below, and a commands/<verb>.py for every verb.

Each check reads the sources with ``ast`` (nothing is imported but e2.cli for
the verb list), so a failure names the file, function or cycle to fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

from e2 import cli

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
E2 = SCRIPTS / "e2"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SCRIPTS).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def e2_imports(path: Path, modules: set[str]) -> set[str]:
    """The e2 modules ``path`` imports anywhere in it: at module level, inside
    functions and under ``if TYPE_CHECKING`` alike (a cycle dodged by importing
    late is still a cycle)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from e2 import apply` imports the module e2.apply
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in E2.rglob("*.py")}
    modules = set(files)
    # importing a package runs its __init__, but that is not an edge worth a cycle
    return {name: e2_imports(path, modules) - {"e2"} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_read_whole():
    graph = import_graph()
    # a sample of edges the graph must see, or the cycle check below proves nothing
    assert {"e2.series", "e2.gitops", "e2.export"} <= graph["e2.apply"]  # from-imports
    assert "e2.commands.apply" in graph["e2.cli"]
    assert "e2.probes.capacity" in graph["e2.probes.capacity_matrix"]
    assert len(graph) > 60


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_e2_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_over_the_line_limit():
    sizes = {path: len(path.read_text().splitlines()) for path in SCRIPTS.rglob("*.py")}
    assert len(sizes) > 60
    over = {str(path.relative_to(SCRIPTS)): n for path, n in sizes.items()
            if n > MAX_MODULE_LINES}
    assert over == {}


def test_no_function_over_the_line_limit():
    over = {}
    for path in SCRIPTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(SCRIPTS)}:{node.lineno} {node.name}"] = length
    assert over == {}


def test_every_verb_has_its_commands_module():
    subparsers = next(action for action in cli.build_parser()._actions
                      if action.dest == "command")
    verbs = [choice.dest for choice in subparsers._choices_actions]
    assert verbs == ["apply", "overlay", "verify", "export", "status", "rebase", "drift", "env",
                     "test", "image", "probe", "models"]
    missing = [verb for verb in verbs if not (E2 / "commands" / f"{verb}.py").is_file()]
    assert missing == []


def leaf_parsers(parser: argparse.ArgumentParser, name: str = "e2"):
    """(`e2 VERB [SUB]`, parser) for every parser that runs something."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield name, parser
    for action in subparsers:
        for verb, child in action.choices.items():
            yield from leaf_parsers(child, f"{name} {verb}")


def test_every_options_field_is_an_argument_of_its_verb():
    """cli.verb_options fills a verb's dataclass by name from its parser's arguments:
    a field with no argument, or an argument with no field, is a bug it would only
    meet at run time."""
    leaves = list(leaf_parsers(cli.build_parser()))
    assert len(leaves) == 19  # 8 verbs without a sub-verb; test 3, image 4, probe 2, models 2
    for name, parser in leaves:
        options = parser.get_default("options")
        assert dataclasses.is_dataclass(options), f"{name}: no options dataclass"
        assert options.__dataclass_params__.frozen, f"{name}: {options.__name__} not frozen"
        arguments = {a.dest for a in parser._actions if a.dest != "help"}
        fields = {f.name for f in dataclasses.fields(options)}
        assert fields == arguments, f"{name}: {options.__name__}"
