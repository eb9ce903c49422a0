"""Python source as the driver's own checks read it (rebase hot spots, the
release's checks): parsed once per text, and without paying the garbage
collector for it."""

from __future__ import annotations

import ast
import functools
import gc
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse`` with the cyclic collector paused: the AST of a big vLLM file is
    hundreds of thousands of new objects, and the collections they set off walk
    every object alive, which took longer than the parse itself. An AST has no
    reference cycles, so reference counting frees it once it is dropped."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename)
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Definition:
    qualname: str
    is_class: bool
    first: int               # the def or class line
    last: int | None         # the AST's end line


@dataclass(frozen=True)
class Outline:
    """What the checks read of one text, kept instead of its AST: the ASTs of a few
    dozen big files held at once made every collection walk them all."""
    definitions: tuple[Definition, ...]   # each nested one after its parent
    imports: tuple[ast.Import | ast.ImportFrom, ...]  # in ast.walk's order


@functools.lru_cache(maxsize=256)
def outline(text: str) -> Outline | None:
    """The outline of ``text``, None where it does not compile. Cached: a rebase
    reads the same big files in its hot spots and again in the release's checks."""
    try:
        tree = parse(text)
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return None
    definitions = tuple(Definition(name, isinstance(node, ast.ClassDef), node.lineno,
                                   node.end_lineno) for name, node in definitions_of(tree))
    return Outline(definitions, imports_of(tree))


def imports_of(tree: ast.AST) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The import statements of ``tree``, in ast.walk's order."""
    return tuple(node for node in statements(tree)
                 if isinstance(node, ast.Import | ast.ImportFrom))


def definitions_of(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.stmt]]:
    """The functions and classes of ``tree`` by qualified name, each nested one after
    its parent (not those under an if, a try or a with)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from definitions_of(node, f"{name}.")


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def statements(tree: ast.AST) -> Iterator[ast.AST]:
    """The statements of ``tree`` (and ``tree``) in ast.walk's order, without walking
    the expressions: they are most of the nodes, and no statement is inside one."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BLOCKS))
