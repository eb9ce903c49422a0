"""``--continue --accept-proposals``: the report's proposed resolutions written
into the stopped worktree. Each accepted hunk gets a verdict that says so
(marked for review); hunks without a proposal keep their markers, so the
rebase stays stopped on them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import git

from e2.errors import E2Error
from e2.rebase.conflicts import parse_hunks
from e2.rebase.state import Conflict, HunkVerdict, PatchState, Verdict


def accept(repo: git.Repo, current: PatchState, verdict: str | None,
           reason: str | None, fallback_to_patch: bool = False) -> None:
    """Write every proposal in; ``fallback_to_patch`` (the dry run, to reach the
    later patches) takes the patch's side where there is none."""
    assert repo.working_tree_dir is not None
    root = Path(repo.working_tree_dir)
    left = []
    for conflict in current.conflicts:
        if conflict.deleted_upstream and fallback_to_patch:
            repo.git.rm("-q", "--", conflict.file)
            continue
        if conflict.deleted_upstream:
            left.append(f"{conflict.file} (deleted upstream"
                        + (f"; see {conflict.replaced_by})" if conflict.replaced_by else ")"))
            continue
        path = root / conflict.file
        if not fallback_to_patch and (not all(h.proposal for h in conflict.hunks)
                                      or not path.is_file()):
            left += [f"{conflict.file} hunk {n} ({h.kind})"
                     for n, h in enumerate(conflict.hunks, start=1) if not h.proposal]
            continue
        _apply_file(repo, root, conflict)
        conflict.verdicts = [HunkVerdict(Verdict(verdict or "still-needed"),
                                         reason or f"proposal accepted, to review: "
                                                   f"{h.proposal.summary if h.proposal else ''}")
                             for h in conflict.hunks]
    if left:
        raise E2Error("no proposal for: " + ", ".join(left) + " (the others are applied)",
                      hint=f"resolve those in {root} by hand, git add them, then "
                           "e2 rebase --continue")


def _apply_file(repo: git.Repo, root: Path, conflict: Conflict) -> None:
    """Every hunk of one file replaced by its proposal; moved code patched where it went."""
    path = root / conflict.file
    lines = path.read_text().split("\n")
    found = parse_hunks(lines)
    if len(found) != len(conflict.hunks):
        raise E2Error(f"{conflict.file} no longer has the {len(conflict.hunks)} conflict "
                      "hunk(s) the rebase stopped on", hint="resolve it by hand")
    # from the last hunk up, so earlier line numbers hold
    for marked, hunk in reversed(list(zip(found, conflict.hunks))):
        end = _end_of_hunk(lines, marked.line - 1)
        if hunk.proposal is None:
            replacement = marked.theirs
        elif hunk.proposal.lines is not None:
            replacement = hunk.proposal.lines
        else:
            replacement = marked.ours
        lines[marked.line - 1:end + 1] = replacement
        if hunk.proposal is not None and hunk.proposal.diff:
            subprocess.run(["git", "apply", "--index", "-"], cwd=root, check=True,
                           input=hunk.proposal.diff, text=True, capture_output=True)
    path.write_text("\n".join(lines))
    repo.git.add("--", conflict.file)


def _end_of_hunk(lines: list[str], start: int) -> int:
    for index in range(start, len(lines)):
        if lines[index].startswith(">>>>>>>"):
            return index
    raise E2Error("a conflict hunk has no end marker")
