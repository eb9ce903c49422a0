"""Where upstream took the code a patch changes: a hunk whose upstream side is
empty (the code left the file), and a file upstream deleted.

Code is followed by name: the function or class around the patch's change,
looked up in the new release. There the change is trial-applied as a 3-way
merge of that one definition (``git merge-file``: upstream's moved copy, the
old base, the patched old copy), so a clean result is a proposal with its diff.
Where no definition of that name is left (renamed, or no definition around the
change), the most similar block of another file stands in for it, and the
hunk's own lines are merged there the same way.
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import git

from e2.rebase.state import Hunk, PatchState, Proposal

MIN_SIMILAR = 0.6  # how alike (difflib's ratio) a block must be to count as moved code
_DEFINITION = re.compile(r"^(\s*)(?:async\s+)?(?:def|class)\s+(\w+)")


@dataclass
class Found:
    why: str
    proposal: Proposal | None


def show(repo: git.Repo, rev: str, path: str) -> str | None:
    """The file at ``rev``, or None; read through git's persistent cat-file process
    (hot spots read a few hundred)."""
    try:
        blob = repo.commit(rev).tree / path
    except (KeyError, ValueError, git.BadName):
        return None
    if not isinstance(blob, git.Blob):
        return None
    return blob.data_stream.read().decode("utf-8", errors="replace")


def enclosing_names(lines: list[str], index: int) -> list[str]:
    """The definitions around line ``index`` of a fragment, innermost first."""
    names, indent = [], None
    for line in reversed(lines[:index + 1]):
        match = _DEFINITION.match(line)
        if match and (indent is None or len(match.group(1)) < indent):
            names.append(match.group(2))
            indent = len(match.group(1))
            if indent == 0:
                break
    return names


def definition_span(text: str, name: str) -> tuple[int, int] | None:
    """(first, last) line, 1-based and decorators included, of the definition ``name``."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) \
                and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return first, node.end_lineno or node.lineno
    return None


def defined_in(repo: git.Repo, name: str, exclude: str, at: str = "HEAD") -> list[str]:
    """Files of HEAD (or the commit ``at``) that define ``name`` (def or class), other
    than ``exclude``."""
    files = _defining_files(str(repo.git_dir), repo.commit(at).hexsha, name)
    # the likeliest home first: outside tests/, then nearest to where it was
    return sorted((f for f in files if f != exclude),
                  key=lambda f: (f.startswith("tests/"), -_common_prefix(f, exclude), f))


@functools.lru_cache(maxsize=512)
def _defining_files(git_dir: str, commit: str, name: str) -> list[str]:
    """git grep over a whole release: cached, a dry run asks for a name more than once."""
    try:
        out = git.Repo(git_dir).git.grep("-l", "-E", rf"^\s*(async\s+)?(def|class)\s+{name}\b",
                                         commit, "--", "*.py")
    except git.GitCommandError:  # no match
        return []
    return [line.split(":", 1)[1] for line in out.splitlines()]


def _common_prefix(a: str, b: str) -> int:
    return len([1 for x, y in zip(a.split("/"), b.split("/")) if x == y])


def find_moved(repo: git.Repo, current: PatchState, file: str, hunk: Hunk) -> Found | None:
    """Where the hunk's code went in the new release, and the hunk trial-applied there:
    the same function or class in another file, else the most similar block."""
    matcher = difflib.SequenceMatcher(None, hunk.base, hunk.theirs, autojunk=False)
    edits = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    names = [n for op in edits for n in enclosing_names(hunk.base, max(op[1] - 1, 0))]
    for name in dict.fromkeys(names):
        for target in defined_in(repo, name, file):
            proposal, outcome = trial_apply(repo, current, file, target, name)
            return Found(f"upstream moved {name} from {file} to {target}; the change to "
                         f"it, trial-applied there, {outcome}", proposal)
    return find_similar(repo, file, hunk)


def find_similar(repo: git.Repo, file: str, hunk: Hunk) -> Found | None:
    """The block of another file of the new release most like the hunk's base lines
    (at least MIN_SIMILAR alike, ignoring indentation), and the patch's change to
    those lines merged into it."""
    block = similar_block(repo, file, hunk.base)
    if block is None:
        return None
    target, first, last, ratio = block
    text = show(repo, "HEAD", target) or ""
    lines = text.splitlines(keepends=True)
    merged, conflicts = merge_file("".join(lines[first - 1:last]), _joined(hunk.base),
                                   _joined(hunk.theirs))
    where = (f"upstream took these lines from {file}; the most similar block is "
             f"{target} lines {first}-{last} ({ratio:.0%} alike)")
    if conflicts:
        return Found(f"{where}; the change, trial-applied there, leaves {conflicts} "
                     "conflict(s)", None)
    diff = _splice_diff(text, first, last, merged, target)
    return Found(f"{where}; the change, trial-applied there, merges cleanly",
                 Proposal(f"the change applied to the similar block in {target} "
                          f"(lines {first}-{last}); dropped here", target, None, diff))


