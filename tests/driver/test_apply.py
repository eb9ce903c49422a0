"""e2 apply on the real vLLM 0.31.0 tree: clean, offset, 3-way, failure, --through."""

from __future__ import annotations

import git

ENVS = "vllm/envs.py"
CACHE_ROOT = 'def get_default_cache_root():\n    return os.getenv(\n'


def two_patch_series(e2) -> None:
    e2("apply")
    e2.commit_edit(ENVS, CACHE_ROOT, CACHE_ROOT.replace("():\n", "():\n    _ = 'VLLM_E2_ONE'\n"),
                   "envs: first change\n\nWhy it matters.")
    e2.commit_edit(ENVS, "def get_default_config_root():\n",
                   "def get_default_config_root():\n    _ = 'VLLM_E2_TWO'\n", "config: second change")
    e2("export", expect=1)  # new patches need their metadata
    e2.fill_metadata("0001", "VLLM_E2_ONE")
    e2.fill_metadata("0002", "VLLM_E2_TWO")


def test_apply_makes_one_commit_per_patch_keeping_author_and_message(e2):
    two_patch_series(e2)
    code, out, _ = e2("apply", "--force")
    assert "clean  0001 envs: first change" in out
    assert "clean  0002 config: second change" in out
    repo = git.Repo(e2.work)
    commits = list(repo.iter_commits("refs/tags/v0.31.0..HEAD"))
    assert [c.summary for c in reversed(commits)] == ["envs: first change",
                                                      "config: second change"]
    assert commits[1].message == "envs: first change\n\nWhy it matters.\n"
    assert {c.author.email for c in commits} == {"tester@vllm-e2.invalid"}
    assert {c.committer.name for c in commits} == {"vLLM E2"}
    assert repo.active_branch.name == "e2"


def test_apply_is_deterministic(e2, tmp_path):
    two_patch_series(e2)
    e2("apply", "--out", str(tmp_path / "a"))
    e2("apply", "--out", str(tmp_path / "b"))
    assert git.Repo(tmp_path / "a").head.commit == git.Repo(tmp_path / "b").head.commit


def test_through_stops_after_the_named_patch(e2, tmp_path):
    two_patch_series(e2)
    _, out, _ = e2("apply", "--through", "0001", "--out", str(tmp_path / "w"))
    assert "0002" not in out
    assert "VLLM_E2_TWO" not in (tmp_path / "w" / ENVS).read_text()
    assert "VLLM_E2_ONE" in (tmp_path / "w" / ENVS).read_text()
    _, _, err = e2("apply", "--through", "0009", "--out", str(tmp_path / "x"), expect=1)
    assert "series.yaml has no patch 0009" in err


def shift_hunks(patch_file, by: int) -> None:
    import re
    text = patch_file.read_text()
    text = re.sub(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@",
                  lambda m: f"@@ -{int(m[1]) + by},{m[2]} +{int(m[3]) + by},{m[4]} @@",
                  text, flags=re.M)
    patch_file.write_text(text)


def test_offset_is_reported_and_refused_under_exact(e2, tmp_path):
    two_patch_series(e2)
    patch_file = next(e2.project.patches_dir.glob("0002-*.patch"))
    shift_hunks(patch_file, -7)
    _, out, _ = e2("apply", "--out", str(tmp_path / "w"))
    assert "clean  0001" in out
    assert "offset 0002 config: second change" in out
    assert "vllm/envs.py hunk 1 at offset +7 lines" in out
    _, _, err = e2("apply", "--exact", "--out", str(tmp_path / "x"), expect=1)
    assert "patches do not apply exactly on v0.31.0" in err
    assert "0002 (0002-config-second-change.patch): offset" in err


