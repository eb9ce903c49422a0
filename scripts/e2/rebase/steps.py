"""The rebase's step loop: each patch applied onto the new release with
``git am --3way`` and classified as it lands: clean, offset, merged (the 3-way
fallback) or resolved (a recorded whole resolution replayed, or the user's).
The loop stops at a conflict, at a recorded resolution that no longer applies,
and at a patch upstream already has (it applies in reverse) unless
``--drop-obsolete`` drops it as obsolete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path

import git

from e2.am import git_am_series
from e2.apply import AppliedTree, PatchResult, apply_series, find_offsets, touched_paths
from e2.errors import E2Error
from e2.faults import checkpoint
from e2.gitops import (
    AM_FELL_BACK,
    COMMITTER_ENV,
    RECORD,
    am_in_progress,
    check_out_release,
    git_am,
)
from e2.rebase import replay
from e2.rebase.conflicts import capture_conflicts, unmerged_files
from e2.rebase.hotspots import added_lines_of, missing_names
from e2.rebase.hunks import classify_conflicts
from e2.rebase.state import PatchState, PatchStatus, Phase, RebaseState
from e2.rebase.target import release_version, resolve_target
from e2.rebase.workspace import Rebase, widen
from e2.series import Patch, Series, Upstream


def start(rebase: Rebase, series: Series, onto: str, drop_obsolete: bool) -> RebaseState:
    """Back up the series, check out the release ``onto`` (pinned as the index has it),
    record each patch's old commit."""
    if rebase.in_progress():
        raise E2Error(f"a rebase is already in progress ({rebase.state_file})",
                      hint="e2 rebase --continue, --skip or --abort")
    rebase.require_committed()
    if f"v{release_version(onto)}" == series.upstream.tag:
        raise E2Error(f"the series is already on {series.upstream.tag}")
    upstream = rebase.upstream_options()
    shutil.rmtree(rebase.dir, ignore_errors=True)  # leftovers of a start killed before state
    rebase.dir.mkdir(parents=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            # the index's pin of the release (a pip process, a request) is looked up
            # while the old series is applied
            pinned = pool.submit(resolve_target, onto, series.upstream, upstream)
            try:
                old = apply_old_series(rebase, series, rebase.work)
            except Exception:
                pinned.result()  # the pin's own error first, as when it was looked up first
                raise
            target = pinned.result()
        upstream.cache.ensure(target, source=upstream.source, local=upstream.local)
    except BaseException:
        shutil.rmtree(rebase.dir, ignore_errors=True)  # refused before the rebase began
        raise
    rebase.save_backup()
    state = check_out_target(rebase, series, target, old, rebase.work)
    state.drop_obsolete = drop_obsolete
    rebase.rr_cache.mkdir(parents=True, exist_ok=True)
    repo = rebase.repo()
    # relative, so the checkout can move while a rebase is stopped
    rr_link = Path(repo.git_dir) / "rr-cache"
    os.symlink(os.path.relpath(rebase.rr_cache.resolve(), rr_link.parent.resolve()), rr_link)
    with repo.config_writer() as config:
        config.set_value("rerere", "autoUpdate", "true")
    state.save(rebase.state_file)
    return state


def prepare_worktree(rebase: Rebase, series: Series, target: Upstream,
                     work: Path) -> RebaseState:
    """The new release checked out in ``work`` with the old series' commits as
    refs/e2/old; the state with each patch's old commit."""
    old = apply_old_series(rebase, series, work)
    return check_out_target(rebase, series, target, old, work)


def apply_old_series(rebase: Rebase, series: Series, work: Path) -> AppliedTree:
    """The series applied on the release it is on, beside ``work``, sparse (the files
    it touches), which is how the rebase's worktree starts."""
    return apply_series(rebase.project, series, work.parent / f"{work.name}-old",
                        rebase.upstream_options(), sparse=True)


def check_out_target(rebase: Rebase, series: Series, target: Upstream, old: AppliedTree,
                     work: Path) -> RebaseState:
    """``old``'s worktree moved to ``work`` and switched to the new release, its
    commits kept as refs/e2/old: the same sparse checkout (until the first stop
    widens it, workspace.widen) without cloning and checking out a second one."""
    old.path.rename(work)
    repo = git.Repo(work)
    Path(repo.git_dir, RECORD).unlink(missing_ok=True)  # not a worktree e2 apply made
    repo.git.update_ref("refs/e2/old", "HEAD")
    check_out_release(repo, rebase.upstream_options().cache.repo_dir, target.tag)
    with repo.config_writer() as config:
        config.set_value("e2", "base", target.tag)
        config.set_value("merge", "conflictStyle", "diff3")
    return RebaseState(
        source=series.upstream.model_dump(mode="json"),
        target=target.model_dump(mode="json"),
        patches=[PatchState(p.id, p.title, p.file, old_commit=r.commit)
                 for p, r in zip(series.patches, old.results)])


def apply_remaining(rebase: Rebase, state: RebaseState, series: Series) -> bool:
    """Apply the remaining patches; False when stopped for the user."""
    repo = rebase.repo()
    by_id = {p.id: p for p in series.patches}
    if state.phase == Phase.MISSING_NAME:
        return False  # a patch just committed by --continue uses a missing name
    while (current := state.current()) is not None:
        batch = batchable(rebase, repo, state, by_id)
        if len(batch) > 1:
            end = apply_batch(rebase, repo, state, [by_id[p.id] for p in batch])
            if end is BatchEnd.STOPPED:
                return False
            if end is BatchEnd.ALL:
                continue
            current = state.current()  # it did not apply as is: alone, to stop on it
            assert current is not None
        patch = by_id[current.id]
        if not apply_one(rebase, repo, state, current, patch) \
                or stopped_at_missing_names(repo, state, current):
            state.save(rebase.state_file)
            return False
        state.phase = Phase.APPLYING
        state.save(rebase.state_file)
    return True


# ---------------------------------------------------------------- many patches, one git am


class BatchEnd(Enum):
    ALL = "all"              # every patch applied, none uses a missing name
    STOPPED = "stopped"      # stopped at one that uses a missing name
    FAILED = "failed"        # one did not apply as is: pending, for the step alone


def batchable(rebase: Rebase, repo: git.Repo, state: RebaseState,
              by_id: dict[str, Patch]) -> list[PatchState]:
    """The pending patches from the current one on that one git am can apply as each
    would apply alone: none with a recorded resolution or applying in reverse on the
    worktree, and none touching a file an earlier one of them touches (so that the
    worktree holds, for each, what it would meet)."""
    current = state.current()
    assert current is not None
    target_tag = state.target["tag"]
    recorded = any(rebase.resolutions.glob(f"*-{target_tag}.json"))
    batch: list[PatchState] = []
    touched: set[str] = set()
    for patch_state in state.patches[state.patches.index(current):]:
        patch = by_id[patch_state.id]
        patch_file = rebase.project.patch_path(patch)
        files = set(touched_paths(rebase.project, [patch]))
        if patch_state.status != PatchStatus.PENDING or files & touched \
                or (recorded and replay.record_path(rebase.resolutions, patch_file,
                                                    target_tag).is_file()) \
                or applies_in_reverse(repo, patch_file):
            break
        batch.append(patch_state)
        touched |= files
    return batch


def apply_batch(rebase: Rebase, repo: git.Repo, state: RebaseState,
                patches: list[Patch]) -> BatchEnd:
    """``patches`` (batchable) with one git am, then each classified and checked for
    missing names in order, as the step alone does. Where one uses a missing name the
    rebase stops there, the later ones taken back out; where one does not apply as is,
    those before it are kept and it is left pending for the step alone (whose git am
    is the one a stop leaves to --continue)."""
    states = {p.id: p for p in state.patches}
    first = states[patches[0].id]
    base = first.base_commit = repo.head.commit.hexsha
    first.status = PatchStatus.APPLYING  # what --continue reconciles after a kill
    state.save(rebase.state_file)
    checkpoint("before-am")
    run = git_am_series(repo, [rebase.project.patch_path(p) for p in patches])
    checkpoint("after-am")
    if run.returncode != 0:
        if am_in_progress(repo):
            repo.git.am("--quit")
        repo.git.reset("-q", "--hard", "HEAD")
    first.status = PatchStatus.PENDING  # until its commit is classified below
    commits = repo.git.rev_list("--reverse", f"{base}..HEAD").split()
    results = [PatchResult(patch, "merged" if index in run.fell_back else "clean", commit)
               for index, (patch, commit) in enumerate(zip(patches, commits))]
    find_offsets(repo, rebase.project, results)
    added = added_lines_of(repo, commits)
    for result in results:
        current = states[result.patch.id]
        current.base_commit, current.new_commit, base = base, result.commit, result.commit
        current.status, current.notes = PatchStatus(result.status), result.notes
        if stopped_at_missing_names(repo, state, current, result.commit, added[result.commit]):
            state.save(rebase.state_file)
            return BatchEnd.STOPPED
    state.phase = Phase.APPLYING
    state.save(rebase.state_file)
    return BatchEnd.ALL if len(commits) == len(patches) else BatchEnd.FAILED


# ---------------------------------------------------------------- one patch


def apply_one(rebase: Rebase, repo: git.Repo, state: RebaseState, current: PatchState,
              patch: Patch, store: Path | None = None) -> bool:
    """One patch onto HEAD; False when it stops (the state says why), with the
    worktree whole."""
    if _apply_one(rebase, repo, state, current, patch, store):
        return True
    widen(repo)
    return False


def _apply_one(rebase: Rebase, repo: git.Repo, state: RebaseState, current: PatchState,
               patch: Patch, store: Path | None = None) -> bool:
    patch_file = rebase.project.patch_path(patch)
    target_tag = state.target["tag"]
    if current.status == PatchStatus.PENDING and applies_in_reverse(repo, patch_file):
        if not state.drop_obsolete:
            current.status, state.phase = PatchStatus.CONFLICT, Phase.OBSOLETE
            current.notes = [f"already in {target_tag}: applies in reverse"]
            return False
        current.status = PatchStatus.OBSOLETE
        current.reason = f"already in upstream {target_tag} (dropped by --drop-obsolete)"
        return True
    current.status = PatchStatus.APPLYING
    current.base_commit = repo.head.commit.hexsha
    state.save(rebase.state_file)
    store = store if store is not None else rebase.resolutions
    outcome = replay.try_replay(repo, store, patch_file, current, target_tag)
    if outcome is replay.Outcome.REPLAYED:
        return True
    checkpoint("before-am")
    ok, fell_back = am_3way(repo, patch_file)
    checkpoint("after-am")
    if ok:
        record_applied(rebase, repo, current, patch, fell_back)
        if outcome is replay.Outcome.STALE:
            # applies now, but its recorded resolution also changed other lines
            current.status, state.phase = PatchStatus.CONFLICT, Phase.REPLAY
            return False
        return True
    current.conflicts = classify_conflicts(repo, current, capture_conflicts(repo),
                                           state.source["tag"])
    if outcome is replay.Outcome.STALE:
        current.status, state.phase = PatchStatus.CONFLICT, Phase.REPLAY
    else:
        current.status, state.phase = PatchStatus.CONFLICT, Phase.CONFLICT
    if not unmerged_files(repo) and not current.notes:
        # git rerere settled every conflicted hunk, but not what the resolution
        # changed outside them: never commit that as the whole resolution
        current.notes.append("git rerere re-resolved the conflicted hunks; edits the "
                             "resolution made outside them are not replayed: check them")
    return False


MISSING = "missing in the new release:"


def stopped_at_missing_names(repo: git.Repo, state: RebaseState, current: PatchState,
                             at: str = "HEAD", added: dict[str, set[int]] | None = None,
                             ) -> bool:
    """Stop at a patch just committed whose files import a vllm name the new release
    lacks (or do not compile): a clean apply that would fail at import. ``at``: its
    commit where later ones were committed after it (taken back out if it stops),
    ``added``: the lines it adds, where the caller read them."""
    if not current.status.applied:
        return False
    spots = missing_names(repo, current, state.target["tag"], state.source["tag"], at, added)
    if not spots:
        return False
    current.notes = [*current.notes, *(f"{MISSING} {s.file}:{s.line}: {s.what}" for s in spots)]
    current.status, state.phase = PatchStatus.CONFLICT, Phase.MISSING_NAME
    if at != "HEAD":
        repo.git.reset("-q", "--hard", at)
    widen(repo)
    return True


def record_applied(rebase: Rebase, repo: git.Repo, current: PatchState, patch: Patch,
                   fell_back: bool) -> None:
    current.new_commit = repo.head.commit.hexsha
    result = PatchResult(patch, "merged" if fell_back else "clean", current.new_commit)
    find_offsets(repo, rebase.project, [result])
    current.status, current.notes = PatchStatus(result.status), result.notes


def commit_resolution(rebase: Rebase, repo: git.Repo, current: PatchState,
                      target_tag: str) -> None:
    """Commit the user's resolution (git am --continue) and record it whole."""
    env = {**os.environ, **COMMITTER_ENV, "GIT_EDITOR": "true"}
    if committed_since_stop(repo, current):
        # killed after git am --continue committed, before the state was saved
        if Path(repo.git_dir, "rebase-apply").exists():
            subprocess.run(["git", "am", "--quit"], cwd=repo.working_tree_dir,
                           capture_output=True, check=True)
    else:
        result = subprocess.run(["git", "am", "--continue"], cwd=repo.working_tree_dir,
                                env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise E2Error(f"git am --continue failed for {current.id}: "
                          f"{(result.stdout + result.stderr).strip()}",
                          hint="if the resolution drops the whole patch, use e2 rebase --skip")
        checkpoint("after-am-continue")
    current.status = PatchStatus.RESOLVED
    current.new_commit = repo.head.commit.hexsha
    replay.record(repo, rebase.resolutions, rebase.project.patches_dir / current.file,
                  current, target_tag)


def committed_since_stop(repo: git.Repo, current: PatchState) -> bool:
    """HEAD moved past the commit the patch stopped on (its resolution is in)."""
    return (current.base_commit is not None
            and repo.head.commit.hexsha != current.base_commit
            and repo.head.commit.parents[0].hexsha == current.base_commit)


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
