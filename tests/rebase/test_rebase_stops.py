"""e2 rebase's stops on the crafted series: the report each stop writes (kept on
--abort), proposals taken with --accept-proposals, --dry-run, whole recorded
resolutions replayed (never rerere's hunks alone), series.yaml edits made while
stopped, and a kill right after git am --continue commits."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import git
import yaml

from crafted import crafted, crafted_template, upstream_releases  # noqa: F401
from rebase_helpers import guarded_files, resolve_keeping_both
from test_rebase import e2_process, rebase_to_conflict, state, statuses

REPORTS = ".e2/rebase-reports"
CORE = "vllm/v1/engine/core.py"


def test_a_stop_writes_a_classified_report_that_abort_keeps(crafted):
    e2 = crafted
    _, _, err = e2("rebase", "--onto", "0.31.0", "--dry-run", expect=1)
    assert "the series is already on v0.31.0" in err
    rebase_to_conflict(e2, "0.32.0")
    _, _, err = e2("rebase", "--onto", "0.33.0", "--dry-run", expect=1)
    assert "a rebase is in progress" in err
    report = e2.root / REPORTS / "0.31.0-to-0.32.0.json"
    data = json.loads(report.read_text())
    assert data["state"] == "stopped at 0004 (conflict)"
    [hunk] = data["patches"][3]["conflicts"][0]["hunks"]
    assert hunk["kind"] == "both-added" and hunk["base"] == []
    assert hunk["proposal"]["lines"] == hunk["ours"] + hunk["theirs"]
    assert "stopped at 0004" in data["summary_line"]
    assert "both-added" in (e2.root / REPORTS / "0.31.0-to-0.32.0.md").read_text()
    e2("rebase", "--abort")
    assert report.is_file()


def test_accept_proposals_takes_them_and_marks_them_for_review(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    _, _, err = e2("rebase", "--onto", "0.32.0", "--accept-proposals", expect=1)
    assert "--accept-proposals" in err
    e2("rebase", "--continue", "--accept-proposals")
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    [conflict] = report["patches"][3]["conflicts"]
    assert report["patches"][3]["status"] == "resolved"
    assert conflict["verdicts"][0]["reason"].startswith("proposal accepted, to review")
    lines = [line[1:] for line in conflict["resolution"].splitlines() if line.startswith("+")]
    assert "from vllm.e2 import log_boot_report" in lines


def test_dry_run_reports_and_changes_nothing(crafted):
    e2 = crafted
    before = guarded_files(e2)
    _, out, _ = e2("rebase", "--onto", "0.33.0", "--dry-run")
    assert out.startswith("v0.33.0: 4 conflicting hunk(s); 4 proposal(s)")
    data = json.loads((e2.root / REPORTS / "0.31.0-to-0.33.0.json").read_text())
    assert data["state"] == "dry run, would stop at 0004, 0005"
    assert [p["status"] for p in data["patches"]] == [
        "clean", "offset", "merged", "resolved", "obsolete"]
    assert guarded_files(e2) == before
    assert git.Repo(e2.root).git.status("--porcelain") == ""
    assert not (e2.root / ".e2/rebase").exists()


def test_a_dry_run_killed_anywhere_leaves_the_checkout_as_it_was(crafted, tmp_path,
                                                                 monkeypatch):
    e2 = crafted
    before = guarded_files(e2)
    monkeypatch.setenv("TMPDIR", str(tmp_path))   # where a killed run's scratch stays
    for fault in ("dry-run-patch", "after-am"):
        result = e2_process(e2, "rebase", "--onto", "0.32.0", "--dry-run", fault=fault)
        assert result.returncode == -9, result.stderr
        assert guarded_files(e2) == before
        assert git.Repo(e2.root).git.status("--porcelain") == ""
        assert not (e2.root / ".e2/rebase").exists()
    assert len(list(tmp_path.glob("e2-dry-run-*"))) == 2


def record_a_resolution_with_an_edit_outside_the_conflict(e2) -> None:
    rebase_to_conflict(e2, "0.32.0")
    resolve_keeping_both(e2)
    work = git.Repo(e2.root / ".e2/rebase/work")
    envs = e2.root / ".e2/rebase/work/vllm/envs.py"   # a file that applied cleanly
    envs.write_text(envs.read_text().replace(
        "\n\ndef get_default_cache_root():", "\n\n# E2: settled on 0.32.0\ndef get_default_cache_root():"))
    scalar = e2.root / ".e2/rebase/work/vllm/scalar_type.py"   # 0001's file, clean too
    scalar.write_text(scalar.read_text().replace(
        '_E2_CLEAN = "VLLM_E2_CLEAN"\n', '_E2_CLEAN = "VLLM_E2_CLEAN"  # checked by 0004\n'))
    work.git.add("vllm/envs.py", "vllm/scalar_type.py")
    _, out, _ = e2("rebase", "--continue", "--verdict", "still-needed", "--reason",
                   "kept both", expect=1)   # on to the obsolete patch
    assert "already in v0.32.0" in out
    e2("rebase", "--abort")


def fresh_clone(e2, tmp_path, with_records: bool):
    root = tmp_path / "fresh"
    git.Repo.clone_from(str(e2.root), str(root))
    shutil.copytree(e2.root / ".e2/rr-cache", root / ".e2/rr-cache")
    if not with_records:
        shutil.rmtree(root / ".e2/rr-cache/e2-resolutions")
    return SimpleNamespace(root=root, cache=e2.cache)


def test_a_recorded_resolution_replays_whole_and_rerere_alone_never_finishes(crafted,
                                                                            tmp_path):
    e2 = crafted
    record_a_resolution_with_an_edit_outside_the_conflict(e2)
    fresh = fresh_clone(e2, tmp_path / "a", with_records=True)
    result = e2_process(fresh, "rebase", "--onto", "0.32.0", "--drop-obsolete")
    assert result.returncode == 0, result.stdout + result.stderr
    patch = next((fresh.root / "patches").glob("0004-*.patch")).read_text()
    assert "+# E2: settled on 0.32.0" in patch and "+from vllm.e2 import log_boot_report" in patch
    assert "# checked by 0004" in patch
    report = json.loads((fresh.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    assert report["patches"][3]["replayed"] is True
    assert report["patches"][3]["conflicts"][0]["verdicts"][0]["reason"] == "kept both"
    # the first rebase's rr-cache without its whole records: rerere settles the
    # conflicted hunk but not the edit outside it, so the rebase must stop there
    fresh = fresh_clone(e2, tmp_path / "b", with_records=False)
    result = e2_process(fresh, "rebase", "--onto", "0.32.0", "--drop-obsolete")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "git rerere re-resolved the conflicted hunks" in result.stdout
    assert statuses(fresh)[3] == "conflict"


def test_a_recorded_resolution_that_no_longer_applies_stops_and_names_what_changed(
        crafted, tmp_path):
    """An earlier patch changed the line the resolution also edits: the record is
    not replayed in part, the rebase stops at the patch and names the file."""
    e2 = crafted
    record_a_resolution_with_an_edit_outside_the_conflict(e2)
    fresh = fresh_clone(e2, tmp_path, with_records=True)
    first = next((fresh.root / "patches").glob("0001-*.patch"))
    first.write_text(first.read_text().replace('"VLLM_E2_CLEAN"', '"VLLM_E2_CLEAN_V2"'))
    repo = git.Repo(fresh.root)
    repo.git.commit("-qam", "0001: another value", author="T <t@vllm-e2.invalid>",
                    env={"GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@vllm-e2.invalid"})
    result = e2_process(fresh, "rebase", "--onto", "0.32.0", "--drop-obsolete")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no longer applies: upstream or an earlier patch changed vllm/scalar_type.py" \
        in result.stdout
    assert state(fresh)["phase"] == "replay" and statuses(fresh)[3] == "conflict"


def test_continue_keeps_series_yaml_edits_made_while_stopped_or_refuses_them(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    original = e2.series_text()
    clash = original.replace("0002-formatter-offset.patch", "0002-renamed.patch")
    e2.project.series_file.write_text(clash)
    _, _, err = e2("rebase", "--continue", "--verdict", "still-needed", "--reason", "r",
                   expect=1)
    assert "series.yaml was edited while the rebase was stopped" in err
    assert "the patches' ids or files" in err
    assert e2.series_text() == clash             # the user's edit is still there
    assert state(e2)["phase"] != "finishing"
    edited = original.replace("patches:", "# written while the rebase was stopped\npatches:", 1)
    edited = edited.replace("VLLM_E2_CLEAN test switch", "doc edited while stopped")
    e2.project.series_file.write_text(edited)
    e2("rebase", "--continue")
    final = e2.series_text()
    assert "# written while the rebase was stopped" in final
    assert yaml.safe_load(final)["patches"][0]["switch"]["doc"] == "doc edited while stopped"
    assert yaml.safe_load(final)["upstream"]["version"] == "0.32.0"


def test_abort_keeps_edits_made_while_stopped(crafted):
    """The rebase writes series.yaml and patches/ only when it finishes: at a stop
    they hold what a person wrote since, which --abort keeps and names."""
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    edited = e2.series_text().replace("patches:", "# written while stopped\npatches:", 1)
    e2.project.series_file.write_text(edited)
    notes = e2.project.patches_dir / "NOTES.md"
    notes.write_text("mine\n")
    _, out, _ = e2("rebase", "--abort")
    assert "kept as edited while it was stopped: series.yaml, patches" in out
    assert e2.series_text() == edited and notes.read_text() == "mine\n"
    assert not (e2.project.state_dir / "rebase").exists()


def test_abort_after_the_rebase_wrote_its_files_keeps_the_edits_continue_carried(crafted):
    """A kill while the rebase writes its files: --abort puts the backup back, with
    the series.yaml edits --continue had taken over, and sets the half-written
    files aside beside the reports rather than losing them."""
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    before = e2.series_text()
    edited = before.replace("patches:", "# written while stopped\npatches:", 1)
    e2.project.series_file.write_text(edited)
    result = e2_process(e2, "rebase", "--continue", "--verdict", "still-needed",
                        "--reason", "r", fault="after-series")
    assert result.returncode == -9
    assert state(e2)["phase"] == "finishing"
    half_written = e2.series_text()
    assert "0.32.0" in half_written and half_written != edited
    _, out, _ = e2("rebase", "--abort")
    assert e2.series_text() == edited               # the backup plus the edits
    assert "kept as edited while it was stopped: series.yaml" in out
    aside = e2.project.state_dir / "rebase-reports" / "before-abort" / "series.yaml"
    assert aside.read_text() == half_written


def test_a_kill_right_after_git_am_continue_commits_resumes(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    result = e2_process(e2, "rebase", "--continue", "--verdict", "still-needed",
                        "--reason", "r", fault="after-am-continue")
    assert result.returncode == -9
    result = e2_process(e2, "rebase", "--continue")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((e2.root / "docs/rebases/0.31.0-to-0.32.0.json").read_text())
    assert [p["status"] for p in report["patches"]][:4] == ["clean", "offset", "merged",
                                                             "resolved"]
    assert len(list((e2.root / "patches").glob("*.patch"))) == 4   # applied once


def commit_as_git_am_continue_would(e2) -> git.Repo:
    """The state a kill leaves between git am --continue's commit and its cleanup."""
    work = git.Repo(e2.root / ".e2/rebase/work")
    work.git.commit("-qm", "envs: strict VLLM_E2_* switch registry", "--no-verify",
                    env={"GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@vllm-e2.invalid",
                         "GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@vllm-e2.invalid"})
    assert (e2.root / ".e2/rebase/work/.git/rebase-apply").exists()
    return work


