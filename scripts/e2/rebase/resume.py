"""``e2 rebase --continue`` and ``--skip``: how a rebase stopped at a patch (or
killed half way through one) gets back into the step loop. ``--abort`` is the
backup's own job (``Rebase.abort``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import git

from e2.errors import E2Error
from e2.gitops import COMMITTER_ENV
from e2.rebase import proposals, replay
from e2.rebase.conflicts import (
    ask,
    capture_conflicts,
    has_markers,
    unmerged_files,
    verdicts_for,
)
from e2.rebase.hotspots import missing_names
from e2.rebase.hunks import classify_conflicts
from e2.rebase.state import PatchState, PatchStatus, Phase, RebaseState
from e2.rebase.steps import (
    MISSING,
    am_3way,
    commit_resolution,
    committed_since_stop,
    record_applied,
    stopped_at_missing_names,
)
from e2.rebase.workspace import Rebase

STOPPED_AT_CONFLICT = (Phase.CONFLICT, Phase.REPLAY)


def continue_rebase(rebase: Rebase, state: RebaseState, verdict: str | None,
                    reason: str | None, accept_proposals: bool = False) -> None:
    current = state.current()
    repo = rebase.repo()
    # the branches below but --continue at a missing name may commit the patch
    commits = state.phase in (*STOPPED_AT_CONFLICT, Phase.OBSOLETE, Phase.APPLYING)
    if state.phase == Phase.OBSOLETE and current is not None:
        _keep_obsolete(rebase, repo, state, current)
    elif state.phase in STOPPED_AT_CONFLICT and current is not None:
        if accept_proposals:
            proposals.accept(repo, current, verdict, reason)
        if current.status == PatchStatus.CONFLICT and state.phase == Phase.REPLAY \
                and not Path(repo.git_dir, "rebase-apply").exists():
            # stopped after a clean git am whose recorded resolution went stale
            current.status = PatchStatus.RESOLVED
            current.new_commit = repo.head.commit.hexsha
        else:
            _check_resolved(rebase, repo, current)
            for conflict in current.conflicts:
                if not conflict.verdicts:
                    verdicts_for(conflict, verdict, reason)
            state.save(rebase.state_file)  # a kill in git am --continue keeps them
            commit_resolution(rebase, repo, current, state.target["tag"])
    elif state.phase == Phase.MISSING_NAME and current is not None:
        _names_fixed(rebase, repo, state, current)
    elif state.phase == Phase.APPLYING and current is not None \
            and current.status == PatchStatus.APPLYING:
        _reconcile(rebase, repo, state, current)
    if state.phase != Phase.FINISHING:
        state.phase = Phase.APPLYING
    if commits and current is not None:
        stopped_at_missing_names(repo, state, current)  # then apply_remaining stops
    state.save(rebase.state_file)


def _check_resolved(rebase: Rebase, repo: git.Repo, current: PatchState) -> None:
    unmerged = unmerged_files(repo)
    marked = [c.file for c in current.conflicts if has_markers(rebase.work / c.file)]
    if unmerged or marked:
        raise E2Error("still conflicted: " + ", ".join(sorted(set(unmerged + marked))),
                      hint=f"resolve the conflict markers in {rebase.work}, git add the "
                           "files, then e2 rebase --continue (--accept-proposals takes "
                           "the report's proposals)")


def _names_fixed(rebase: Rebase, repo: git.Repo, state: RebaseState,
                 current: PatchState) -> None:
    """Stopped at a patch whose files use a name the release lacks: what was changed
    in the worktree goes into the patch's commit, then its names are checked again."""
    repo.git.add("-A")
    if repo.is_dirty(index=True, working_tree=False, untracked_files=False):
        env = {**os.environ, **COMMITTER_ENV}
        subprocess.run(["git", "commit", "-q", "--amend", "--no-edit", "--no-verify"],
                       cwd=rebase.work, env=env, capture_output=True, check=True)
    spots = missing_names(repo, current, state.target["tag"], state.source["tag"])
    if spots:
        raise E2Error(f"{current.id} still uses what {state.target['tag']} lacks: "
                      + "; ".join(f"{s.file}:{s.line}: {s.what}" for s in spots),
                      hint=f"fix it in {rebase.work} (the changes go into the patch's "
                           "commit), then e2 rebase --continue; or e2 rebase --skip, "
                           "e2 rebase --abort")
    current.status, current.new_commit = PatchStatus.RESOLVED, repo.head.commit.hexsha
    current.notes = [note.replace(MISSING, "fixed at the stop, was missing:")
                     for note in current.notes]
    replay.record(repo, rebase.resolutions, rebase.project.patches_dir / current.file,
                  current, state.target["tag"])
    state.phase = Phase.APPLYING


