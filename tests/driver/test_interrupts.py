"""apply, overlay and export killed (SIGKILL) or interrupted (Ctrl-C) at each step.

A checkpoint (e2.faults, E2_FAULT_AT) stops the real `e2` process there. After
a Ctrl-C the command says "interrupted" (exit 130) and everything is as it
was; after a kill nothing is half-written where a reader looks, and running
the command again finishes the job as if nothing had happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import git
import pytest

from conftest import copy_real_patches
from e2.apply import UpstreamOptions, apply_series
from e2.fsio import read_tree

KILLED = -9
INTERRUPTED = 130


def faulted(e2, *args: str, at: str, signal: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "E2_FAULT_AT": at, "E2_FAULT_SIGNAL": signal}
    result = subprocess.run([sys.executable, "-m", "e2.cli", "--project", str(e2.root),
                             "--cache", str(e2.cache.root), *args],
                            env=env, capture_output=True, text=True, timeout=600)
    if signal == "INT":
        assert result.returncode == INTERRUPTED, result.stderr
        assert result.stderr.strip().endswith("error: interrupted")
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == KILLED, result.stderr
    return result


def series_files(e2) -> dict[str, bytes]:
    return {"series.yaml": e2.project.series_file.read_bytes(),
            **{f"patches/{k}": v for k, v in read_tree(e2.project.patches_dir).items()}}


# ---------------------------------------------------------------- apply


@pytest.mark.parametrize("at,signal", [("apply-cloned", "KILL"), ("apply-applied", "INT"),
                                       ("apply-swapping", "KILL"), ("apply-swapping", "INT"),
                                       ("apply-swapped", "KILL"), ("apply-swapped", "INT")])
def test_apply_force_stopped_keeps_the_old_worktree_and_reruns(e2, at, signal):
    copy_real_patches(e2)
    # the worktree to replace: only the files the patches touch (a full checkout is slow)
    apply_series(e2.project, e2.project.load(), e2.work, UpstreamOptions(e2.upstream_cache),
                 sparse=True)
    head = git.Repo(e2.work).head.commit.hexsha
    staging, aside = e2.work.with_name(".work.new"), e2.work.with_name(".work.old")

    faulted(e2, "apply", "--force", at=at, signal=signal)
    if e2.work.exists():  # the old worktree or the new one, whole and clean
        repo = git.Repo(e2.work)
        assert repo.head.commit.hexsha == head
        assert not repo.is_dirty(untracked_files=True)
        assert at == "apply-swapped" or not aside.exists()
    else:  # stopped between the two renames: the old one set aside whole, never deleted
        assert at == "apply-swapping" and staging.is_dir()
        assert git.Repo(aside).head.commit.hexsha == head
        _, out, _ = e2("status", expect=1)  # not "in sync" while it is missing
        assert ".e2/work is missing: an interrupted replacement left it at .e2/.work.old, " \
               "which the next e2 apply or e2 export puts back" in " ".join(out.split())
    if signal == "INT" and at != "apply-swapping":
        assert not staging.exists()

    # the next export puts a set-aside worktree back and finds nothing to do
    _, out, _ = e2("export")
    assert "already match" in out
    e2("apply", "--force")
    assert git.Repo(e2.work).head.commit.hexsha == head  # apply is deterministic
    assert not staging.exists() and not aside.exists()


def test_apply_force_replaces_a_worktree_it_cannot_delete_whole(e2):
    """A folder of the old worktree that cannot be deleted (immutable here; read-only
    for a user) no longer leaves it half-deleted: the new one is swapped in whole and
    the old one, set aside, is named."""
    copy_real_patches(e2)
    apply_series(e2.project, e2.project.load(), e2.work, UpstreamOptions(e2.upstream_cache),
                 sparse=True)
    head = git.Repo(e2.work).head.commit.hexsha
    stuck = e2.work / "vllm"
    aside = e2.work.with_name(".work.old")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        _, _, err = e2("apply", "--force")
        assert f"the old worktree, set aside at {aside}, could not be removed" in err
        assert "Traceback" not in err
        repo = git.Repo(e2.work)
        assert repo.head.commit.hexsha == head and not repo.is_dirty(untracked_files=True)
        assert (e2.work / "vllm/envs.py").is_file()  # the full checkout, whole
    finally:
        subprocess.run(["chattr", "-i", str(aside / "vllm")], check=False)
        subprocess.run(["chattr", "-i", str(stuck)], check=False)
    e2("apply", "--force")  # the leftover goes now that it can
    assert not aside.exists()


# ---------------------------------------------------------------- overlay


@pytest.mark.parametrize("at,signal", [("overlay-planned", "INT"), ("replace-dir-staged", "KILL"),
                                       ("replace-dir-staged", "INT"),
                                       ("replace-dir-swapping", "KILL")])
def test_overlay_stopped_is_old_or_recovered_never_half(e2, at, signal):
    copy_real_patches(e2)
    e2("overlay")
    old = read_tree(e2.project.overlay_dir)
    # new switch documentation: another series digest, so overlay/ must be rewritten
    text = e2.series_text()
    e2.project.series_file.write_text(text.replace("doc: 'Log the E2", "doc: 'Logs the E2"))

    faulted(e2, "overlay", at=at, signal=signal)
    now = read_tree(e2.project.overlay_dir)
    if at == "replace-dir-swapping":
        assert now == {}   # between the two renames: the old tree is set aside whole
        assert read_tree(e2.root / ".overlay.old") == old
    else:
        assert now == old
    _, out, _ = e2("status", expect=1)
    assert "out of sync" in out

    e2("overlay")
    _, out, _ = e2("status")
    assert "in sync" in out
    assert not (e2.root / ".overlay.old").exists() and not (e2.root / ".overlay.new").exists()


# ---------------------------------------------------------------- export


@pytest.fixture
def edited_worktree(e2, tmp_path):
    """A worktree whose patch 0001 was amended, and the export it should give."""
    copy_real_patches(e2)
    series = e2.project.load()
    apply_series(e2.project, series, e2.work, UpstreamOptions(e2.upstream_cache), sparse=True)
    repo = e2.worktree()
    target = e2.work / "vllm/envs.py"
    target.write_text(target.read_text() + "\n# amended\n")
    repo.git.commit("-q", "-a", "--amend", "--no-edit")
    reference = tmp_path / "reference"
    shutil.copytree(e2.root, reference, ignore=shutil.ignore_patterns(".e2"))
    e2("--project", str(reference), "export", "--from", str(e2.work))
    return {"series.yaml": (reference / "series.yaml").read_bytes(),
            **{f"patches/{k}": v for k, v in read_tree(reference / "patches").items()}}


@pytest.mark.parametrize("at,signal", [("export-patches-written", "KILL"),
                                       ("export-patches-written", "INT"),
                                       ("replace-dir-staged", "INT"),
                                       ("replace-dir-swapping", "KILL")])
def test_export_stopped_is_undone_or_finished_by_the_next_export(e2, edited_worktree, at,
                                                                 signal):
    before = series_files(e2)
    assert before != edited_worktree
    faulted(e2, "export", at=at, signal=signal)
    if signal == "INT":
        assert series_files(e2) == before   # patches/ put back, series.yaml untouched
    e2("export")
    assert series_files(e2) == edited_worktree
    _, out, _ = e2("export")
    assert "already match" in out
