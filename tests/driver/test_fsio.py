"""replace_dir: the one way e2 rewrites patches/ and overlay/."""

from __future__ import annotations

import errno

import pytest

from e2 import fsio
from e2.errors import E2Error
from e2.fsio import read_tree, replace_dir


def test_an_empty_tree_replaces_the_old_one(tmp_path):
    target = tmp_path / "patches"
    replace_dir(target, {"0001-a.patch": b"a"})
    replace_dir(target, {})   # a rebase whose only patch was skipped
    assert target.is_dir() and read_tree(target) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patches"]


def test_a_full_disk_leaves_the_old_tree_and_no_staging(tmp_path, monkeypatch):
    target = tmp_path / "overlay"
    replace_dir(target, {"vllm/a.py": b"old"})
    written = []

    def fill_up(path, data):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    monkeypatch.setattr(fsio, "write_file", fill_up)
    with pytest.raises(fsio.NoSpace, match=f"no space left on device: .*writing {target}"):
        replace_dir(target, {"vllm/a.py": b"new", "vllm/b.py": b"new"})
    assert read_tree(target) == {"vllm/a.py": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overlay"]


def test_a_symlinked_target_is_refused_and_left_alone(tmp_path):
    real = tmp_path / "elsewhere"
    replace_dir(real, {"x": b"1"})
    (tmp_path / "overlay").symlink_to(real)
    with pytest.raises(E2Error, match="overlay is a symbolic link"):
        replace_dir(tmp_path / "overlay", {"x": b"2"})
    assert read_tree(real) == {"x": b"1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "overlay"]


def test_an_interrupted_swap_is_recovered(tmp_path):
    target = tmp_path / "overlay"
    replace_dir(target, {"x": b"old"})
    target.rename(tmp_path / ".overlay.old")          # killed between the two renames
    (tmp_path / ".overlay.new").mkdir()
    fsio.recover_dir(target)
    assert read_tree(target) == {"x": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overlay"]
