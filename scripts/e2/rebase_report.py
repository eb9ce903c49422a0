"""The rebase report: docs/rebases/<from>-to-<to>.md and .json.

Per patch its status and range-diff; per conflicted file the hunks (both
sides and the base), the resolution that was committed, and a verdict with a
reason per hunk; the upstream changes a reviewer must re-read; what to run next.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import git

from e2 import reports
from e2.fsio import write_atomic
from e2.rebase_state import Rebase, RebaseState
from e2.series import Series, series_digest
from e2.verify import Check

STATUSES = ("clean", "offset", "merged", "resolved", "obsolete", "dropped")
NEXT_STEPS = ("e2 verify", "e2 test seam", "e2 test upstream", "e2 probe capacity",
              "e2 probe serve")


def collect(rebase: Rebase, state: RebaseState, old: Series, new: Series,
            checks: list[Check] | None = None) -> dict:
    repo: git.Repo = rebase.repo()
    old_tag, new_tag = state.source["tag"], state.target["tag"]
    touched = repo.git.diff("--name-only", f"refs/tags/{old_tag}", "refs/e2/old").split()
    upstream_changes = []
    if touched:
        for line in repo.git.diff("--numstat", f"refs/tags/{old_tag}", f"refs/tags/{new_tag}",
                                  "--", *touched).splitlines():
            added, removed, path = line.split("\t", 2)
            upstream_changes.append({"file": path, "added": added, "removed": removed})
    patches = []
    for patch in state.patches:
        entry = asdict(patch)
        entry["range_diff"] = _range_diff(repo, patch.old_commit, patch.new_commit)
        for conflict in entry["conflicts"]:
            conflict["resolution"] = (repo.git.show("--format=", patch.new_commit, "--",
                                                    conflict["file"])
                                      if patch.new_commit else "")
        patches.append(entry)
    return {
        "from": state.source,
        "to": state.target,
        "series_digest": {"before": series_digest(old, rebase.backup / "patches"),
                          "after": series_digest(new, rebase.project.patches_dir)},
        "summary": {status: sum(p.status == status for p in state.patches)
                    for status in STATUSES},
        "footprint": {"before": _shortstat(repo, f"refs/tags/{old_tag}", "refs/e2/old"),
                      "after": _shortstat(repo, f"refs/tags/{new_tag}", "HEAD")},
        "patches": patches,
        "upstream_changes": upstream_changes,
        "verify": [{"check": c.name, "ok": c.ok, "problems": c.problems} for c in checks or []],
        "next": list(NEXT_STEPS),
    }


def _range_diff(repo: git.Repo, old: str | None, new: str | None) -> str:
    if not old or not new:
        return ""
    return repo.git.range_diff("--no-color", f"{old}^!", f"{new}^!")


def _shortstat(repo: git.Repo, base: str, head: str) -> dict:
    files = added = removed = 0
    for line in repo.git.diff("--numstat", base, head).splitlines():
        plus, minus, _ = line.split("\t", 2)
        files += 1
        added += int(plus) if plus.isdigit() else 0
        removed += int(minus) if minus.isdigit() else 0
    return {"files": files, "added": added, "removed": removed}


def render_markdown(report: dict) -> str:
    return reports.render("rebase.md.j2", report=report, conflicts=_conflicts(report))


def _conflicts(report: dict) -> list[dict]:
    """Every conflicted file, its patch, and each hunk beside its verdict ("(none)"
    for a hunk that has none)."""
    missing = {"verdict": "(none)", "reason": ""}
    return [{"patch": patch["id"], "file": conflict["file"],
             "resolution": conflict.get("resolution") or "",
             "hunks": [(hunk, conflict["verdicts"][index]
                        if index < len(conflict["verdicts"]) else missing)
                       for index, hunk in enumerate(conflict["hunks"])]}
            for patch in report["patches"] for conflict in patch["conflicts"]]


def write(rebase: Rebase, state: RebaseState, old: Series, new: Series,
          checks: list[Check] | None = None) -> Path:
    report = collect(rebase, state, old, new, checks)
    folder = rebase.project.root / "docs" / "rebases"
    stem = f"{report['from']['version']}-to-{report['to']['version']}"
    write_atomic(folder / f"{stem}.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    markdown = folder / f"{stem}.md"
    write_atomic(markdown, render_markdown(report))
    return markdown
