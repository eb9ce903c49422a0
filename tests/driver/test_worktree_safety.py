"""apply --force and export never lose what a worktree holds: refs of its own (branches,
tags, stashes, notes), commits only a reflog reaches, a git operation stopped half-way."""

from __future__ import annotations

import os
import subprocess

import git
import pytest

from conftest import copy_real_patches
from e2.apply import UpstreamOptions, apply_series
from e2.fsio import read_tree

ENVS = "vllm/envs.py"


@pytest.fixture
def worktree(e2) -> git.Repo:
    """The real series applied (sparse: only the files it touches, to be quick)."""
    copy_real_patches(e2)
    apply_series(e2.project, e2.project.load(), e2.work, UpstreamOptions(e2.upstream_cache),
                 sparse=True)
    return e2.worktree()


def side_commit(repo: git.Repo, message: str) -> str:
    """A commit of an edit to vllm/envs.py on top of HEAD."""
    path = os.path.join(repo.working_tree_dir, ENVS)
    with open(path, "a") as handle:
        handle.write(f"# {message}\n")
    repo.git.commit("-qam", message)
    return repo.head.commit.hexsha


def refused(e2, repo: git.Repo, *words: str) -> None:
    """apply --force refuses naming ``words`` and leaves the worktree as it was."""
    head, refs = repo.head.commit.hexsha, repo.git.for_each_ref()
    _, _, err = e2("apply", "--force", expect=1)
    for word in words:
        assert word in err, err
    assert "Traceback" not in err
    assert repo.head.commit.hexsha == head and repo.git.for_each_ref() == refs


def test_force_keeps_a_stash(e2, worktree):
    with open(e2.work / ENVS, "a") as handle:
        handle.write("# mine\n")
    worktree.git.stash("-q")
    worktree.git.stash("list")
    refused(e2, worktree, "refs of its own", "the stash (1 entry)")
    assert len(worktree.git.stash("list").splitlines()) == 1


@pytest.mark.parametrize("kind", ["branch", "tag-reset-away", "annotated-tag", "note",
                                  "other-ref", "moved-upstream-tag"])
def test_force_keeps_refs_of_the_worktrees_own(e2, worktree, kind):
    if kind == "branch":
        worktree.git.checkout("-q", "-b", "experiment")
        side_commit(worktree, "experiment")
        worktree.git.checkout("-q", "e2")
        named = "branch experiment"
    elif kind == "tag-reset-away":
        worktree.git.tag("mine", side_commit(worktree, "tagged"))
        worktree.git.reset("-q", "--hard", "HEAD~1")
        named = "tag mine"
    elif kind == "annotated-tag":
        worktree.git.tag("-a", "release-notes", "-m", "notes", "HEAD")
        named = "tag release-notes"
    elif kind == "note":
        worktree.git.notes("add", "-m", "remember this", "HEAD")
        named = "refs/notes/commits"
    elif kind == "other-ref":
        worktree.git.update_ref("refs/keep/idea", side_commit(worktree, "idea"))
        worktree.git.reset("-q", "--hard", "HEAD~1")
        named = "refs/keep/idea"
    else:  # the upstream tag moved onto a commit of the user's
        worktree.git.tag("-f", "v0.31.0", side_commit(worktree, "moved"))
        worktree.git.reset("-q", "--hard", "HEAD~1")
        named = "tag v0.31.0"
    refused(e2, worktree, "refs of its own", named)


def test_force_keeps_commits_only_a_reflog_reaches(e2, worktree):
    lost = side_commit(worktree, "reset away")
    worktree.git.reset("-q", "--hard", "HEAD~1")
    refused(e2, worktree, f"commit {lost[:12]} (reset away) only in its reflog")
    # exporting records what the worktree holds as seen: then --force may replace it
    _, out, _ = e2("export")
    assert "already match" in out
    e2("apply", "--force")
    assert not git.Repo(e2.work).is_dirty(untracked_files=True)


def test_force_replaces_a_reflog_commit_whose_change_is_in_patches(e2, worktree):
    # the last patch dropped and applied again: the old commit is reflog-only, its change kept
    last = next(e2.project.patches_dir.glob("0002-*.patch"))
    worktree.git.reset("-q", "--hard", "HEAD~1")
    worktree.git.am("-q", str(last))
    e2("apply", "--force")


def stop_rebase(repo: git.Repo) -> None:
    env = {**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"}
    subprocess.run(["git", "rebase", "-q", "-i", "refs/tags/v0.31.0"], cwd=repo.working_tree_dir,
                   env=env, check=True, capture_output=True)


def stop_cherry_pick(repo: git.Repo) -> None:
    # the last patch's change picked onto itself comes out empty: git stops and waits
    again = repo.git.commit_tree("HEAD^{tree}", "-p", "HEAD~1", "-m", "the last change again")
    with pytest.raises(git.GitCommandError):
        repo.git.cherry_pick(again)


def stop_merge(repo: git.Repo) -> None:
    other = repo.git.commit_tree("HEAD^{tree}", "-p", "refs/tags/v0.31.0", "-m", "other line")
    repo.git.merge("-q", "-s", "ours", "--no-ff", "--no-commit", other)


def stop_bisect(repo: git.Repo) -> None:
    repo.git.bisect("start", "HEAD", "refs/tags/v0.31.0")


@pytest.mark.parametrize("command,stop", [("rebase", stop_rebase),
                                          ("cherry-pick", stop_cherry_pick),
                                          ("merge", stop_merge), ("bisect", stop_bisect)])
def test_export_and_force_refuse_a_stopped_git_operation(e2, worktree, command, stop):
    stop(worktree)
    assert not worktree.is_dirty(untracked_files=True)  # nothing but the stop says so
    before = read_tree(e2.project.patches_dir), e2.series_text()
    for verb in (("export",), ("apply", "--force")):
        _, _, err = e2(*verb, expect=1)
        assert f"a git {command} is in progress" in err, err
        assert f"git -C {e2.work} {command}" in err or command == "bisect"
    assert (read_tree(e2.project.patches_dir), e2.series_text()) == before
    assert (e2.work / ".git").is_dir()
