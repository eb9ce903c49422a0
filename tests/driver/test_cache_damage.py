"""A damaged object in the cache's upstream repo is named, not applied nor blamed on a
patch: git does not check a blob's id when it checks the file out."""

from __future__ import annotations

import shutil
import zlib

import git
import pytest

from conftest import copy_real_patches

DAMAGE = ("other content", "unreadable", "missing")


@pytest.fixture(params=DAMAGE)
def damaged_cache(e2, tmp_path, request):
    """A copy of the tests' cache whose blob of vllm/envs.py (v0.31.0) holds other
    content (valid, under the wrong id), bytes git cannot inflate, or is gone."""
    root = tmp_path / "cache"
    shutil.copytree(e2.cache.upstream_repo, root / e2.cache.upstream_repo.name, symlinks=True)
    for name in ("downloads", "lock"):
        source = e2.cache.root / name
        if source.is_dir():
            (root / name).symlink_to(source)
    repo = git.Repo(root / e2.cache.upstream_repo.name)
    blob = repo.commit("v0.31.0").tree["vllm/envs.py"]
    data = blob.data_stream.read().replace(b"import os", b"import os  # tampered", 1)
    path = root / e2.cache.upstream_repo.name / "objects" / blob.hexsha[:2] / blob.hexsha[2:]
    assert path.is_file()  # a loose object (the import writes them so)
    path.chmod(0o644)
    if request.param == "other content":
        path.write_bytes(zlib.compress(b"blob %d\x00" % len(data) + data))
    elif request.param == "unreadable":
        path.write_bytes(b"\x00not zlib" * 30)
    else:
        path.unlink()
    return root


@pytest.mark.parametrize("verb", [("apply",), ("overlay",), ("verify",)])
def test_a_damaged_blob_is_named_and_nothing_applied(e2, damaged_cache, verb):
    copy_real_patches(e2)
    code, out, err = e2("--cache", str(damaged_cache), *verb, expect=None)
    assert code == 1
    said = out + err
    assert f"the cache's upstream repo {damaged_cache / e2.cache.upstream_repo.name} " \
           "is damaged: vllm/envs.py" in said
    assert "patch 0001" not in said and "Traceback" not in said
    assert "unexpected" not in said and "crash.log" not in said
    assert not e2.work.exists() and not e2.project.overlay_dir.exists()
