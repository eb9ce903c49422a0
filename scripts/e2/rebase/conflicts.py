"""The conflicts a patch meets on the new release: their hunks as git's diff3
markers show them (or a file upstream deleted), and a verdict per hunk, given
on the command line or asked for.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import git

from e2 import console
from e2.errors import E2Error
from e2.rebase.state import VERDICTS, Conflict, Hunk, HunkVerdict, Verdict

_MARKER = re.compile(r"^(<<<<<<<|\|\|\|\|\|\|\||=======|>>>>>>>)( |$)")


def unmerged_files(repo: git.Repo) -> list[str]:
    return sorted(set(repo.git.diff("--name-only", "--diff-filter=U").split()))


def has_markers(path: Path) -> bool:
    if not path.is_file():
        return False
    return any(_MARKER.match(line) for line in path.read_text(errors="replace").splitlines())


def _stages(repo: git.Repo, path: str) -> set[int]:
    """The index stages of an unmerged file: 1 base, 2 ours (upstream), 3 theirs (patch)."""
    return {int(line.split()[2]) for line in repo.git.ls_files("-u", "--", path).splitlines()}


def capture_conflicts(repo: git.Repo) -> list[Conflict]:
    """Each conflicted file's hunks: upstream's side, the merge base, the patch's side."""
    conflicts = []
    assert repo.working_tree_dir is not None  # the rebase's worktree, never bare
    for path in unmerged_files(repo):
        if 2 not in _stages(repo, path):
            conflicts.append(Conflict(path, [], deleted_upstream=True))
            continue
        text = (Path(repo.working_tree_dir) / path).read_text(errors="replace")
        conflicts.append(Conflict(path, parse_hunks(text.splitlines())))
    return conflicts


def parse_hunks(lines: list[str]) -> list[Hunk]:
    hunks: list[Hunk] = []
    current: Hunk | None = None  # the hunk being read
    side: list[str] = []         # the side of it the next line belongs to
    for number, line in enumerate(lines, start=1):
        if line.startswith("<<<<<<<"):
            current = Hunk(number, [], [], [])
            side = current.ours
        elif current is not None and line.startswith("|||||||"):
            side = current.base
        elif current is not None and line == "=======":
            side = current.theirs
        elif current is not None and line.startswith(">>>>>>>"):
            hunks.append(current)
            current = None
        elif current is not None:
            side.append(line)
    return hunks


def ask(prompt: str) -> str:
    if not sys.stdin.isatty():
        raise E2Error("a reason is needed and there is no terminal to ask on",
                      hint="pass --reason TEXT")
    answer = input(prompt).strip()
    if not answer:
        raise E2Error("a reason is needed")
    return answer


def ask_verdict(file: str, number: int, hunk: Hunk, verdict: str | None,
                reason: str | None) -> HunkVerdict:
    if verdict is None:
        if not sys.stdin.isatty():
            raise E2Error(f"{file} hunk {number} (line {hunk.line}) needs a verdict and "
                          "there is no terminal to ask on",
                          hint=f"pass --verdict ({' / '.join(VERDICTS)}) --reason TEXT")
        console.info(f"{file} hunk {number} (line {hunk.line}):")
        verdict = ask(f"  verdict ({' / '.join(VERDICTS)}): ")
        if verdict not in VERDICTS:
            raise E2Error(f"verdict must be one of {', '.join(VERDICTS)}")
    if reason is None:
        reason = ask("  reason: ")
    return HunkVerdict(Verdict(verdict), reason)


def verdicts_for(conflict: Conflict, verdict: str | None, reason: str | None) -> None:
    """One verdict per hunk (one for a file upstream deleted, which has none)."""
    hunks = conflict.hunks or [Hunk(0, [], [], [])]
    conflict.verdicts = [ask_verdict(conflict.file, number, hunk, verdict, reason)
                         for number, hunk in enumerate(hunks, start=1)]
