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
from dataclasses import dataclass

import git

from e2 import pysource
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


def functions_touched(repo: git.Repo, patch: PatchState, old_tag: str, new_tag: str,
                      diff: str | None = None) -> tuple[list[HotSpot], int]:
    """The upstream functions this patch's hunks sit in that changed, and how many it
    sits in at all. ``diff``: its old commit's Python files' diff with no context, where
    the caller read those of many commits at once."""
    assert patch.old_commit is not None
    if diff is None:
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


def commit_diffs(repo: git.Repo, commits: list[str], *options: str,
                 paths: tuple[str, ...] = ()) -> dict[str, str]:
    """What ``git diff OPTIONS C^ C -- PATHS`` shows for each of ``commits`` (none of
    them a merge), from one ``git log``; a commit with nothing to show is left out."""
    if not commits:
        return {}
    log = repo.git.log("--no-walk=unsorted", "--format=%x00%H", *options, *commits, "--",
                       *paths)
    diffs = {}
    for chunk in log.split("\x00")[1:]:
        commit, _, diff = chunk.partition("\n")
        diffs[commit.strip()] = diff
    return diffs


def _hunk_starts(diff: str) -> list[tuple[str, int]]:
    starts, file = [], ""
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            file = line[6:]
        elif line.startswith("@@ -"):
            starts.append((file, max(int(line[4:].split(",")[0].split()[0]), 1)))
    return starts


def _enclosing(text: str, line: int) -> str | None:
    """The innermost function (qualified name) around ``line``."""
    outline = pysource.outline(text)
    if outline is None:
        return None
    best = None
    for definition in outline.definitions:
        if not definition.is_class \
                and definition.first <= line <= (definition.last or definition.first):
            best = definition.qualname  # later ones are nested deeper
    return best


def _source(text: str | None, qualname: str) -> str | None:
    if text is None or (outline := pysource.outline(text)) is None:
        return None
    for definition in outline.definitions:
        if definition.qualname == qualname:
            # whole lines: ast.get_source_segment splits the whole text on every call
            return "".join(_lines(text)[definition.first - 1:definition.last])
    return None


@functools.lru_cache(maxsize=64)
def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


# ---------------------------------------------------------------- names and syntax


def check_files(repo: git.Repo, new_tag: str, old_tag: str,
                added: dict[str, set[int]] | None = None, at: str = "HEAD") -> list[HotSpot]:
    """Every Python file the series changes on the new release (HEAD, or the commit
    ``at``), or those of ``added`` (file -> the lines to check the imports of): it
    compiles, the vllm imports on its added lines resolve, and what they import kept
    its parameters."""
    spots: list[HotSpot] = []
    if added is None:
        added = added_lines(repo, f"refs/tags/{new_tag}", at)
    for file, lines in added.items():
        text = show(repo, at, file)
        if text is None:
            continue
        outline = pysource.outline(text)
        if outline is None:
            try:
                compile(text, file, "exec", ast.PyCF_ONLY_AST)
            except SyntaxError as exc:
                spots.append(HotSpot(SpotKind.SYNTAX, "", file, exc.lineno or 0,
                                     f"does not compile: {exc.msg}"))
            continue
        for node in outline.imports:
            # the series' own import lines: upstream's resolve in upstream
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm" \
                    and lines.intersection(range(node.lineno, (node.end_lineno or 0) + 1)):
                spots += _check_import(repo, file, node, old_tag, new_tag, at)
    return spots


def missing_names(repo: git.Repo, patch: PatchState, new_tag: str, old_tag: str,
                  at: str = "HEAD", added: dict[str, set[int]] | None = None,
                  ) -> list[HotSpot]:
    """What stops the rebase at ``patch``, just committed (HEAD, or the commit ``at``,
    whose ``added`` lines the caller may have read): a vllm name its files import that
    the new release lacks, or one of its files that does not compile."""
    if added is None:
        added = added_lines(repo, f"{at}^", at)
    spots = [s for s in check_files(repo, new_tag, old_tag, added, at) if s.kind.stops]
    for spot in spots:
        spot.patch = patch.id
    return spots


def added_lines(repo: git.Repo, old: str, new: str) -> dict[str, set[int]]:
    """The lines ``new`` adds over ``old`` in each Python file it adds or changes,
    from one ``git diff``."""
    return _added_lines(repo.git.diff(*ADDED_DIFF, old, new, "--", "*.py"))


ADDED_DIFF = ("-U0", "--diff-filter=AM")  # the diff _added_lines reads


def added_lines_of(repo: git.Repo, commits: list[str]) -> dict[str, dict[str, set[int]]]:
    """added_lines of each commit over its parent, from one ``git log``."""
    diffs = commit_diffs(repo, commits, *ADDED_DIFF, paths=("*.py",))
    return {commit: _added_lines(diffs.get(commit, "")) for commit in commits}


def _added_lines(diff: str) -> dict[str, set[int]]:
    added: dict[str, set[int]] = {}
    lines: set[int] | None = None
    for line in diff.splitlines():
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
                  new_tag: str, at: str) -> list[HotSpot]:
    module = node.module or ""
    path = module.replace(".", "/")
    source_path = next((p for p in (f"{path}.py", f"{path}/__init__.py")
                        if show(repo, at, p) is not None), None)
    if source_path is None:
        return [HotSpot(SpotKind.MISSING_NAME, "", file, node.lineno,
                        f"module {module} does not exist")]
    module_text = show(repo, at, source_path) or ""
    names = _names(module_text)
    if names is None:
        return []  # a module with __getattr__ or a star import: names cannot be read
    spots = []
    for alias in node.names:
        if alias.name in names or show(repo, at, f"{path}/{alias.name}.py") is not None \
                or show(repo, at, f"{path}/{alias.name}/__init__.py") is not None:
            spots += _signature(repo, file, node, alias.name, source_path, old_tag, new_tag)
            continue
        homes = defined_in(repo, alias.name, source_path, at)
        where = f" (defined in {', '.join(homes[:2])})" if homes else ""
        spots.append(HotSpot(SpotKind.MISSING_NAME, "", file, node.lineno,
                             f"{module} has no {alias.name}{where}"))
    return spots


@functools.lru_cache(maxsize=256)
def _names(text: str) -> dict[str, ast.arguments | None] | None:
    """Every name ``text`` defines or imports, a function's with its parameters (kept
    instead of the AST, see pysource.Outline), or None where they cannot be read: a module that
    does not compile, makes names on demand (__getattr__) or star-imports."""
    try:
        tree = pysource.parse(text)
    except SyntaxError:
        return None
    if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
           for node in tree.body):
        return None  # names made on demand
    names: dict[str, ast.arguments | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.setdefault(node.name,
                             node.args if isinstance(node, ast.FunctionDef) else None)
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
    def parameters(rev: str) -> ast.arguments | None:
        return (_names(show(repo, rev, source_path) or "") or {}).get(name)

    old, new = parameters(f"refs/tags/{old_tag}"), parameters(f"refs/tags/{new_tag}")
    if old is None or new is None or _compatible(old, new):
        return []
    return [HotSpot(SpotKind.SIGNATURE, "", file, node.lineno,
                    f"{node.module}.{name}({ast.unparse(old)}) is now "
                    f"({ast.unparse(new)}) in {new_tag}")]


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
