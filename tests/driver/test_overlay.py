"""e2 overlay: the changed vllm/ files, their manifest, the compiled-source guard."""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import copy_real_patches
from e2 import fsio
from e2.fsio import recover_dir

ENVS = "vllm/envs.py"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def series_with(e2, *edits) -> None:
    """Commit each (path, old, new, message, switch) edit as a patch and export."""
    e2("apply", "--force")
    for path, old, new, message, _ in edits:
        e2.commit_edit(path, old, new, message)
    e2("export", expect=1)
    for edit in edits:
        e2.fill_metadata(None, edit[4])


def add_file(e2, path: str, text: str, message: str) -> None:
    target = e2.work / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    repo = e2.worktree()
    repo.git.add(path)
    repo.git.commit("-q", "-m", message)


def delete_file(e2, path: str, message: str) -> None:
    repo = e2.worktree()
    repo.git.rm("-q", path)
    repo.git.commit("-q", "-m", message)


def test_overlay_holds_changed_new_and_deleted_files_with_hashes(e2, upstream_cache):
    e2("apply")
    upstream_envs = (e2.work / ENVS).read_bytes()
    upstream_gone = (e2.work / "vllm/scripts.py").read_bytes()
    e2.commit_edit(ENVS, "def get_default_config_root():\n",
                   "def get_default_config_root():\n    _ = 'VLLM_E2_ONE'\n", "one")
    add_file(e2, "vllm/e2_extra.py", "FLAG = 'VLLM_E2_TWO'\n", "two")
    e2.commit_edit(ENVS, "def get_default_cache_root():\n",
                   "def get_default_cache_root():\n    # three\n", "three")
    delete_file(e2, "vllm/scripts.py", "four")
    add_file(e2, "tests/e2/test_nothing.py", "def test_x():\n    assert 1\n", "five")
    e2("export", expect=1)
    for number, switch in enumerate(["ONE", "TWO", "THREE", "FOUR", "FIVE"], start=1):
        e2.fill_metadata(f"{number:04d}", f"VLLM_E2_{switch}")
    _, out, _ = e2("overlay")
    assert "overlay/ written: 3 files, 1 deletions" in out

    overlay = e2.project.overlay_dir
    manifest = json.loads((overlay / "MANIFEST.json").read_text())
    files = {f["path"]: f for f in manifest["files"]}
    assert sorted(files) == ["vllm/e2_extra.py", "vllm/e2_series.json", "vllm/envs.py"]
    envs = files[ENVS]
    assert envs["patches"] == ["0001", "0003"]
    assert envs["upstream_sha256"] == sha(upstream_envs)
    assert envs["sha256"] == sha((overlay / ENVS).read_bytes())
    assert envs["sha256"] == sha((e2.work / ENVS).read_bytes())
    assert files["vllm/e2_extra.py"]["upstream_sha256"] is None
    assert files["vllm/e2_series.json"]["generated"] is True
    assert manifest["deleted"] == [{"path": "vllm/scripts.py", "patches": ["0004"],
                                    "upstream_sha256": sha(upstream_gone)}]
    assert manifest["patches"] == ["0001", "0002", "0003", "0004", "0005"]
    assert manifest["upstream"]["version"] == "0.31.0"
    assert not (overlay / "tests").exists()  # tests/ is not part of the package

    info = json.loads((overlay / "vllm/e2_series.json").read_text())
    assert info["series_digest"] == manifest["series_digest"]
    assert [p["switch"] for p in info["patches"]] == [
        "VLLM_E2_ONE", "VLLM_E2_TWO", "VLLM_E2_THREE", "VLLM_E2_FOUR", "VLLM_E2_FIVE"]

    _, out, _ = e2("overlay")
    assert "already up to date" in out


@pytest.mark.parametrize("path", ["csrc/custom_quickreduce.cu", "CMakeLists.txt", "setup.py"])
def test_changes_to_compiled_sources_are_refused(e2, path):
    e2("apply")
    text = (e2.work / path).read_text()
    e2.commit_edit(path, text[:40], text[:40] + "\n", "touch " + path)
    e2("export", expect=1)
    e2.fill_metadata("0001", "VLLM_E2_ONE")
    _, _, err = e2("overlay", expect=1)
    assert "the series changes compiled or build sources" in err
    assert f"{path} (patch 0001;" in err
    assert not e2.project.overlay_dir.exists()