def _keep_obsolete(rebase: Rebase, repo: git.Repo, state: RebaseState,
                   current: PatchState) -> None:
    """Keep the patch although it applies in reverse: try it forwards."""
    current.status, current.notes = PatchStatus.APPLYING, []
    current.base_commit = repo.head.commit.hexsha
    state.phase = Phase.APPLYING
    ok, fell_back = am_3way(repo, rebase.project.patches_dir / current.file)
    if not ok:
        current.conflicts = classify_conflicts(repo, current, capture_conflicts(repo),
                                               state.source["tag"])
        current.status, state.phase = PatchStatus.CONFLICT, Phase.CONFLICT
        state.save(rebase.state_file)
        raise E2Error(f"{current.id} conflicts when kept", hint="resolve, git add, "
                      "then e2 rebase --continue; or e2 rebase --skip")
    patch = rebase.backup_series().by_id(current.id)
    record_applied(rebase, repo, current, patch, fell_back)


def _reconcile(rebase: Rebase, repo: git.Repo, state: RebaseState,
               current: PatchState) -> None:
    """The process died around git am: find out how far that patch got."""
    applied = [p for p in state.patches if p.status.applied]
    commits = repo.git.rev_list("--reverse", f"refs/tags/{state.target['tag']}..HEAD").split()
    if Path(repo.git_dir, "rebase-apply").exists():
        subprocess.run(["git", "am", "--abort"], cwd=rebase.work, capture_output=True)
        current.status = PatchStatus.PENDING
    elif len(commits) == len(applied) + 1:
        patch = rebase.backup_series().by_id(current.id)
        record_applied(rebase, repo, current, patch, False)
    elif len(commits) > len(applied):
        # several patches committed by one git am (steps.apply_batch): they go again
        repo.git.reset("-q", "--hard", current.base_commit or "HEAD")
        current.status = PatchStatus.PENDING
    else:
        current.status = PatchStatus.PENDING


def skip(rebase: Rebase, state: RebaseState, reason: str | None) -> None:
    current = state.current()
    if current is None or state.phase not in (*STOPPED_AT_CONFLICT, Phase.OBSOLETE,
                                              Phase.MISSING_NAME):
        raise E2Error("nothing to skip: the rebase is not stopped at a patch")
    if state.phase == Phase.OBSOLETE:
        reason = reason or f"already in upstream {state.target['tag']}"
    else:
        reason = reason or ask("why is this patch dropped? ")  # before anything is undone
    repo = rebase.repo()
    if Path(repo.git_dir, "rebase-apply").exists():
        subprocess.run(["git", "am", "--quit"], cwd=rebase.work, capture_output=True,
                       check=True)
    if current.base_commit is not None and (
            committed_since_stop(repo, current)
            or state.phase in (Phase.REPLAY, Phase.MISSING_NAME)):
        # the patch (or a resolution of it) is already committed: take it back out
        repo.git.reset("-q", "--hard", current.base_commit)
    else:
        repo.git.reset("-q", "--hard", "HEAD")
    current.status = (PatchStatus.OBSOLETE if state.phase == Phase.OBSOLETE
                      else PatchStatus.DROPPED)
    current.reason = reason
    state.phase = Phase.APPLYING
    state.save(rebase.state_file)
