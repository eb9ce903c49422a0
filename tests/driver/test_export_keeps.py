"""e2 export rewrites only what e2 wrote in patches/: the user's other files stay, and a
patch file edited by hand is refused by name, never overwritten."""

from __future__ import annotations

import pytest

from conftest import copy_real_patches
from e2.apply import UpstreamOptions, apply_series
from e2.fsio import read_tree

ENVS = "vllm/envs.py"


@pytest.fixture
def amended(e2):
    """The real series in a (sparse) worktree whose patch 0001 was amended since."""
    copy_real_patches(e2)
    apply_series(e2.project, e2.project.load(), e2.work, UpstreamOptions(e2.upstream_cache),
                 sparse=True)
    repo = e2.worktree()
    first = next(e2.project.patches_dir.glob("0001-*.patch")).name
    env = {"GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"}
    repo.git.rebase("-q", "-i", "refs/tags/v0.31.0", env=env)
    touched = next(line[6:] for line in (e2.project.patches_dir / first).read_text().splitlines()
                   if line.startswith("+++ b/"))
    with open(e2.work / touched, "a") as handle:
        handle.write("# amended\n")
    repo.git.commit("-qa", "--amend", "--no-edit")
    repo.git.rebase("--continue")
    return repo


def test_export_keeps_files_series_yaml_does_not_list(e2, amended):
    mine = {"NOTES.md": b"my notes\n", "0009-wip-idea.patch": b"not ready\n",
            "drafts/idea.txt": b"later\n", ".hidden": b"\x00\xff"}
    for name, data in mine.items():
        (e2.project.patches_dir / name).parent.mkdir(exist_ok=True)
        (e2.project.patches_dir / name).write_bytes(data)
    _, out, _ = e2("export")
    assert "exported 2 patches" in out
    after = read_tree(e2.project.patches_dir)
    assert {name: after.get(name) for name in mine} == mine
    assert b"# amended" in after[next(n for n in after if n.startswith("0001-"))]


def test_export_refuses_to_overwrite_an_unlisted_file_of_the_same_name(e2, amended):
    e2.commit_edit(ENVS, "def get_default_config_root():\n",
                   "def get_default_config_root():\n    _ = 'VLLM_E2_NEW'\n", "envs: new thing")
    (e2.project.patches_dir / "0003-envs-new-thing.patch").write_text("my own draft\n")
    before = read_tree(e2.project.patches_dir), e2.series_text()
    _, _, err = e2("export", expect=1)
    assert "patches/0003-envs-new-thing.patch is not in series.yaml, and export would " \
           "overwrite it" in err
    assert (read_tree(e2.project.patches_dir), e2.series_text()) == before


@pytest.mark.parametrize("edited", ["0002", "0001"])
def test_export_refuses_to_overwrite_a_hand_edited_patch_file(e2, amended, edited):
    # 0002: untouched in the worktree; 0001: its commit changed as well
    path = next(e2.project.patches_dir.glob(f"{edited}-*.patch"))
    path.write_text(path.read_text().replace("\n\n", "\n\nA hand-written line.\n", 1))
    before = read_tree(e2.project.patches_dir), e2.series_text()
    _, _, err = e2("export", expect=1)
    assert f"patches/{path.name} changed since e2 last applied or exported" in err
    assert (read_tree(e2.project.patches_dir), e2.series_text()) == before


def test_export_refuses_to_delete_a_hand_edited_patch_file(e2, amended):
    path = next(e2.project.patches_dir.glob("0002-*.patch"))
    path.write_text(path.read_text() + "\n")
    amended.git.reset("-q", "--hard", "HEAD~1")  # 0002's commit dropped
    _, _, err = e2("export", expect=1)
    assert f"patches/{path.name} changed since e2 last applied or exported" in err
    assert path.read_text().endswith("\n\n")


def amend_last(repo, work, line: str) -> None:
    touched = repo.git.diff_tree("--no-commit-id", "--name-only", "-r", "HEAD").split()[0]
    with open(work / touched, "a") as handle:
        handle.write(f"# {line}\n")
    repo.git.commit("-qa", "--amend", "--no-edit")


@pytest.mark.parametrize("recorded", [True, False])
def test_export_rewrites_what_e2_wrote_or_applied(e2, amended, recorded):
    """No false refusal: files e2 exported (or applied) in this worktree are rewritten;
    a worktree from before the record counts a file whose change it holds as its own."""
    if not recorded:
        (e2.work / ".git" / "e2-record.json").unlink()
    e2("export")
    amend_last(amended, e2.work, "0002 amended")
    e2("export")
    after = read_tree(e2.project.patches_dir)
    assert b"# 0002 amended" in after[next(n for n in after if n.startswith("0002-"))]
    assert b"# amended" in after[next(n for n in after if n.startswith("0001-"))]
