"""Moved code with no definition of the same name left: the most similar block of
another file stands in for it, on a small repository made here (no sdist)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import git

from e2.rebase.conflicts import capture_conflicts
from e2.rebase.hunks import classify_conflicts
from e2.rebase.state import HunkKind, PatchState

BODY = '''    total = blocks * size
    reserved = total // 8
    usable = total - reserved
    pages = usable // 4096
    return {"total": total, "reserved": reserved, "usable": usable, "pages": pages}
'''
OLD = f'''"""Module a."""


def helper(x):
    return x + 1


def plan(blocks, size):
{BODY}

def other():
    return 2
'''
NEW_A = '''"""Module a."""


def helper(x):
    return x + 1


def other():
    return 2
'''
# upstream moved plan() to planning.py, renamed (and its docstring line is new)
PLANNING = f'''"""Planning."""


def make_plan(blocks, size):
    """The pages a budget holds."""
{BODY}'''
PATCHED_LINE = "    reserved = total // 8 + E2_EXTRA_BLOCKS"


def commit(repo: git.Repo, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        path = Path(repo.working_tree_dir or "") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        repo.git.add(name)
    repo.git.commit("-qm", message)
    return repo.head.commit.hexsha


def moved_and_renamed(tmp_path: Path, kept: bool = True) -> tuple[git.Repo, PatchState]:
    """v1, a patch to plan() on it, and v2 where plan() went to planning.py as
    make_plan() (or, not ``kept``, is gone); HEAD is v2 with the patch stopped in
    git am's 3-way conflict."""
    repo = git.Repo.init(tmp_path / "repo")
    with repo.config_writer() as config:
        config.set_value("user", "name", "T")
        config.set_value("user", "email", "t@vllm-e2.invalid")
        config.set_value("merge", "conflictStyle", "diff3")   # as the rebase's worktree
    commit(repo, {"pkg/a.py": OLD}, "v1")
    repo.git.tag("v1")
    patched = commit(repo, {"pkg/a.py": OLD.replace("    reserved = total // 8", PATCHED_LINE)},
                     "the patch")
    patch_file = tmp_path / "0001.patch"
    patch_file.write_text(repo.git.format_patch("--stdout", "-1", patched) + "\n")
    repo.git.checkout("-q", "-b", "new", "v1")
    commit(repo, {"pkg/a.py": NEW_A, **({"pkg/planning.py": PLANNING} if kept else {})}, "v2")
    am = subprocess.run(["git", "am", "--3way", str(patch_file)], cwd=repo.working_tree_dir,
                        capture_output=True, text=True)
    assert am.returncode != 0, am.stdout
    return repo, PatchState("0001", "the patch", "0001.patch", old_commit=patched)


def test_moved_code_without_its_name_goes_to_the_most_similar_block(tmp_path):
    repo, current = moved_and_renamed(tmp_path)
    [conflict] = classify_conflicts(repo, current, capture_conflicts(repo), "v1")
    assert conflict.file == "pkg/a.py"
    [hunk] = conflict.hunks
    assert hunk.ours == [] and "def plan(blocks, size):" in hunk.base
    assert hunk.kind == HunkKind.MOVED, hunk.why
    assert "the most similar block is pkg/planning.py lines" in hunk.why
    assert "merges cleanly" in hunk.why
    assert hunk.proposal is not None and hunk.proposal.file == "pkg/planning.py"
    assert f"+{PATCHED_LINE}\n" in hunk.proposal.diff
    assert "-    reserved = total // 8\n" in hunk.proposal.diff
    # the proposal applies where the code went, keeping upstream's name and docstring
    repo.git.am("--abort")
    subprocess.run(["git", "apply", "-"], cwd=repo.working_tree_dir, check=True,
                   input=hunk.proposal.diff, text=True)
    moved = (Path(repo.working_tree_dir or "") / "pkg/planning.py").read_text()
    assert PATCHED_LINE in moved and "def make_plan(blocks, size):" in moved
    assert '"""The pages a budget holds."""' in moved
    # and where nothing like it is left, the code is deleted, not moved
    repo, current = moved_and_renamed(tmp_path / "gone", kept=False)
    [conflict] = classify_conflicts(repo, current, capture_conflicts(repo), "v1")
    assert conflict.hunks[0].kind == HunkKind.DELETED