def test_interrupted_write_leaves_the_old_overlay_intact(e2, monkeypatch):
    series_with(e2, (ENVS, "def get_default_config_root():\n",
                     "def get_default_config_root():\n    _ = 'VLLM_E2_ONE'\n", "one",
                     "VLLM_E2_ONE"))
    e2("overlay")
    before = fsio.read_tree(e2.project.overlay_dir)
    series_with(e2, (ENVS, "def get_default_cache_root():\n",
                     "def get_default_cache_root():\n    _ = 'VLLM_E2_TWO'\n", "two",
                     "VLLM_E2_TWO"))
    calls = []
    real_write = fsio.write_file

    def failing_write(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user pressed ^C half-way
        real_write(path, data)

    monkeypatch.setattr(fsio, "write_file", failing_write)
    e2("overlay", expect=130)
    assert fsio.read_tree(e2.project.overlay_dir) == before
    assert sorted(p.name for p in e2.project.root.iterdir() if p.name.startswith(".overlay")) == []
    monkeypatch.setattr(fsio, "write_file", real_write)
    e2("overlay")
    assert fsio.read_tree(e2.project.overlay_dir) != before


def test_a_kill_between_the_two_renames_is_repaired(tmp_path):
    target = tmp_path / "overlay"
    old = tmp_path / ".overlay.old"
    new = tmp_path / ".overlay.new"
    (old / "vllm").mkdir(parents=True)
    (old / "vllm" / "envs.py").write_text("old\n")
    (new / "vllm").mkdir(parents=True)
    (new / "vllm" / "envs.py").write_text("half\n")
    recover_dir(target)
    assert (target / "vllm" / "envs.py").read_text() == "old\n"
    assert not old.exists() and not new.exists()


def commit_mode_change(e2, kind: str) -> str:
    """Commit one change the overlay cannot carry; the path it names."""
    repo = e2.worktree()
    if kind == "symlink":
        (e2.work / "vllm/e2_link.py").symlink_to("envs.py")
        path = "vllm/e2_link.py"
    elif kind == "now-a-symlink":
        path = "vllm/e2_envs_alias.py"
        (e2.work / path).symlink_to("envs.py")
        repo.git.add(path)
        repo.git.commit("-qm", "an alias")  # upstream of the series: a plain file at first
        path = "vllm/envs.py"
        (e2.work / path).unlink()
        (e2.work / path).symlink_to("e2_envs_alias.py")
    elif kind == "executable":
        path = "vllm/version.py"
    elif kind == "not-executable":  # executable upstream
        path = "vllm/envs.py"
        (e2.work / path).chmod(0o644)
        repo.git.add("--chmod=-x", path)
    else:  # a new executable file
        path = "vllm/e2_tool.py"
        (e2.work / path).write_text("print('hi')\n")
    repo.git.add("-A")
    if kind in ("executable", "new-executable"):
        (e2.work / path).chmod(0o755)
        repo.git.add("--chmod=+x", path)  # whatever core.fileMode says
    repo.git.commit("-qm", f"{kind} change")
    return path


@pytest.mark.parametrize("kind,what", [("symlink", "makes it a symbolic link"),
                                       ("now-a-symlink", "makes it a symbolic link"),
                                       ("executable", "changes its mode 100644 -> 100755"),
                                       ("not-executable", "changes its mode 100755 -> 100644"),
                                       ("new-executable", "adds it executable")])
def test_symlinks_and_mode_changes_are_refused_not_flattened(e2, kind, what):
    e2("apply")
    path = commit_mode_change(e2, kind)
    e2("export", expect=1)
    for number in range(2 if kind == "now-a-symlink" else 1):
        e2.fill_metadata(None, f"VLLM_E2_MODE_{number}")
    _, _, err = e2("overlay", expect=1)
    assert "the series changes what an overlay of plain files cannot carry" in err
    assert f"{path} (patch " in err and what in err
    # only the patch that made the change is named, not others touching the file
    assert f"{path} (patch {e2.project.load().patches[-1].id}: " in err
    assert "Traceback" not in err
    assert not e2.project.overlay_dir.exists()


def test_a_mode_change_names_the_patch_that_made_it(e2):
    """Another patch edited the file's contents first: only the mode's is named."""
    e2("apply")
    repo = e2.worktree()
    envs = e2.work / "vllm/envs.py"
    envs.write_text(envs.read_text() + "# E2: a content change\n")
    repo.git.commit("-qam", "contents")
    commit_mode_change(e2, "not-executable")
    e2("export", expect=1)
    for number in range(2):
        e2.fill_metadata(None, f"VLLM_E2_MODE_{number}")
    first, second = (p.id for p in e2.project.load().patches[-2:])
    _, _, err = e2("overlay", expect=1)
    assert f"vllm/envs.py (patch {second}: changes its mode 100755 -> 100644)" in err
    assert f"patch {first}" not in err


def test_a_retitled_patch_puts_e2_series_json_out_of_sync(e2):
    copy_real_patches(e2)
    e2("overlay")
    _, out, _ = e2("status")
    assert "in sync" in out
    title = e2.project.load().patches[0].title
    e2.project.series_file.write_text(e2.series_text().replace(title, "A new title", 1))
    assert e2.project.load().patches[0].title == "A new title"
    _, out, _ = e2("status", expect=1)
    assert "overlay/vllm/e2_series.json does not say what series.yaml does" in out
    e2("overlay")
    info = json.loads((e2.project.overlay_dir / "vllm/e2_series.json").read_text())
    assert info["patches"][0]["title"] == "A new title"
    _, out, _ = e2("status")
    assert "in sync" in out
