"""The rebase's step loop: each patch applied onto the new release with
``git am --3way`` (rerere on) and classified as it lands: clean, offset, merged
(the 3-way fallback) or resolved (a recorded resolution replayed, or the
user's). The loop stops at a conflict, and at a patch upstream already has
(it applies in reverse) unless ``--drop-obsolete`` drops it as obsolete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import git

from e2.apply import PatchResult, apply_series, find_offsets
from e2.errors import E2Error
from e2.faults import checkpoint
from e2.gitops import AM_FELL_BACK, COMMITTER_ENV, clone_worktree, git_am
from e2.rebase_conflicts import (
    capture_conflicts,
    remember_verdicts,
    remembered_verdicts,
    unmerged_files,
)
from e2.rebase_state import PatchState, Rebase, RebaseState
from e2.series import Patch, Series, Upstream


def start(rebase: Rebase, series: Series, target: Upstream, drop_obsolete: bool) -> RebaseState:
    """Back up the series, check out the new release, record each patch's old commit."""
    if rebase.in_progress():
        raise E2Error(f"a rebase is already in progress ({rebase.state_file})",
                      hint="e2 rebase --continue, --skip or --abort")
    rebase.require_committed()
    if target.tag == series.upstream.tag:
        raise E2Error(f"the series is already on {target.tag}")
    upstream = rebase.upstream_options()
    upstream.cache.ensure(target, source=upstream.source, local=upstream.local)
    shutil.rmtree(rebase.dir, ignore_errors=True)  # leftovers of a start killed before state
    rebase.dir.mkdir(parents=True)
    rebase.save_backup()
    old = apply_series(rebase.project, series, rebase.dir / "old", upstream, sparse=True)
    repo = clone_worktree(upstream.cache.repo_dir, rebase.work, target.tag)
    repo.git.fetch("-q", str(old.path), "e2:refs/e2/old")
    shutil.rmtree(old.path)
    rebase.rr_cache.mkdir(parents=True, exist_ok=True)
    os.symlink(rebase.rr_cache.resolve(), Path(repo.git_dir) / "rr-cache")
    with repo.config_writer() as config:
        config.set_value("rerere", "autoUpdate", "true")
        config.set_value("merge", "conflictStyle", "diff3")
    state = RebaseState(
        source=series.upstream.model_dump(mode="json"),
        target=target.model_dump(mode="json"),
        patches=[PatchState(p.id, p.title, p.file, old_commit=r.commit)
                 for p, r in zip(series.patches, old.results)],
        drop_obsolete=drop_obsolete)
    state.save(rebase.state_file)
    return state


def apply_remaining(rebase: Rebase, state: RebaseState, series: Series) -> bool:
    """Apply the remaining patches; False when stopped for the user."""
    repo = rebase.repo()
    by_id = {p.id: p for p in series.patches}
    while (current := state.current()) is not None:
        patch = by_id[current.id]
        patch_file = rebase.project.patch_path(patch)
        if current.status == "pending" and applies_in_reverse(repo, patch_file):
            if not state.drop_obsolete:
                current.status, state.phase = "conflict", "obsolete"
                current.notes = [f"already in {state.target['tag']}: applies in reverse"]
                state.save(rebase.state_file)
                return False
            current.status = "obsolete"
            current.reason = f"already in upstream {state.target['tag']} (dropped by --drop-obsolete)"
            state.save(rebase.state_file)
            continue
        current.status = "applying"
        state.save(rebase.state_file)
        checkpoint("before-am")
        ok, fell_back = am_3way(repo, patch_file)
        checkpoint("after-am")
        if ok:
            record_applied(rebase, repo, current, patch, "merged" if fell_back else None)
        elif not unmerged_files(repo):
            # rerere replayed a recorded resolution for every conflicted file
            current.conflicts = remembered_verdicts(rebase.verdict_memory, current)
            current.replayed = True
            commit_resolution(rebase, repo, current)
        else:
            current.conflicts = capture_conflicts(repo)
            current.status, state.phase = "conflict", "conflict"
            state.save(rebase.state_file)
            return False
        state.phase = "applying"
        state.save(rebase.state_file)
    return True


def record_applied(rebase: Rebase, repo: git.Repo, current: PatchState, patch: Patch,
                   status: str | None) -> None:
    current.new_commit = repo.head.commit.hexsha
    result = PatchResult(patch, "merged" if status == "merged" else "clean",
                         current.new_commit)
    find_offsets(repo, rebase.project, [result])
    current.status, current.notes = result.status, result.notes


def commit_resolution(rebase: Rebase, repo: git.Repo, current: PatchState) -> None:
    env = {**os.environ, **COMMITTER_ENV, "GIT_EDITOR": "true"}
    if not Path(repo.git_dir, "rebase-apply").exists():
        # killed after git am --continue committed, before the state was saved
        current.status, current.new_commit = "resolved", repo.head.commit.hexsha
        remember_verdicts(rebase.verdict_memory, current)
        return
    result = subprocess.run(["git", "am", "--continue"], cwd=rebase.work, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise E2Error(f"git am --continue failed for {current.id}: "
                      f"{(result.stdout + result.stderr).strip()}",
                      hint="if the resolution drops the whole patch, use e2 rebase --skip")
    current.status = "resolved"
    current.new_commit = repo.head.commit.hexsha
    remember_verdicts(rebase.verdict_memory, current)


# ---------------------------------------------------------------- git steps


def applies_in_reverse(repo: git.Repo, patch_file: Path) -> bool:
    try:
        repo.git.apply("--reverse", "--check", str(patch_file))
        return True
    except git.GitCommandError:
        return False


def am_3way(repo: git.Repo, patch_file: Path) -> tuple[bool, bool]:
    """git am --3way one patch: (applied, needed the 3-way fallback)."""
    returncode, output = git_am(repo, [patch_file])
    return returncode == 0, any(AM_FELL_BACK in line for line in output)
