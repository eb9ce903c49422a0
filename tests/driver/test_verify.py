"""e2 verify and e2 status: each failure names what to do."""

from __future__ import annotations

import json
import re
import shutil

import yaml

from conftest import REPO_ROOT, copy_real_patches
from e2.series import dump_series, load_series


def edit_series(e2, change) -> None:
    data = yaml.safe_load(e2.series_text())
    change(data)
    e2.project.series_file.write_text(dump_series(data))


def real_project(e2) -> None:
    copy_real_patches(e2)
    e2("overlay")


def test_the_real_series_verifies(e2):
    real_project(e2)
    _, out, _ = e2("verify")
    # Every check that can fail ran and passed (the scratch project has no
    # Dockerfile template, so the Dockerfile check is not among them).
    assert re.findall(r"^(\S+) +(.+)$", out, re.MULTILINE)[:7] == [
        ("ok", "patch ids unique and contiguous"),
        ("ok", "series.yaml and patches/ agree"),
        ("ok", "every patch applies exactly"),
        ("ok", "every switch is read, every read switch is declared"),
        ("ok", "declared tests exist in the patched tree"),
        ("ok", "v0.31.0's own checks find nothing new in the files the series changes"),
        ("ok", "overlay/ equals what the series generates"),
    ]
    assert out.count("ok  ") == 7
    count = len(load_series(REPO_ROOT / "series.yaml").patches)
    assert f"series verified: {count} patches on v0.31.0" in out


def test_missing_patch_file_is_named(e2):
    real_project(e2)
    next(e2.project.patches_dir.glob("0001-*")).unlink()
    _, out, _ = e2("verify", expect=1)
    assert "FAIL series.yaml and patches/ agree" in out
    assert "0001: patches/0001-envs-strict-vllm-e2-switch-registry-and-e2-boot.patch is " \
           "missing; restore it or remove the entry from series.yaml" in out


def test_unlisted_patch_file_is_named(e2):
    real_project(e2)
    (e2.project.patches_dir / "0002-stray.patch").write_text("stray\n")
    _, out, _ = e2("verify", expect=1)
    assert "patches/0002-stray.patch is not listed in series.yaml" in out


def test_duplicate_and_gapped_ids_are_named(e2):
    real_project(e2)
    original = next(e2.project.patches_dir.glob("0001-*")).name

    def duplicate(data):  # a file of its own: one file under two entries fails to load
        shutil.copy(e2.project.patches_dir / original, e2.project.patches_dir / "0001-again.patch")
        data["patches"].append({**data["patches"][0], "file": "0001-again.patch"})

    edit_series(e2, duplicate)
    _, out, _ = e2("verify", expect=1)
    assert "id 0001 is used twice in series.yaml" in out
    assert "switch VLLM_E2_REPORT is declared by more than one patch" in out

    def gap(data):
        data["patches"] = data["patches"][:1]
        data["patches"][0]["id"] = "0002"

    edit_series(e2, gap)
    _, out, _ = e2("verify", expect=1)
    assert "ids are 0002; expected 0001" in out
    assert f"0002: file {original} should start with '0002-'" in out


def test_undeclared_and_unread_switches_are_named(e2):
    real_project(e2)
    edit_series(e2, lambda d: d["patches"][0]["switch"].update(name="VLLM_E2_RENAMED"))
    e2("overlay")
    _, out, _ = e2("verify", expect=1)
    assert "0001: switch VLLM_E2_RENAMED is never read in the patched vllm/ tree" in out
    assert "VLLM_E2_REPORT is read in vllm/e2.py, vllm/e2_switches.py but no patch declares it" \
        in out


def test_declared_test_must_exist(e2):
    real_project(e2)
    edit_series(e2, lambda d: d["patches"][0].update(tests=["tests/e2/test_missing.py::test_x"]))
    e2("overlay")
    _, out, _ = e2("verify", expect=1)
    assert "0001: test tests/e2/test_missing.py::test_x does not exist in the patched tree" in out


def test_overlay_drift_is_named(e2):
    real_project(e2)
    (e2.project.overlay_dir / "vllm/envs.py").write_text("edited by hand\n")
    (e2.project.overlay_dir / "vllm/extra.py").write_text("x\n")
    _, out, _ = e2("verify", expect=1)
    assert "overlay/vllm/envs.py does not match overlay/MANIFEST.json" in out
    assert "overlay/vllm/extra.py is not in overlay/MANIFEST.json (run e2 overlay)" in out
    e2("overlay")
    e2("verify")
    # consistent with its manifest, but not what the series generates
    import hashlib
    import json
    manifest_path = e2.project.overlay_dir / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    (e2.project.overlay_dir / "vllm/envs.py").write_text("edited by hand\n")
    for entry in manifest["files"]:
        if entry["path"] == "vllm/envs.py":
            entry["sha256"] = hashlib.sha256(b"edited by hand\n").hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _, out, _ = e2("verify", expect=1)
    assert "differs: overlay/vllm/envs.py (run e2 overlay)" in out


def test_inexact_patch_fails_verify(e2):
    real_project(e2)
    patch = next(e2.project.patches_dir.glob("0001-*"))
    text = patch.read_text()
    # envs.py's first hunk said to start 9 lines before where it does
    envs = text.index("diff --git a/vllm/envs.py")
    header = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),", re.M).search(text, envs)
    assert header is not None
    old, new = int(header[1]), int(header[3])
    text = (text[:header.start()] + f"@@ -{old - 9},{header[2]} +{new - 9},"
            + text[header.end():])
    patch.write_text(text)
    _, out, _ = e2("verify", expect=1)
    assert "FAIL every patch applies exactly" in out
    assert "vllm/envs.py hunk 1 at offset +9 lines" in out


def test_status_reports_pin_patches_and_sync(e2):
    real_project(e2)
    _, out, _ = e2("status", "--json")
    state = json.loads(out)
    assert state["upstream"]["version"] == "0.31.0"
    assert state["upstream_cached"] is True
    # What status reports is the project's own series and overlay, entry by entry.
    series = load_series(REPO_ROOT / "series.yaml")
    assert state["patches"] == [
        {"id": p.id, "title": p.title, "file": p.file, "switch": p.switch.name,
         "default": p.switch.default, "compiled": p.switch.compiled} for p in series.patches]
    assert state["patches"][0]["switch"] == "VLLM_E2_REPORT"
    manifest = json.loads((REPO_ROOT / "overlay" / "MANIFEST.json").read_text())
    assert state["overlay_files"] == len(manifest["files"]) >= 4
    assert state["in_sync"] is True
    _, out, _ = e2("status")
    assert "VLLM_E2_REPORT" in out and "in sync" in out
    shutil.rmtree(e2.project.overlay_dir)
    _, out, _ = e2("status", "--json", expect=1)
    assert json.loads(out)["problems"] == ["overlay/ has no MANIFEST.json (run e2 overlay)"]
    real_project(e2)
    patch = next(e2.project.patches_dir.glob("0001-*"))
    patch.write_text(patch.read_text() + "\n")
    _, out, _ = e2("status", expect=1)
    assert "out of sync: overlay/ was made from series " in out
