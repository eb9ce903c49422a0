"""e2 export: commits back into patches/ and series.yaml, byte-identical round trips."""

from __future__ import annotations

import shutil

import git

from conftest import copy_real_patches
from e2.fsio import read_tree

ENVS = "vllm/envs.py"


def snapshot(e2) -> tuple[dict, str]:
    return read_tree(e2.project.patches_dir), e2.series_text()


def test_apply_then_export_round_trips_the_real_series_byte_identically(e2):
    copy_real_patches(e2)
    before = snapshot(e2)
    e2("apply")
    _, out, _ = e2("export")
    assert "already match" in out
    assert snapshot(e2) == before


def test_round_trip_after_an_edit_changes_only_that_patch(e2):
    copy_real_patches(e2, through="0001")
    before_patches, before_series = snapshot(e2)
    e2("apply")
    repo = e2.worktree()
    repo.git.reset("-q", "--soft", "HEAD~1")      # amend the last (only) patch
    (e2.work / "vllm/e2.py").write_text((e2.work / "vllm/e2.py").read_text() + "\n# amended\n")
    repo.git.add("-A")
    repo.git.commit("-q", "-C", "ORIG_HEAD")
    e2("export")
    after_patches, after_series = snapshot(e2)
    assert after_series == before_series          # metadata kept: same title
    assert after_patches.keys() == before_patches.keys()
    (name,) = after_patches
    assert b"+# amended" in after_patches[name]
    # and the amended patch survives another apply/export cycle unchanged
    e2("apply", "--force")
    e2("export")
    assert snapshot(e2) == (after_patches, after_series)


def test_new_commit_gets_a_placeholder_that_verify_names(e2):
    copy_real_patches(e2, through="0001")
    e2("apply")
    e2.commit_edit(ENVS, "def get_default_config_root():\n",
                   "def get_default_config_root():\n    _ = 'VLLM_E2_NEW'\n", "envs: new thing")
    _, _, err = e2("export", expect=1)
    assert "new patches 0002 need metadata" in err
    assert (e2.project.patches_dir / "0002-envs-new-thing.patch").is_file()
    text = e2.series_text()
    line = text.splitlines().index("- id: '0002'") + 1
    _, _, err = e2("verify", expect=1)
    assert f"series.yaml:{line + 4}:5: patches[1].switch.name: Input should be a valid string" in err
    assert "patches[1].tests: List should have at least 1 item" in err


def test_retitled_patch_keeps_its_metadata(e2):
    copy_real_patches(e2, through="0001")
    _, series_before = snapshot(e2)
    e2("apply")
    e2.worktree().git.commit("-q", "--amend", "-m", "envs: E2 switch registry (retitled)")
    e2("export")
    text = e2.series_text()
    assert "title: 'envs: E2 switch registry (retitled)'" in text
    assert "file: 0001-envs-e2-switch-registry-retitled.patch" in text
    assert "name: VLLM_E2_REPORT" in text
    assert list(read_tree(e2.project.patches_dir)) == ["0001-envs-e2-switch-registry-retitled.patch"]


def test_dropped_commit_is_reported_and_removed(e2):
    copy_real_patches(e2, through="0001")
    e2("apply")
    e2.commit_edit(ENVS, "def get_default_config_root():\n",
                   "def get_default_config_root():\n    _ = 'VLLM_E2_NEW'\n", "envs: new thing")
    e2("export", expect=1)
    e2.fill_metadata("0002", "VLLM_E2_NEW")
    e2.worktree().git.rebase("-q", "--onto", "refs/tags/v0.31.0", "HEAD~1")  # drop 0001
    _, out, _ = e2("export")
    assert "dropped 0001 envs: strict VLLM_E2_* switch registry and E2 boot report" in out
    assert list(read_tree(e2.project.patches_dir)) == ["0001-envs-new-thing.patch"]
    assert "VLLM_E2_REPORT" not in e2.series_text()


def test_export_refuses_missing_dirty_and_foreign_worktrees(e2, tmp_path):
    copy_real_patches(e2)
    _, _, err = e2("export", expect=1)
    assert f"no worktree at {e2.work}" in err and "e2 apply" in err
    e2("apply")
    (e2.work / ENVS).write_text("changed\n")
    (e2.work / "untracked.txt").write_text("x\n")
    before = snapshot(e2)
    _, _, err = e2("export", expect=1)
    assert "has uncommitted changes (export reads commits only)" in err
    assert "M vllm/envs.py" in err and "?? untracked.txt" in err
    assert snapshot(e2) == before
    plain = tmp_path / "plain"
    git.Repo.init(plain)
    _, _, err = e2("export", "--from", str(plain), expect=1)
    assert "was not made by e2 apply" in err


def test_export_refuses_a_worktree_on_another_release(e2):
    copy_real_patches(e2)
    e2("apply")
    e2.worktree().git.config("e2.base", "v0.30.0")
    _, _, err = e2("export", expect=1)
    assert "is on v0.30.0, series.yaml pins v0.31.0" in err


def test_export_refuses_an_am_in_progress(e2):
    copy_real_patches(e2)
    e2("apply", "--through", "0001")
    repo = e2.worktree()
    broken = e2.project.root / "broken.patch"
    shutil.copy(next(e2.project.patches_dir.glob("0001-*")), broken)
    try:
        repo.git.am(str(broken))  # applies on top of itself: fails, leaves am state
    except git.GitCommandError:
        pass
    _, _, err = e2("export", expect=1)
    assert "a git am is in progress" in err


def test_comments_in_series_yaml_survive_export(e2):
    from e2.apply import UpstreamOptions, apply_series

    copy_real_patches(e2, through="0001")
    text = e2.series_text()
    text = text.replace("patches:\n", "patches:\n# ordered: 0001 is the switch registry\n", 1)
    text = text.replace("  tests:\n", "  tests:  # the seam tests of this patch\n", 1)
    text = text.replace("  site_packages:", "  # where vllm lives in the base image\n"
                        "  site_packages:", 1)
    e2.project.series_file.write_text(text)
    # a sparse worktree (the files the patches touch) is enough: export reads commits
    apply_series(e2.project, e2.project.load(), e2.work, UpstreamOptions(e2.upstream_cache),
                 sparse=True)
    _, out, _ = e2("export")
    assert "already match" in out and e2.series_text() == text   # byte for byte
    repo = e2.worktree()
    repo.git.commit("-q", "--amend", "-m", "envs: strict switches, renamed")
    e2("export")
    after = e2.series_text()
    assert "# ordered: 0001 is the switch registry\n" in after
    assert "  tests:  # the seam tests of this patch\n" in after
    assert "  # where vllm lives in the base image\n" in after
    assert "title: 'envs: strict switches, renamed'" in after
    assert "file: 0001-envs-strict-switches-renamed.patch" in after
    assert after.count("\n") == text.count("\n")   # only the changed lines changed
