"""The conflicts a patch meets on the new release: their hunks as git's diff3
markers show them, a verdict per hunk (given on the command line or asked for),
and the verdicts remembered beside rerere's recorded resolutions so that a
replayed resolution keeps them on the next attempt.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import git

from e2 import console
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.rebase_state import VERDICTS, Conflict, PatchState

_MARKER = re.compile(r"^(<<<<<<<|\|\|\|\|\|\|\||=======|>>>>>>>)( |$)")


def unmerged_files(repo: git.Repo) -> list[str]:
    return sorted(set(repo.git.diff("--name-only", "--diff-filter=U").split()))


def has_markers(path: Path) -> bool:
    if not path.is_file():
        return False
    return any(_MARKER.match(line) for line in path.read_text(errors="replace").splitlines())


def capture_conflicts(repo: git.Repo) -> list[Conflict]:
    """Each conflicted file's hunks: upstream's side, the merge base, the patch's side."""
    conflicts = []
    for path in unmerged_files(repo):
        assert repo.working_tree_dir is not None  # the rebase's worktree, never bare
        lines = (Path(repo.working_tree_dir) / path).read_text(errors="replace").splitlines()
        hunks: list[dict] = []
        current: dict[str, Any] | None = None  # the hunk being read
        part = "ours"  # the side of it the next line belongs to
        for number, line in enumerate(lines, start=1):
            if line.startswith("<<<<<<<"):
                current, part = {"line": number, "ours": [], "base": [], "theirs": []}, "ours"
            elif current is not None and line.startswith("|||||||"):
                part = "base"
            elif current is not None and line == "=======":
                part = "theirs"
            elif current is not None and line.startswith(">>>>>>>"):
                hunks.append(current)
                current = None
            elif current is not None:
                current[part].append(line)
        conflicts.append(Conflict(path, hunks))
    return conflicts


def ask(prompt: str) -> str:
    if not sys.stdin.isatty():
        raise E2Error("a reason is needed and there is no terminal to ask on",
                      hint="pass --reason TEXT")
    answer = input(prompt).strip()
    if not answer:
        raise E2Error("a reason is needed")
    return answer


def ask_verdict(file: str, number: int, hunk: dict, verdict: str | None,
                reason: str | None) -> dict:
    if verdict is None:
        if not sys.stdin.isatty():
            raise E2Error(f"{file} hunk {number} (line {hunk['line']}) needs a verdict and "
                          "there is no terminal to ask on",
                          hint=f"pass --verdict ({' / '.join(VERDICTS)}) --reason TEXT")
        console.info(f"{file} hunk {number} (line {hunk['line']}):")
        verdict = ask(f"  verdict ({' / '.join(VERDICTS)}): ")
        if verdict not in VERDICTS:
            raise E2Error(f"verdict must be one of {', '.join(VERDICTS)}")
    if reason is None:
        reason = ask("  reason: ")
    return {"verdict": verdict, "reason": reason}


# -- verdicts remembered beside rerere's resolutions, by patch title


def remember_verdicts(memory_file: Path, current: PatchState) -> None:
    memory = json.loads(memory_file.read_text()) if memory_file.is_file() else {}
    memory[current.title] = [asdict(c) for c in current.conflicts]
    write_atomic(memory_file, json.dumps(memory, indent=2, sort_keys=True) + "\n")


def remembered_verdicts(memory_file: Path, current: PatchState) -> list[Conflict]:
    if not memory_file.is_file():
        return []
    memory = json.loads(memory_file.read_text())
    return [Conflict(**c) for c in memory.get(current.title, [])]
