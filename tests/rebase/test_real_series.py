"""e2 drift on the real series against the real releases after the pin (0.32.0,
0.33.0, 0.34.0): one `e2 drift` run for the whole module (its three dry runs are
the costly part), its reports read by every test.

What it must find on upstream's own changes: the code of 0002 that 0.33.0 moved
to vllm/v1/core/kv_cache_planning.py, trial-applied there; 0.34.0's deletion of
vllm/v1/worker/gpu_model_runner.py, named; every conflicting hunk classified;
the names the seam tests import that 0.33.0 moved; and the checkout left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import git
import pytest

from conftest import REPO_ROOT
from crafted import TARGETS
from e2.fsio import read_tree

RELEASES = {**TARGETS,
            "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"}
KINDS = {"both-added", "insert-before-rewrite", "moved", "deleted", "overlap"}


def checkout_bytes(root: Path) -> dict[str, bytes]:
    """Every file of the checkout but .git and .e2's caches: what a dry run must not change."""
    return {name: data for name, data in read_tree(root).items()
            if not name.startswith((".git/", "docs/drift/"))}


@pytest.fixture(scope="session")
def drift(tmp_path_factory, upstream_cache):
    from e2.series import Upstream

    for version, sha in RELEASES.items():
        upstream_cache.ensure(Upstream(version=version, tag=f"v{version}", sdist_sha256=sha))
    root = tmp_path_factory.mktemp("real") / "project"
    root.mkdir()
    for name in ("series.yaml", "Dockerfile"):
        shutil.copy2(REPO_ROOT / name, root / name)
    for name in ("patches", "overlay", "images"):
        shutil.copytree(REPO_ROOT / name, root / name)
    repo = git.Repo.init(root)
    repo.git.add("-A")
    repo.git.commit("-qm", "the real series", author="T <t@vllm-e2.invalid>",
                    env={"GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@vllm-e2.invalid"})
    before = checkout_bytes(root)
    result = subprocess.run(["e2", "--project", str(root), "--cache",
                             str(upstream_cache.cache.root), "drift"],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TMPDIR": str(root.parent)})
    assert result.returncode == 0, result.stdout + result.stderr
    folder = root / "docs" / "drift"
    return SimpleNamespace(
        root=root, out=result.stdout, before=before, after=checkout_bytes(root),
        status=repo.git.status("--porcelain", "--untracked-files=all"),
        leftovers=[p.name for p in root.parent.iterdir() if p.name.startswith("e2-dry-run")],
        reports={v: json.loads((folder / f"0.31.0-to-{v}.json").read_text()) for v in RELEASES},
        markdown={v: (folder / f"0.31.0-to-{v}.md").read_text() for v in RELEASES},
        index=(folder / "README.md").read_text())


def hunks(report: dict) -> list[tuple[str, str, dict]]:
    return [(p["id"], c["file"], h) for p in report["patches"] for c in p["conflicts"]
            for h in c["hunks"]]


def test_drift_reports_every_newer_release_in_one_line_each(drift):
    for version in RELEASES:
        line = next(line for line in drift.out.splitlines() if line.startswith(f"{version}: "))
        assert "conflicting hunk(s)" in line and "proposal(s)" in line
        assert f"- [{version}](0.31.0-to-{version}.md): " in drift.index
    assert drift.reports["0.34.0"]["to"]["tag"] == "v0.34.0"


def test_drift_leaves_the_checkout_as_it_was(drift):
    assert drift.after == drift.before
    assert drift.status.splitlines() and all(
        line.startswith("?? docs/drift/") for line in drift.status.splitlines())
    assert drift.leftovers == []   # the scratch folders are gone


def test_0_33_0_finds_the_code_moved_to_kv_cache_planning_and_applies_it_there(drift):
    report = drift.reports["0.33.0"]
    [(patch, _, hunk)] = [h for h in hunks(report) if h[1] == "vllm/v1/core/kv_cache_utils.py"]
    assert patch == "0002" and hunk["kind"] == "moved"
    assert hunk["ours"] == [] and len(hunk["base"]) > 100   # upstream's side is empty
    assert "vllm/v1/core/kv_cache_planning.py" in hunk["why"]
    proposal = hunk["proposal"]
    assert proposal["file"] == "vllm/v1/core/kv_cache_planning.py"
    assert proposal["diff"].startswith("--- a/vllm/v1/core/kv_cache_planning.py")
    assert "+    kv_cache_configs = cut_attention_slabs(" in proposal["diff"]
    assert "vllm/v1/core/kv_cache_planning.py" in {c["file"] for c in report["upstream_changes"]}
    assert "vllm/v1/core/kv_cache_planning.py" in drift.markdown["0.33.0"]


def test_0_34_0_names_the_deleted_gpu_model_runner(drift):
    report = drift.reports["0.34.0"]
    deleted = [c for p in report["patches"] for c in p["conflicts"] if c["deleted_upstream"]]
    assert [c["file"] for c in deleted] == ["vllm/v1/worker/gpu_model_runner.py"]
    assert deleted[0]["replaced_by"] == "vllm/v1/worker/gpu/model_runner.py"  # Model Runner V2
    assert "deleted upstream: vllm/v1/worker/gpu_model_runner.py" in drift.out
    assert "**deleted upstream** in 0.34.0" in drift.markdown["0.34.0"]


def test_every_conflicting_hunk_is_classified(drift):
    for version, report in drift.reports.items():
        found = hunks(report)
        assert found, version
        assert all(h["kind"] in KINDS and h["why"] for _, _, h in found), version
        kinds = {(p, f): h["kind"] for p, f, h in found}
        # 0002's admission bound goes in just before a line upstream rewrote
        assert kinds[("0002", "vllm/v1/core/sched/scheduler.py")] == "insert-before-rewrite"
        for _, _, hunk in found:
            if hunk["kind"] == "both-added" and not hunk["base"]:
                # keep both, upstream's lines first
                assert hunk["proposal"]["lines"] == hunk["ours"] + hunk["theirs"]
            if hunk["kind"] == "overlap":
                assert hunk["proposal"] is None
    for version in ("0.33.0", "0.34.0"):
        kinds = {(p, f): h["kind"] for p, f, h in hunks(drift.reports[version])}
        # 0001's registry lines land where upstream added its own
        assert kinds[("0001", "vllm/envs.py")] == "both-added"


def test_insert_before_rewrite_puts_the_insertion_on_upstreams_text(drift):
    [hunk] = [h for _, f, h in hunks(drift.reports["0.33.0"])
              if f == "vllm/v1/core/sched/scheduler.py"]
    base, ours, theirs = hunk["base"], hunk["ours"], hunk["theirs"]
    assert theirs[-len(base):] == base and ours != base   # inserted just before a rewrite
    assert hunk["proposal"]["lines"] == theirs[:-len(base)] + ours
    assert "# vLLM E2: admission" in theirs[0]


def test_hot_spots_name_the_seam_tests_imports_that_0_33_0_moved(drift):
    spots = drift.reports["0.33.0"]["hot_spots"]
    missing = {(s["patch"], s["what"]) for s in spots if s["kind"] == "missing-name"}
    assert any(patch == "0002" and what.startswith(
        "vllm.v1.core.kv_cache_utils has no get_kv_cache_config_from_groups (defined in ")
        and "vllm/v1/core/kv_cache_planning.py" in what for patch, what in missing)
    assert not any(s["kind"] == "missing-name" for s in drift.reports["0.32.0"]["hot_spots"])
    changed = {s["what"].split(":")[0] for s in spots if s["kind"].startswith("function-")}
    assert "Platform._align_hybrid_block_size" in changed
    assert all(s["kind"] != "syntax" for r in drift.reports.values() for s in r["hot_spots"])
