"""The rebase reports.

At the end, ``docs/rebases/<from>-to-<to>.md`` and ``.json``: per patch its
status and range-diff; per conflicted file the hunks (both sides and the
base), their class and proposal, the committed resolution and a verdict per
hunk; the hot spots; the upstream changes a reviewer must re-read (moved
code's new files included); what to run next.

At every stop, and for ``--dry-run`` and ``e2 drift``, the same facts as far
as the rebase got, with a one-line summary, in ``.e2/rebase-reports`` (kept on
--abort) or the folder asked for.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import git

from e2 import reports
from e2.fsio import write_atomic
from e2.rebase.hotspots import HotSpot
from e2.rebase.state import HunkKind, PatchStatus, RebaseState
from e2.series import Series, series_digest
from e2.verify import Check

STATUSES = ("clean", "offset", "merged", "resolved", "obsolete", "dropped")
NEXT_STEPS = ("e2 verify", "e2 test seam", "e2 test upstream", "e2 probe capacity",
              "e2 probe serve")


def collect(repo: git.Repo, state: RebaseState, old: Series, new: Series,
            digests: tuple[Path, Path], checks: list[Check] | None = None,
            spots: list[HotSpot] | None = None) -> dict:
    old_tag, new_tag = state.source["tag"], state.target["tag"]
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
        "series_digest": {"before": series_digest(old, digests[0]),
                          "after": series_digest(new, digests[1])},
        "summary": {status: sum(p.status == status for p in state.patches)
                    for status in STATUSES},
        "footprint": {"before": _shortstat(repo, f"refs/tags/{old_tag}", "refs/e2/old"),
                      "after": _shortstat(repo, f"refs/tags/{new_tag}", "HEAD")},
        "patches": patches,
        "upstream_changes": upstream_changes(repo, state),
        "hot_spots": [asdict(s) for s in spots or []],
        "verify": verify_entries(checks or []),
        "next": list(NEXT_STEPS),
    }


def verify_entries(checks: list[Check]) -> list[dict]:
    return [{"check": c.name, "ok": c.ok, "problems": c.problems} for c in checks]


def upstream_changes(repo: git.Repo, state: RebaseState) -> list[dict]:
    """The files the series touches that upstream changed between the releases, and
    the files code the series changes moved to."""
    old_tag, new_tag = state.source["tag"], state.target["tag"]
    touched = repo.git.diff("--name-only", f"refs/tags/{old_tag}", "refs/e2/old").split()
    touched += sorted({h.proposal.file for p in state.patches for c in p.conflicts
                       for h in c.hunks if h.kind == HunkKind.MOVED and h.proposal}
                      - set(touched))
    changes = []
    if touched:
        for line in repo.git.diff("--numstat", "--no-renames", f"refs/tags/{old_tag}",
                                  f"refs/tags/{new_tag}", "--", *touched).splitlines():
            added, removed, path = line.split("\t", 2)
            changes.append({"file": path, "added": added, "removed": removed})
    return changes


def summary_line(state: RebaseState, spots: list[HotSpot], finished: bool) -> str:
    """clean / N proposals / N real overlaps / estimated size, in one line."""
    hunks = [h for p in state.patches for c in p.conflicts for h in c.hunks]
    deleted = [c for p in state.patches for c in p.conflicts if c.deleted_upstream]
    proposals = sum(1 for h in hunks if h.proposal)
    overlaps = sum(1 for h in hunks if not h.proposal)
    stops = sum(1 for s in spots if s.kind.stops)
    stuck = [p.id for p in state.patches if p.status == PatchStatus.CONFLICT]
    if not hunks and not deleted and not stops and finished:
        return f"clean: {len(state.patches)} patches apply, {len(spots)} hot spot(s) to review"
    size = (sum(len(h.theirs) for h in hunks if not h.proposal)
            + sum(c.patch_lines for c in deleted))
    parts = [f"{len(hunks)} conflicting hunk(s)", f"{proposals} proposal(s)",
             f"{overlaps} without one (real overlap, moved or deleted code)"]
    if deleted:
        parts.append(f"{len(deleted)} file(s) deleted upstream: "
                     + ", ".join(c.file for c in deleted))
    parts.append(f"{stops} stop(s) and {len(spots) - stops} review(s) among the hot spots")
    parts.append(f"about {size} patch line(s) to port by hand")
    if stuck and not finished:
        parts.append(f"stopped at {stuck[0]}")
    return "; ".join(parts)


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


def render_stop(report: dict) -> str:
    return reports.render("rebase-stop.md.j2", report=report, conflicts=_conflicts(report))


def _conflicts(report: dict) -> list[dict]:
    """Every conflicted file, its patch, and each hunk beside its verdict ("(none)"
    for a hunk that has none)."""
    missing = {"verdict": "(none)", "reason": ""}
    return [{"patch": patch["id"], "file": conflict["file"],
             "deleted": conflict.get("deleted_upstream", False),
             "replaced_by": conflict.get("replaced_by"),
             "resolution": conflict.get("resolution") or "",
             "hunks": [(hunk, conflict["verdicts"][index]
                        if index < len(conflict["verdicts"]) else missing)
                       for index, hunk in enumerate(conflict["hunks"])]}
            for patch in report["patches"] for conflict in patch["conflicts"]]


def write(folder: Path, report: dict, stem: str, stop: bool = False) -> Path:
    write_atomic(folder / f"{stem}.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    markdown = folder / f"{stem}.md"
    write_atomic(markdown, render_stop(report) if stop else render_markdown(report))
    return markdown


def stem(report: dict) -> str:
    return f"{report['from']['version']}-to-{report['to']['version']}"
