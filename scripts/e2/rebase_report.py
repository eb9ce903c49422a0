"""The rebase report: docs/rebases/<from>-to-<to>.md and .json.

Per patch its status and range-diff; per conflicted file the hunks (both
sides and the base), the resolution that was committed, and a verdict with a
reason per hunk; the upstream changes a reviewer must re-read; what to run next.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import git

from e2.fsio import write_atomic
from e2.series import Series, series_digest

if TYPE_CHECKING:
    from e2.rebase import Rebase, RebaseState
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
    old, new = report["from"]["version"], report["to"]["version"]
    out = [f"# Rebase of the E2 series: vLLM {old} -> {new}", ""]
    out += [f"Series digest {report['series_digest']['before'][:12]} -> "
            f"{report['series_digest']['after'][:12]}.", "", "## Summary", "",
            "| status | patches |", "|---|---|"]
    out += [f"| {status} | {count} |" for status, count in report["summary"].items()]
    before, after = report["footprint"]["before"], report["footprint"]["after"]
    out += ["", "What the series changes against upstream:", "",
            "| | files | lines added | lines removed |", "|---|---|---|---|",
            f"| on {old} | {before['files']} | {before['added']} | {before['removed']} |",
            f"| on {new} | {after['files']} | {after['added']} | {after['removed']} |", "",
            "## Patches", ""]
    for patch in report["patches"]:
        out.append(f"### {patch['id']} {patch['title']}: {patch['status']}")
        out.append("")
        out += [f"- {note}" for note in patch["notes"]]
        if patch["reason"]:
            out.append(f"- reason: {patch['reason']}")
        if patch["replayed"]:
            out.append("- resolved by a recorded resolution (git rerere)")
        if patch["range_diff"]:
            out += ["", "range-diff (before -> after):", "", "```", patch["range_diff"], "```"]
        out.append("")
    conflicted = [(p, c) for p in report["patches"] for c in p["conflicts"]]
    out += ["## Conflicts", ""]
    if not conflicted:
        out += ["None.", ""]
    for patch, conflict in conflicted:
        out += [f"### {conflict['file']} (patch {patch['id']})", ""]
        for number, hunk in enumerate(conflict["hunks"], start=1):
            verdict = (conflict["verdicts"][number - 1] if number <= len(conflict["verdicts"])
                       else {"verdict": "(none)", "reason": ""})
            out += [f"Hunk {number}, line {hunk['line']}: **{verdict['verdict']}**: "
                    f"{verdict['reason']}", "", f"upstream {new}:", "", "```",
                    *hunk["ours"], "```", "", "merge base:", "", "```", *hunk["base"], "```",
                    "", "the patch:", "", "```", *hunk["theirs"], "```", ""]
        if conflict.get("resolution"):
            out += ["Resolution as committed:", "", "```diff", conflict["resolution"], "```", ""]
    out += ["## Upstream changes to the files the series touches", "",
            f"Changed between {old} and {new}; re-read these when reviewing the rebase.", ""]
    if report["upstream_changes"]:
        out += ["| file | lines added | lines removed |", "|---|---|---|"]
        out += [f"| {c['file']} | {c['added']} | {c['removed']} |"
                for c in report["upstream_changes"]]
    else:
        out.append("None.")
    out += ["", "## Verification", ""]
    out += [f"- {'ok' if c['ok'] else 'FAIL'}: {c['check']}" for c in report["verify"]]
    out += ["", "## Next", "", *[f"- `{step}`" for step in report["next"]], ""]
    return "\n".join(out)


def write(rebase: Rebase, state: RebaseState, old: Series, new: Series,
          checks: list[Check] | None = None) -> Path:
    report = collect(rebase, state, old, new, checks)
    folder = rebase.project.root / "docs" / "rebases"
    stem = f"{report['from']['version']}-to-{report['to']['version']}"
    write_atomic(folder / f"{stem}.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    markdown = folder / f"{stem}.md"
    write_atomic(markdown, render_markdown(report))
    return markdown
