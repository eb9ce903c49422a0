"""What a clean apply may still break, clean hunks included:

- each patch hunk's enclosing upstream function, and whether upstream changed
  its body between the two releases (or moved or removed it);
- every ``vllm`` name the rebased files import still exists, and the functions
  the series' own import lines bring in kept their signatures;
- every patched Python file compiles.

A missing name or a file that does not compile is a stop; the rest is for review.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import git

from e2.rebase.moved import defined_in, show
from e2.rebase.state import PatchState, Words


class SpotKind(Words):
    FUNCTION_CHANGED = "function-changed"   # upstream changed the function a hunk is in
    FUNCTION_MOVED = "function-moved"
    FUNCTION_GONE = "function-gone"
    MISSING_NAME = "missing-name"           # an import that no longer resolves
    SIGNATURE = "signature"                 # an imported function's parameters changed
    SYNTAX = "syntax"                       # a patched file does not compile

    @property
    def stops(self) -> bool:
        return self in (SpotKind.MISSING_NAME, SpotKind.SYNTAX)


@dataclass
class HotSpot:
    kind: SpotKind
    patch: str
    file: str
    line: int
    what: str


def functions_touched(repo: git.Repo, patch: PatchState, old_tag: str,
                      new_tag: str) -> tuple[list[HotSpot], int]:
    """The upstream functions this patch's hunks sit in that changed, and how many it
    sits in at all."""
    assert patch.old_commit is not None
    diff = repo.git.diff("-U0", f"{patch.old_commit}^", patch.old_commit, "--", "*.py")
    seen: dict[tuple[str, str], int] = {}
    for file, start in _hunk_starts(diff):
        text = show(repo, f"{patch.old_commit}^", file)
        qualname = _enclosing(text, start) if text else None
        if qualname:
            seen.setdefault((file, qualname), start)
    spots = []
    for (file, qualname), start in seen.items():
        old = _source(show(repo, f"refs/tags/{old_tag}", file), qualname)
        if old is None:
            continue  # the patch's own function, not upstream's
        new = _source(show(repo, f"refs/tags/{new_tag}", file), qualname)
        where = file
        if new is None:
            homes = defined_in(repo, qualname.split(".")[-1], file)
            if not homes:
                spots.append(HotSpot(SpotKind.FUNCTION_GONE, patch.id, file, start,
                                     f"{qualname} is gone from {new_tag}"))
                continue
            where = homes[0]
            new = _source(show(repo, f"refs/tags/{new_tag}", where), qualname)
        if new is not None and new == old and where == file:
            continue
        kind = SpotKind.FUNCTION_CHANGED if where == file else SpotKind.FUNCTION_MOVED
        moved = "" if where == file else f", moved to {where}"
        changed = "changed" if new != old else "unchanged"
        spots.append(HotSpot(kind, patch.id, file, start,
                             f"{qualname}: body {changed} between {old_tag} and {new_tag}{moved}"))
    return spots, len(seen)


def _hunk_starts(diff: str) -> list[tuple[str, int]]:
    starts, file = [], ""
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            file = line[6:]
        elif line.startswith("@@ -"):
            starts.append((file, max(int(line[4:].split(",")[0].split()[0]), 1)))
    return starts


def _definitions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.stmt]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _definitions(node, f"{name}.")


def _enclosing(text: str, line: int) -> str | None:
    """The innermost function (qualified name) around ``line``."""
    tree = _parse(text)
    if tree is None:
        return None
    best = None
    for name, node in _definitions(tree):
        if isinstance(node, ast.ClassDef):
            continue
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            best = name  # later ones are nested deeper
    return best


def _source(text: str | None, qualname: str) -> str | None:
    if text is None or (tree := _parse(text)) is None:
        return None
    for name, node in _definitions(tree):
        if name == qualname:
            # whole lines: ast.get_source_segment splits the whole text on every call
            return "".join(_lines(text)[node.lineno - 1:node.end_lineno])
    return None


@functools.lru_cache(maxsize=64)
def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


# ---------------------------------------------------------------- names and syntax


def check_files(repo: git.Repo, new_tag: str, old_tag: str,
                added: dict[str, set[int]] | None = None) -> list[HotSpot]:
    """Every Python file the series changes on the new release (HEAD), or those of
    ``added`` (file -> the lines to check the imports of): it compiles, the vllm
    imports on its added lines resolve, and what they import kept its parameters."""
    spots: list[HotSpot] = []
    if added is None:
        added = added_lines(repo, f"refs/tags/{new_tag}", "HEAD")
    for file, lines in added.items():
        text = show(repo, "HEAD", file)
        if text is None:
            continue
        tree = _parse(text)
        if tree is None:
            try:
                compile(text, file, "exec", ast.PyCF_ONLY_AST)
            except SyntaxError as exc:
                spots.append(HotSpot(SpotKind.SYNTAX, "", file, exc.lineno or 0,
                                     f"does not compile: {exc.msg}"))
            continue
        for node in ast.walk(tree):
            # the series' own import lines: upstream's resolve in upstream
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm" \
                    and lines.intersection(range(node.lineno, (node.end_lineno or 0) + 1)):
                spots += _check_import(repo, file, node, old_tag, new_tag)
    return spots


def missing_names(repo: git.Repo, patch: PatchState, new_tag: str,
                  old_tag: str) -> list[HotSpot]:
    """What stops the rebase at ``patch``, just committed (HEAD): a vllm name its
    files import that the new release lacks, or one of its files that does not compile."""
    added = added_lines(repo, "HEAD^", "HEAD")
    spots = [s for s in check_files(repo, new_tag, old_tag, added) if s.kind.stops]
    for spot in spots:
        spot.patch = patch.id
    return spots


def added_lines(repo: git.Repo, old: str, new: str) -> dict[str, set[int]]:
    """The lines ``new`` adds over ``old`` in each Python file it adds or changes,
    from one ``git diff``."""
    added: dict[str, set[int]] = {}
    lines: set[int] | None = None
    for line in repo.git.diff("-U0", "--diff-filter=AM", old, new, "--", "*.py").splitlines():
        if line.startswith("diff --git "):
            lines = None  # the header: up to the first hunk
        elif lines is None and line.startswith("+++ b/"):
            lines = added.setdefault(line[6:], set())
        elif lines is not None and line.startswith("@@ "):
            plus = line.split()[2][1:].split(",")
            start, count = int(plus[0]), int(plus[1]) if len(plus) > 1 else 1
            lines.update(range(start, start + count))
    return added


def _check_import(repo: git.Repo, file: str, node: ast.ImportFrom, old_tag: str,
                  new_tag: str) -> list[HotSpot]:
    module = node.module or ""
    path = module.replace(".", "/")
    source_path = next((p for p in (f"{path}.py", f"{path}/__init__.py")
                        if show(repo, "HEAD", p) is not None), None)
    if source_path is None:
        return [HotSpot(SpotKind.MISSING_NAME, "", file, node.lineno,
                        f"module {module} does not exist")]
    module_text = show(repo, "HEAD", source_path) or ""
    names = _top_level_names(module_text)
    if names is None:
        return []  # a module with __getattr__ or a star import: names cannot be read
    spots = []
    for alias in node.names:
        if alias.name in names or show(repo, "HEAD", f"{path}/{alias.name}.py") is not None \
                or show(repo, "HEAD", f"{path}/{alias.name}/__init__.py") is not None:
            spots += _signature(repo, file, node, alias.name, source_path, old_tag, new_tag)
            continue
        homes = defined_in(repo, alias.name, source_path)
        where = f" (defined in {', '.join(homes[:2])})" if homes else ""
        spots.append(HotSpot(SpotKind.MISSING_NAME, "", file, node.lineno,
                             f"{module} has no {alias.name}{where}"))
    return spots


@functools.lru_cache(maxsize=256)
def _top_level_names(text: str) -> dict[str, ast.AST | None] | None:
    tree = _parse(text)
    if tree is None:
        return None
    if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
           for node in tree.body):
        return None  # names made on demand
    names: dict[str, ast.AST | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.setdefault(node.name, node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.setdefault((alias.asname or alias.name).split(".")[0], None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.setdefault(node.id, None)
    return names


def _signature(repo: git.Repo, file: str, node: ast.ImportFrom, name: str,
               source_path: str, old_tag: str, new_tag: str) -> list[HotSpot]:
    """Upstream's own change to an imported function's parameters, where a call
    written for the old release could break: a parameter gone, moved or renamed,
    or a new one without a default."""
    def function(rev: str) -> ast.FunctionDef | None:
        found = (_top_level_names(show(repo, rev, source_path) or "") or {}).get(name)
        return found if isinstance(found, ast.FunctionDef) else None

    old, new = function(f"refs/tags/{old_tag}"), function(f"refs/tags/{new_tag}")
    if old is None or new is None or _compatible(old.args, new.args):
        return []
    return [HotSpot(SpotKind.SIGNATURE, "", file, node.lineno,
                    f"{node.module}.{name}({ast.unparse(old.args)}) is now "
                    f"({ast.unparse(new.args)}) in {new_tag}")]


def _compatible(old: ast.arguments, new: ast.arguments) -> bool:
    before = [a.arg for a in old.posonlyargs + old.args]
    after = [a.arg for a in new.posonlyargs + new.args]
    if after[:len(before)] != before:
        return False
    defaults = len(new.defaults)
    required_new = after[len(before):len(after) - defaults] if defaults else after[len(before):]
    old_keywords = {a.arg for a in old.kwonlyargs}
    new_required_keywords = {a.arg for a, d in zip(new.kwonlyargs, new.kw_defaults)
                             if d is None} - old_keywords
    kept_keywords = old_keywords <= {a.arg for a in new.kwonlyargs} or new.kwarg is not None
    return not required_new and not new_required_keywords and kept_keywords


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> ast.Module | None:
    """One parse per text: hot spots look into the same big files many times."""
    try:
        return ast.parse(text)
    except SyntaxError:
        return None
