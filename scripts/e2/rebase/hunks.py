"""Each conflicting hunk classified, with a proposed resolution.

A hunk has upstream's new side (ours), the merge base and the patch's side
(theirs). From how each side differs from the base:

- both sides only added lines at one place: keep both, upstream's first;
- the patch only inserted lines and upstream rewrote the base: the insertion
  on upstream's new text, at the same place;
- upstream's side is empty and the base is not: the code went elsewhere
  (``moved``: found by name or by its lines, and the hunk trial-applied there)
  or is gone;
- anything else is a real overlap, with no proposal.

Proposals are only written into the state and the report; ``--continue
--accept-proposals`` applies them.
"""

from __future__ import annotations

import difflib

import git

from e2.rebase import moved
from e2.rebase.state import Conflict, Hunk, HunkKind, PatchState, Proposal


def classify_conflicts(repo: git.Repo, current: PatchState, conflicts: list[Conflict],
                       old_tag: str) -> list[Conflict]:
    for conflict in conflicts:
        if conflict.deleted_upstream:
            conflict.replaced_by = moved.successor_file(repo, current, conflict.file, old_tag)
            numstat = repo.git.diff("--numstat", f"{current.old_commit}^", current.old_commit,
                                    "--", conflict.file).split()
            conflict.patch_lines = int(numstat[0]) if numstat and numstat[0].isdigit() else 0
            continue
        for hunk in conflict.hunks:
            classify(repo, current, conflict.file, hunk)
    return conflicts


def classify(repo: git.Repo, current: PatchState, file: str, hunk: Hunk) -> None:
    ours_added = _only_inserts(hunk.base, hunk.ours)
    theirs_added = _only_inserts(hunk.base, hunk.theirs)
    if ours_added is not None and theirs_added is not None:
        hunk.kind = HunkKind.BOTH_ADDED
        hunk.why = (f"upstream added {len(hunk.ours) - len(hunk.base)} line(s), the patch "
                    f"{len(hunk.theirs) - len(hunk.base)}, at the same place")
        hunk.proposal = Proposal("keep both: upstream's lines, then the patch's", file,
                                 _merge_inserts(hunk.base, hunk.ours, hunk.theirs))
    elif theirs_added is not None and hunk.ours and hunk.base:
        hunk.kind = HunkKind.INSERT_BEFORE_REWRITE
        inserted = sum(len(lines) for _, lines in theirs_added)
        hunk.why = (f"the patch inserts {inserted} line(s) into code upstream "
                    f"rewrote ({len(hunk.base)} -> {len(hunk.ours)} lines)")
        hunk.proposal = Proposal("the patch's insertion on upstream's new text", file,
                                 _insert_on(hunk, theirs_added))
    elif not hunk.ours and hunk.base:
        found = moved.find_moved(repo, current, file, hunk)
        if found is None:
            hunk.kind = HunkKind.DELETED
            hunk.why = (f"upstream removed these {len(hunk.base)} lines and nothing like "
                        "them is in the new release")
        else:
            hunk.kind, hunk.why, hunk.proposal = HunkKind.MOVED, found.why, found.proposal
    else:
        hunk.kind = HunkKind.OVERLAP
        hunk.why = (f"both changed the same lines (upstream {len(hunk.base)} -> "
                    f"{len(hunk.ours)}, the patch {len(hunk.base)} -> {len(hunk.theirs)})")


def _only_inserts(base: list[str], side: list[str]) -> list[tuple[int, list[str]]] | None:
    """The side's insertions into base as (base index, lines), or None when it
    also changed or removed base lines."""
    inserts = []
    matcher = difflib.SequenceMatcher(None, base, side, autojunk=False)
    for tag, i1, _, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            inserts.append((i1, side[j1:j2]))
        elif tag != "equal":
            return None
    return inserts if inserts else None


def _merge_inserts(base: list[str], ours: list[str], theirs: list[str]) -> list[str]:
    """base with both sides' insertions, upstream's before the patch's at one place."""
    at: dict[int, list[str]] = {}
    for side in (ours, theirs):
        for index, lines in _only_inserts(base, side) or []:
            at.setdefault(index, []).extend(lines)
    merged = []
    for index in range(len(base) + 1):
        merged += at.get(index, [])
        if index < len(base):
            merged.append(base[index])
    return merged


def _insert_on(hunk: Hunk, inserts: list[tuple[int, list[str]]]) -> list[str]:
    """The patch's insertions placed on upstream's text: before the upstream line
    the base line they preceded became (the start or end where it is gone)."""
    matcher = difflib.SequenceMatcher(None, hunk.base, hunk.ours, autojunk=False)
    mapping: dict[int, int] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            mapping[block.a + k] = block.b + k
    at: dict[int, list[str]] = {}
    for index, lines in inserts:
        if index >= len(hunk.base):
            spot = len(hunk.ours)
        else:
            spot = mapping.get(index, 0 if index == 0 else
                               mapping.get(index - 1, len(hunk.ours) - 1) + 1)
        at.setdefault(spot, []).extend(lines)
    result = []
    for index in range(len(hunk.ours) + 1):
        result += at.get(index, [])
        if index < len(hunk.ours):
            result.append(hunk.ours[index])
    return result