def test_a_commit_left_mid_am_continue_can_be_continued(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    commit_as_git_am_continue_would(e2)
    _, out, _ = e2("rebase", "--continue", "--verdict", "still-needed", "--reason", "r")
    assert "rebased onto v0.32.0" in out
    assert len(list((e2.root / "patches").glob("*.patch"))) == 4


def test_a_commit_left_mid_am_continue_can_be_skipped(crafted):
    e2 = crafted
    rebase_to_conflict(e2, "0.32.0", "--drop-obsolete")
    resolve_keeping_both(e2)
    commit_as_git_am_continue_would(e2)
    e2("rebase", "--skip", "--reason", "not needed")
    assert "VLLM_E2_REPORT" not in e2.series_text()
    assert len(list((e2.root / "patches").glob("*.patch"))) == 3


def import_a_name_that_moved(e2) -> None:
    """Patch 0001 imports create_kv_cache_group_specs from kv_cache_utils, where 0.31.0
    and 0.32.0 define it and 0.33.0 no longer does (it moved to kv_cache_planning.py):
    the patch still applies cleanly there."""
    first = next((e2.root / "patches").glob("0001-*.patch"))
    text = first.read_text()
    assert '+_E2_CLEAN = "VLLM_E2_CLEAN"\n' in text
    first.write_text(text.replace(
        '+_E2_CLEAN = "VLLM_E2_CLEAN"\n',
        "+from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs  # VLLM_E2_CLEAN\n"))
    git.Repo(e2.root).git.commit(
        "-qam", "0001 imports a name", author="T <t@vllm-e2.invalid>",
        env={"GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@vllm-e2.invalid"})


def test_a_missing_name_stops_the_rebase_until_it_resolves(crafted):
    e2 = crafted
    import_a_name_that_moved(e2)
    missing = "vllm.v1.core.kv_cache_utils has no create_kv_cache_group_specs"
    # a dry run lists it, counts the stop and goes on
    e2("rebase", "--onto", "0.33.0", "--dry-run")
    data = json.loads((e2.root / REPORTS / "0.31.0-to-0.33.0.json").read_text())
    assert data["state"] == "dry run, would stop at 0001, 0004, 0005"
    assert [p["status"] for p in data["patches"]][:3] == ["clean", "offset", "merged"]
    [spot] = [s for s in data["hot_spots"] if s["kind"] == "missing-name"]
    assert spot["patch"] == "0001" and spot["file"] == "vllm/scalar_type.py"
    assert spot["what"].startswith(missing)
    # a real rebase stops at the patch, with the report written
    _, out, _ = e2("rebase", "--onto", "0.33.0", expect=1)
    assert "0001 scalar_type: clean: uses what v0.33.0 lacks" in out
    assert f"vllm/scalar_type.py:{spot['line']}: {missing}" in out
    assert "e2 rebase --continue" in out and "--abort" in out
    assert state(e2)["phase"] == "missing-name" and statuses(e2)[:2] == ["conflict", "pending"]
    _, out, _ = e2("status", expect=1)
    assert "stopped at 0001 scalar_type: clean (it uses a vllm name the release lacks)" in out
    data = json.loads((e2.root / REPORTS / "0.31.0-to-0.33.0.json").read_text())
    assert data["state"] == "stopped at 0001 (missing-name)"
    assert any(s["kind"] == "missing-name" and s["patch"] == "0001"
               for s in data["hot_spots"])
    # --continue refuses while the name is still missing, naming it
    _, _, err = e2("rebase", "--continue", expect=1)
    assert f"0001 still uses what v0.33.0 lacks: vllm/scalar_type.py:{spot['line']}: " \
           f"{missing}" in err
    # fixed in the worktree, it goes into the patch's commit and the rebase goes on
    scalar = e2.root / ".e2/rebase/work/vllm/scalar_type.py"
    scalar.write_text(scalar.read_text().replace("v1.core.kv_cache_utils import",
                                                 "v1.core.kv_cache_planning import"))
    _, out, _ = e2("rebase", "--continue", expect=1)
    assert "conflict in 0004" in out
    assert statuses(e2)[:4] == ["resolved", "offset", "merged", "conflict"]
    assert any(n.startswith("fixed at the stop") for n in state(e2)["patches"][0]["notes"])
    work = git.Repo(e2.root / ".e2/rebase/work")
    first = work.git.show(state(e2)["patches"][0]["new_commit"], "--", "vllm/scalar_type.py")
    assert "+from vllm.v1.core.kv_cache_planning import create_kv_cache_group_specs" in first
    e2("rebase", "--abort")
