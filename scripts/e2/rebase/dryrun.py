"""``e2 rebase --onto V --dry-run`` and ``e2 drift``: the rebase as far as the
series goes without help, in a scratch folder outside the checkout, and its
report. Where a patch conflicts the dry run takes the proposals (and the
patch's side where there is none) to reach the later patches, and says so.
Nothing in the checkout is written but the report; a dry run killed at any
point leaves only a scratch folder in the system's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from e2.apply import UpstreamOptions
from e2.errors import E2Error
from e2.faults import checkpoint
from e2.gitops import COMMITTER_ENV
from e2.rebase import proposals
from e2.rebase.hotspots import HotSpot, check_files, commit_diffs, functions_touched
from e2.rebase.report import collect, stem, summary_line, write
from e2.rebase.state import PatchState, PatchStatus, Phase, RebaseState
from e2.rebase.steps import apply_one, prepare_worktree
from e2.rebase.workspace import Rebase
from e2.series import Project, Series, Upstream


@dataclass
class DryRun:
    report: Path
    summary: str


def dry_run(project: Project, series: Series, target: Upstream, upstream: UpstreamOptions,
            folder: Path) -> DryRun:
    if target.tag == series.upstream.tag:
        raise E2Error(f"the series is already on {target.tag}")
    if (project.state_dir / "rebase" / "state.json").is_file():
        raise E2Error("a rebase is in progress: series.yaml and patches/ may be half rewritten",
                      hint="finish it (e2 rebase --continue) or e2 rebase --abort first")
    upstream.cache.ensure(target, source=upstream.source, local=upstream.local)
    scratch = Path(tempfile.mkdtemp(prefix="e2-dry-run-"))
    try:
        rebase = Rebase.scratch(project, upstream, scratch)
        state = prepare_worktree(rebase, series, target, rebase.work)
        repo = rebase.repo()
        by_id = {p.id: p for p in series.patches}
        stopped = []
        for current in state.patches:
            checkpoint("dry-run-patch")
            if not apply_one(rebase, repo, state, current, by_id[current.id]):
                stopped.append(current.id)
                _go_on(repo, state, current)
        state.phase = Phase.FINISHING
        spots = hot_spots(repo, state)
        report = collect(repo, state, series, series,
                         (project.patches_dir, project.patches_dir), spots=spots)
        # a real rebase also stops at a patch using a name the release lacks
        stops = set(stopped) | {s.patch for s in spots if s.kind.stops}
        stopped = [p.id for p in state.patches if p.id in stops]
        report["state"] = ("dry run, would stop at " + ", ".join(stopped)) if stopped \
            else "dry run, no stop"
        report["summary_line"] = summary_line(state, spots, finished=not stopped)
        path = write(folder, report, stem(report), stop=True)
        return DryRun(path, report["summary_line"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def hot_spots(repo: git.Repo, state: RebaseState) -> list[HotSpot]:
    old_tag, new_tag = state.source["tag"], state.target["tag"]
    spots: list[HotSpot] = []
    owner: dict[str, str] = {}  # file -> the last patch that changes it
    old_commits = [p.old_commit for p in state.patches if p.old_commit]
    diffs = commit_diffs(repo, old_commits, "-U0", paths=("*.py",))
    files = commit_diffs(repo, old_commits, "--name-only")
    for patch in state.patches:
        if patch.old_commit:
            spots += functions_touched(repo, patch, old_tag, new_tag,
                                       diffs.get(patch.old_commit, ""))[0]
            for file in files.get(patch.old_commit, "").split():
                owner[file] = patch.id
    for spot in check_files(repo, new_tag, old_tag):
        spot.patch = owner.get(spot.file, "")
        spots.append(spot)
    return spots


def _go_on(repo: git.Repo, state: RebaseState, current: PatchState) -> None:
    """Past a stop without help: an obsolete patch dropped, a conflict settled by
    its proposals and the patch's side, so the later patches are tried too."""
    if state.phase == Phase.OBSOLETE:
        current.status = PatchStatus.OBSOLETE
        current.notes.append("would stop: already upstream (applies in reverse)")
        return
    if not Path(repo.git_dir, "rebase-apply").exists():
        current.notes.append("would stop: its recorded resolution no longer applies")
        current.status = PatchStatus.RESOLVED
        return
    proposals.accept(repo, current, "still-needed", "dry run", fallback_to_patch=True)
    env = {**os.environ, **COMMITTER_ENV, "GIT_EDITOR": "true"}
    done = subprocess.run(["git", "am", "--continue"], cwd=repo.working_tree_dir, env=env,
                          capture_output=True)
    if done.returncode != 0:
        subprocess.run(["git", "am", "--skip"], cwd=repo.working_tree_dir, capture_output=True)
    current.status = PatchStatus.RESOLVED
    current.new_commit = repo.head.commit.hexsha
    taken = sum(1 for c in current.conflicts for h in c.hunks if h.proposal)
    rest = sum(1 for c in current.conflicts for h in c.hunks if not h.proposal)
    current.notes.append(f"would stop: conflicts (the dry run went on with {taken} "
                         f"proposal(s) and the patch's side of {rest} hunk(s))")