def similar_block(repo: git.Repo, file: str,
                  base: list[str]) -> tuple[str, int, int, float] | None:
    """(file, first line, last line, ratio) of the likeliest new home of ``base``: files
    holding its most telling lines (git grep), each window of its length anchored on
    one of them, compared line by line (difflib)."""
    wanted = [line.strip() for line in base]
    telling = sorted({w for w in wanted if len(w) >= 12}, key=len, reverse=True)[:8]
    if not telling:
        return None
    try:
        out = repo.git.grep("-l", "-F", *(a for w in telling for a in ("-e", w)), "HEAD",
                            "--", "*.py")
    except git.GitCommandError:  # no file has any of them
        return None
    best: tuple[str, int, int, float] | None = None
    for target in [line.split(":", 1)[1] for line in out.splitlines()]:
        if target == file:
            continue
        have = [line.strip() for line in (show(repo, "HEAD", target) or "").splitlines()]
        starts = {max(at - wanted.index(line), 0) for at, line in enumerate(have)
                  if line in telling}
        for start in sorted(starts):
            window = have[start:start + len(wanted)]
            ratio = difflib.SequenceMatcher(None, wanted, window, autojunk=False).ratio()
            if ratio >= MIN_SIMILAR and (best is None or ratio > best[3]):
                best = (target, start + 1, start + len(window), ratio)
    return best


def _joined(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _splice_diff(text: str, first: int, last: int, merged: str, target: str) -> str:
    """The diff that puts ``merged`` in place of lines ``first``-``last`` of ``target``."""
    lines = text.splitlines(keepends=True)
    new_text = "".join(lines[:first - 1]) + merged + "".join(lines[last:])
    return "".join(difflib.unified_diff(lines, new_text.splitlines(keepends=True),
                                        f"a/{target}", f"b/{target}"))


def trial_apply(repo: git.Repo, current: PatchState, file: str, target: str,
                name: str) -> tuple[Proposal | None, str]:
    """The patch's change to ``name`` merged into its moved copy in ``target``, and
    how that went."""
    assert current.old_commit is not None
    before = show(repo, f"{current.old_commit}^", file) or ""
    after = show(repo, current.old_commit, file) or ""
    moved_text = show(repo, "HEAD", target) or ""
    spans = [definition_span(t, name) for t in (moved_text, before, after)]
    if any(span is None for span in spans):
        return None, f"could not be done ({name} is not whole in one of the three texts)"
    pieces = [_cut(t, s) for t, s in zip((moved_text, before, after), spans)]
    merged, conflicts = merge_file(*pieces)
    first, last = spans[0]  # type: ignore[misc]
    diff = _splice_diff(moved_text, first, last, merged, target)
    if conflicts:
        return None, f"leaves {conflicts} conflict(s)"
    # the hunk itself resolves to upstream's side (the code is gone from this file)
    return Proposal(f"the change to {name} applied in {target}; dropped here", target,
                    None, diff), "merges cleanly"


def _cut(text: str, span: tuple[int, int] | None) -> str:
    assert span is not None
    return "".join(text.splitlines(keepends=True)[span[0] - 1:span[1]])


def merge_file(current: str, base: str, other: str) -> tuple[str, int]:
    """git merge-file on three texts: (result, number of conflicts)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for label, text in (("current", current), ("base", base), ("other", other)):
            path = Path(folder) / label
            path.write_text(text)
            paths.append(str(path))
        result = subprocess.run(["git", "merge-file", "-p", "--diff3", *paths],
                                capture_output=True, text=True)
    if result.returncode < 0 or result.returncode > 127:
        raise RuntimeError(result.stderr)
    return result.stdout, result.returncode


def successor_file(repo: git.Repo, current: PatchState, file: str,
                   old_tag: str) -> str | None:
    """For a file upstream deleted: the new release's file that defines most of what
    the patch changes in it, else the nearest path among the files it added."""
    assert current.old_commit is not None
    before = show(repo, f"{current.old_commit}^", file) or ""
    diff = repo.git.diff("-U0", f"{current.old_commit}^", current.old_commit, "--", file)
    lines = before.splitlines()
    votes: Counter[str] = Counter()
    for match in re.finditer(r"^@@ -(\d+)", diff, re.MULTILINE):
        # each change votes for where the innermost definition around it went
        for name in enclosing_names(lines, max(int(match.group(1)) - 1, 0)):
            homes = [] if name.startswith("__") else defined_in(repo, name, file)
            if homes:
                votes[homes[0]] += 1
                break
    if votes:
        return votes.most_common(1)[0][0]
    added = repo.git.diff("--name-only", "--diff-filter=A", f"refs/tags/{old_tag}",
                          "HEAD").splitlines()
    close = difflib.get_close_matches(file, added, n=1, cutoff=0.5)
    return close[0] if close else None
