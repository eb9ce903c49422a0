"""``e2 rebase --continue`` and ``--skip``: how a rebase stopped at a patch (or
killed half way through one) gets back into the step loop. ``--abort`` is the
backup's own job (``Rebase.abort``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import git

from e2.errors import E2Error
from e2.rebase_conflicts import ask, ask_verdict, capture_conflicts, has_markers, unmerged_files
from e2.rebase_state import APPLIED, PatchState, Rebase, RebaseState
from e2.rebase_steps import am_3way, commit_resolution, record_applied


def continue_rebase(rebase: Rebase, state: RebaseState, verdict: str | None,
                    reason: str | None) -> None:
    current = state.current()
    repo = rebase.repo()
    if state.phase == "obsolete" and current is not None:
        # keep the patch although it applies in reverse: try it forwards
        current.status, current.notes = "applying", []
        state.phase = "applying"
        ok, fell_back = am_3way(repo, rebase.project.patches_dir / current.file)
        if not ok:
            current.conflicts = capture_conflicts(repo)
            current.status, state.phase = "conflict", "conflict"
            state.save(rebase.state_file)
            raise E2Error(f"{current.id} conflicts when kept", hint="resolve, git add, "
                          "then e2 rebase --continue; or e2 rebase --skip")
        patch = rebase.backup_series().by_id(current.id)
        record_applied(rebase, repo, current, patch, "merged" if fell_back else None)
    elif state.phase == "conflict" and current is not None:
        unmerged = unmerged_files(repo)
        marked = [c.file for c in current.conflicts if has_markers(rebase.work / c.file)]
        if unmerged or marked:
            raise E2Error("still conflicted: " + ", ".join(sorted(set(unmerged + marked))),
                          hint=f"resolve the conflict markers in {rebase.work}, git add the "
                               "files, then e2 rebase --continue")
        for conflict in current.conflicts:
            conflict.verdicts = [ask_verdict(conflict.file, number, hunk, verdict, reason)
                                 for number, hunk in enumerate(conflict.hunks, start=1)]
        commit_resolution(rebase, repo, current)
    elif state.phase == "applying" and current is not None and current.status == "applying":
        _reconcile(rebase, repo, state, current)
    state.phase = "applying" if state.phase != "finishing" else "finishing"
    state.save(rebase.state_file)


def _reconcile(rebase: Rebase, repo: git.Repo, state: RebaseState,
               current: PatchState) -> None:
    """The process died around git am: find out how far that patch got."""
    applied = [p for p in state.patches if p.status in APPLIED]
    commits = repo.git.rev_list("--reverse", f"refs/tags/{state.target['tag']}..HEAD").split()
    if Path(repo.git_dir, "rebase-apply").exists():
        subprocess.run(["git", "am", "--abort"], cwd=rebase.work, capture_output=True)
        current.status = "pending"
    elif len(commits) > len(applied):
        patch = rebase.backup_series().by_id(current.id)
        record_applied(rebase, repo, current, patch, None)
    else:
        current.status = "pending"


def skip(rebase: Rebase, state: RebaseState, reason: str | None) -> None:
    current = state.current()
    if current is None or state.phase not in ("conflict", "obsolete"):
        raise E2Error("nothing to skip: the rebase is not stopped at a patch")
    if Path(rebase.repo().git_dir, "rebase-apply").exists():
        subprocess.run(["git", "am", "--skip"], cwd=rebase.work, capture_output=True, check=True)
    if state.phase == "obsolete":
        current.status = "obsolete"
        current.reason = reason or f"already in upstream {state.target['tag']}"
    else:
        current.status = "dropped"
        current.reason = reason or ask("why is this patch dropped? ")
    state.phase = "applying"
    state.save(rebase.state_file)