def test_three_way_merge_is_reported(e2, tmp_path):
    # 0002 is written on top of upstream; 0001 then changes a line inside 0002's
    # context, so 0002 applies only through a 3-way merge with upstream's blob.
    e2("apply")
    e2.commit_edit(ENVS, "def get_default_config_root():\n    return os.getenv(\n",
                   "def get_default_config_root():\n    return os.getenv(  # E2\n",
                   "envs: touch config root")
    e2("export", expect=1)
    e2.fill_metadata("0001", "VLLM_E2_ONE")
    e2("apply", "--force", "--through", "0001")
    repo = e2.worktree()
    repo.git.reset("-q", "--hard", "refs/tags/v0.31.0")
    e2.commit_edit(ENVS, '        os.path.join(os.path.expanduser("~"), ".config"),\n',
                   '        os.path.join(os.path.expanduser("~"), ".config", "vllm-e2"),\n',
                   "envs: config root below e2")
    second = repo.git.format_patch("-1", "HEAD", "--stdout", "--zero-commit",
                                   "--no-signature", "-N", "--abbrev=12")
    (e2.project.patches_dir / "0002-envs-config-root-below-e2.patch").write_text(second + "\n")
    text = e2.series_text()
    e2.project.series_file.write_text(text + text[text.index("- id: '0001'"):]
                                      .replace("'0001'", "'0002'")
                                      .replace("0001-envs-touch-config-root", "0002-envs-config-root-below-e2")
                                      .replace("envs: touch config root", "envs: config root below e2")
                                      .replace("VLLM_E2_ONE", "VLLM_E2_TWO"))
    _, out, _ = e2("apply", "--out", str(tmp_path / "w"))
    assert "clean  0001" in out
    assert "merged 0002 envs: config root below e2" in out
    assert "needed a 3-way merge" in out
    result = (tmp_path / "w" / ENVS).read_text()
    assert "return os.getenv(  # E2" in result and '".config", "vllm-e2"' in result


def test_failure_names_patch_file_hunk_and_expected_lines(e2, tmp_path):
    two_patch_series(e2)
    patch_file = next(e2.project.patches_dir.glob("0002-*.patch"))
    patch_file.write_text(patch_file.read_text().replace(
        " def get_default_config_root():", " def get_default_config_dir():"))
    code, _, err = e2("apply", "--out", str(tmp_path / "w"), expect=1)
    assert "patch 0002 (patches/0002-config-second-change.patch) does not apply on " \
           "v0.31.0 + 0001..0001" in err
    assert "file vllm/envs.py, hunk 1 @@ -" in err
    assert "-def get_default_config_dir():" in err
    assert "+def get_default_config_root():" in err
    # the worktree stays at the last patch that applied, with no am in progress
    repo = git.Repo(tmp_path / "w")
    assert repo.head.commit.summary == "envs: first change"
    assert not repo.is_dirty(untracked_files=True)
    assert not (tmp_path / "w" / ".git" / "rebase-apply").exists()


def test_patch_for_a_missing_file_is_named(e2, tmp_path):
    two_patch_series(e2)
    patch_file = next(e2.project.patches_dir.glob("0001-*.patch"))
    text = patch_file.read_text().replace("vllm/envs.py", "vllm/gone.py")
    # without the index line git cannot fall back to a 3-way merge on envs.py
    patch_file.write_text("\n".join(row for row in text.split("\n") if not row.startswith("index ")))
    _, _, err = e2("apply", "--out", str(tmp_path / "w"), expect=1)
    assert "patch 0001" in err and "file vllm/gone.py: does not exist upstream" in err


def test_existing_worktree_is_kept_unless_forced_and_safe(e2):
    two_patch_series(e2)
    e2("apply", "--force")
    _, _, err = e2("apply", expect=1)
    assert "already exists" in err and "--force" in err
    (e2.work / "README.md").write_text("edited\n")
    _, _, err = e2("apply", "--force", expect=1)
    assert "uncommitted changes (--force would delete them)" in err and "README.md" in err
    e2.worktree().git.commit("-qam", "unexported work")
    _, _, err = e2("apply", "--force", expect=1)
    assert "(unexported work) that is not in patches/; --force would lose it" in err
    assert (e2.work / "README.md").read_text() == "edited\n"


def test_missing_patch_file_is_named(e2):
    two_patch_series(e2)
    next(e2.project.patches_dir.glob("0002-*.patch")).unlink()
    _, _, err = e2("apply", "--force", expect=1)
    assert "series.yaml lists 0002 as patches/0002-config-second-change.patch, " \
           "which does not exist" in err
