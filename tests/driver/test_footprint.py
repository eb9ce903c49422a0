"""The series' footprint in upstream's files: every hunk there is one a move to a
newer release has to carry, so the series keeps to a budget of them."""

from __future__ import annotations

from pathlib import Path

from unidiff import PatchSet

REPO_ROOT = Path(__file__).resolve().parents[2]
# Hunks the whole series may have in files upstream ships (its own files aside).
MAX_UPSTREAM_HUNKS = 21


def upstream_hunks(patch_texts: list[str]) -> dict[str, int]:
    """Hunks per file, over the patches in order, in the files upstream ships:
    a file one of them adds is the series' own, whichever patch changes it."""
    own: set[str] = set()
    hunks: dict[str, int] = {}
    for text in patch_texts:
        for changed in PatchSet(text):
            if changed.is_added_file:
                own.add(changed.path)
            elif changed.path not in own:
                hunks[changed.path] = hunks.get(changed.path, 0) + len(changed)
    return hunks


def test_the_count_sees_only_files_upstream_has():
    first = (
        "diff --git a/vllm/new.py b/vllm/new.py\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,2 @@\n+a\n+b\n"
        "diff --git a/vllm/old.py b/vllm/old.py\n--- a/vllm/old.py\n+++ b/vllm/old.py\n"
        "@@ -1,2 +1,3 @@\n x\n+y\n z\n@@ -20,2 +21,3 @@\n x\n+y\n z\n")
    second = (  # a later patch in the first one's new file, and in upstream's
        "diff --git a/vllm/new.py b/vllm/new.py\n--- a/vllm/new.py\n+++ b/vllm/new.py\n"
        "@@ -1,2 +1,3 @@\n a\n+c\n b\n"
        "diff --git a/vllm/old.py b/vllm/old.py\n--- a/vllm/old.py\n+++ b/vllm/old.py\n"
        "@@ -40,2 +41,3 @@\n x\n+y\n z\n")
    assert upstream_hunks([first, second]) == {"vllm/old.py": 3}


def test_the_series_hooks_upstream_in_at_most_21_hunks():
    patches = sorted((REPO_ROOT / "patches").glob("*.patch"))
    assert patches
    hunks = upstream_hunks([p.read_text() for p in patches])
    assert 0 < sum(hunks.values()) <= MAX_UPSTREAM_HUNKS, hunks


def test_each_patch_owns_its_test_files():
    owners: dict[str, list[str]] = {}
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        for changed in PatchSet(patch.read_text()):
            if changed.path.startswith("tests/"):
                owners.setdefault(changed.path, []).append(patch.name[:4])
    assert owners
    assert {path: ids for path, ids in owners.items() if len(ids) > 1} == {}
