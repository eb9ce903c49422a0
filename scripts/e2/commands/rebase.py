"""e2 rebase: move the series onto a new upstream release, resumably (see e2.rebase)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from e2 import console
from e2.errors import E2Error
from e2.options import GlobalOptions, RebaseOptions
from e2.rebase import resolve_target
from e2.rebase.dryrun import dry_run, hot_spots
from e2.rebase.hotspots import HotSpot
from e2.rebase.report import collect, stem, summary_line, verify_entries, write
from e2.rebase.result import finish
from e2.rebase.resume import continue_rebase, skip
from e2.rebase.state import VERDICTS, Phase, RebaseState
from e2.rebase.steps import MISSING, apply_remaining, start
from e2.rebase.workspace import GUARDED, Rebase
from e2.series import Series
from e2.verify import Check, verify


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rebase", help="move the series onto a new upstream release, with a conflict report",
        description="Forward-port every patch onto another upstream release (git am --3way; "
                    "recorded whole resolutions replayed). Stops at a conflict, at a patch "
                    "upstream already has, or at a patch importing a vllm name the release "
                    "lacks, writing a report to .e2/rebase-reports; resume "
                    "with --continue, --skip or --abort. Writes docs/rebases/<from>-to-<to>.md "
                    "and .json at the end.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--onto", metavar="VERSION", help="release to move to (0.32.0 or v0.32.0)")
    action.add_argument("--continue", dest="resume", action="store_true",
                        help="go on after resolving and staging a conflict")
    action.add_argument("--skip", action="store_true", help="drop the patch the rebase stopped at")
    action.add_argument("--abort", action="store_true",
                        help="put series.yaml, patches/, overlay/ and Dockerfile back as before")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --onto: go as far as the series goes alone, write the "
                             "report, change nothing else")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="with --dry-run: the folder for the report (default "
                             ".e2/rebase-reports)")
    parser.add_argument("--accept-proposals", action="store_true",
                        help="with --continue: take the report's proposed resolutions "
                             "(marked for review)")
    parser.add_argument("--drop-obsolete", action="store_true",
                        help="drop patches that upstream already has without stopping")
    parser.add_argument("--verdict", choices=VERDICTS,
                        help="with --continue: the verdict for every conflicted hunk")
    parser.add_argument("--reason", help="with --continue or --skip: why")
    parser.add_argument("--validate", action="store_true",
                        help="run the seam tests and the upstream delta at the end")
    parser.add_argument("--validate-suite", action="append", metavar="PATH",
                        help="with --validate: the upstream suites to run (repeatable; "
                             "default: e2 test upstream's)")
    parser.set_defaults(run=run, options=RebaseOptions)


def run(options: GlobalOptions, request: RebaseOptions) -> int:
    rebase = Rebase(options.project, options.upstream)
    _check_request(request)
    if request.dry_run:
        assert request.onto is not None
        series = options.project.load()
        target = resolve_target(request.onto, series.upstream, options.upstream)
        done = dry_run(options.project, series, target, options.upstream,
                       request.report or rebase.reports)
        console.out.print(f"{target.tag}: {done.summary}\nreport {done.report}", markup=False)
        return 0
    with options.project.changing():
        return _run_locked(options, request, rebase)


def _check_request(request: RebaseOptions) -> None:
    if request.validate_suite and not request.validate:
        raise E2Error("--validate-suite needs --validate")
    if request.dry_run and request.onto is None:
        raise E2Error("--dry-run needs --onto VERSION")
    if request.report is not None and not request.dry_run:
        raise E2Error("--report needs --dry-run (a real rebase reports to .e2/rebase-reports "
                      "and docs/rebases)")
    if request.accept_proposals and not request.resume:
        raise E2Error("--accept-proposals goes with --continue")


def _run_locked(options: GlobalOptions, request: RebaseOptions, rebase: Rebase) -> int:
    if request.abort:
        if not rebase.in_progress():
            rebase.load()  # raises "no rebase in progress"
        kept = rebase.abort()
        restored = [name for name in GUARDED if name not in kept]
        console.out.print(f"rebase aborted: {', '.join(restored)} as before"
                          + (f"; kept as edited while it was stopped: {', '.join(kept)}"
                             if kept else "")
                          + f" (the last stop's report stays in {rebase.reports})",
                          markup=False)
        return 0
    if request.onto is not None:
        series = options.project.load()
        state = start(rebase, series, request.onto, request.drop_obsolete)
    else:
        state = rebase.load()
        series = rebase.backup_series()
        if request.skip:
            skip(rebase, state, request.reason)
        else:
            continue_rebase(rebase, state, request.verdict, request.reason,
                            request.accept_proposals)
    if state.phase != Phase.FINISHING and not apply_remaining(rebase, state, series):
        _print_stop(rebase, state, _stop_report(rebase, state, series))
        return 1
    with ThreadPoolExecutor(1) as pool:
        # the hot spots and the report read the rebase's worktree only: they are made
        # while the series is written and verify applies it in a scratch tree of its own
        spotted = pool.submit(hot_spots, rebase.repo(), state)
        new_series = finish(rebase, state, series)
        drafted = pool.submit(_final_report, rebase, state, series, new_series, spotted)
        checks = verify(options.project, new_series, options.upstream)
        failed = [c for c in checks if not c.ok]
        if failed:
            raise E2Error("the rebased series does not verify:\n  " + "\n  ".join(
                f"{c.name}: {p}" for c in failed for p in c.problems),
                hint="fix it in .e2/rebase/work and run e2 rebase --continue, or "
                     "e2 rebase --abort")
        if request.validate:
            checks += validation_checks(options, request)
        report = drafted.result()
    report["verify"] = verify_entries(checks)
    markdown = write(options.project.root / "docs" / "rebases", report, stem(report))
    rebase.done()
    _print_summary(state, markdown)
    return 0


def _final_report(rebase: Rebase, state: RebaseState, old: Series, new: Series,
                  spotted: Future[list[HotSpot]]) -> dict:
    """The report of the finished rebase, but for verify's checks."""
    return collect(rebase.repo(), state, old, new,
                   (rebase.backup / "patches", rebase.project.patches_dir),
                   spots=spotted.result())


def _stop_report(rebase: Rebase, state: RebaseState, series: Series) -> Path:
    """The report of this stop, in .e2/rebase-reports (kept on --abort)."""
    repo = rebase.repo()
    spots = hot_spots(repo, state)
    report = collect(repo, state, series, series,
                     (rebase.backup / "patches", rebase.backup / "patches"), spots=spots)
    current = state.current()
    report["state"] = f"stopped at {current.id} ({state.phase.value})" if current else "stopped"
    report["summary_line"] = summary_line(state, spots, finished=False)
    return write(rebase.reports, report, stem(report), stop=True)


def validation_checks(options: GlobalOptions, request: RebaseOptions) -> list[Check]:
    """The seam tests and the upstream delta, as report lines (--validate)."""
    checks = []
    suites = [arg for suite in request.validate_suite or () for arg in ("--suite", suite)]
    for verb in (["test", "seam"], ["test", "upstream", *suites]):
        command = [sys.executable, "-m", "e2.cli", "--project", str(options.project.root),
                   *global_arguments(options), *verb]
        result = subprocess.run(command, capture_output=True, text=True)
        check = Check("e2 " + " ".join(verb[:2]))
        if result.returncode != 0:
            check.problems.append((result.stdout + result.stderr).strip()[-2000:])
        checks.append(check)
    return checks


def global_arguments(options: GlobalOptions) -> list[str]:
    """The global options as given to this rebase: the e2 commands it starts
    must use the same cache, upstream source and local tree."""
    arguments = ["--cache", str(options.cache.root), "--source", options.upstream.source]
    if options.upstream.local is not None:
        arguments += ["--upstream", str(options.upstream.local)]
    return arguments


def _print_stop(rebase: Rebase, state: RebaseState, report: Path) -> None:
    current = state.current()
    assert current is not None
    if state.phase == Phase.OBSOLETE:
        console.out.print(f"{current.id} {current.title}: already in {state.target['tag']} "
                          "(applies in reverse)", markup=False)
        console.out.print("  drop it: e2 rebase --skip   keep it: e2 rebase --continue   "
                          f"give up: e2 rebase --abort\n  report {report}", markup=False)
        return
    if state.phase == Phase.MISSING_NAME:
        console.out.print(f"{current.id} {current.title}: uses what {state.target['tag']} "
                          f"lacks (worktree {rebase.work}):", markup=False)
        for note in current.notes:
            if note.startswith(MISSING):
                console.out.print(f"  {note.removeprefix(MISSING).strip()}", markup=False)
        console.out.print(f"  report {report}\n  fix the files in {rebase.work} (the changes "
                          "go into the patch's commit), then e2 rebase --continue"
                          "   (or --skip, --abort)", markup=False)
        return
    console.out.print(f"conflict in {current.id} {current.title} "
                      f"(worktree {rebase.work}):", markup=False)
    for note in current.notes:
        console.out.print(f"  {note}", markup=False)
    for conflict in current.conflicts:
        if conflict.deleted_upstream:
            successor = f"; see {conflict.replaced_by}" if conflict.replaced_by else ""
            console.out.print(f"  {conflict.file}: deleted upstream{successor}", markup=False)
            continue
        console.out.print(f"  {conflict.file}: {len(conflict.hunks)} hunk(s) at line(s) "
                          + ", ".join(f"{h.line} ({h.kind})" for h in conflict.hunks),
                          markup=False)
    console.out.print(f"  report {report}\n"
                      f"  resolve the files in {rebase.work}, git add them, then\n"
                      "  e2 rebase --continue [--verdict V --reason R] [--accept-proposals]"
                      "   (or --skip, --abort)", markup=False)


def _print_summary(state: RebaseState, report: Path) -> None:
    for patch in state.patches:
        extra = f" ({patch.reason})" if patch.reason else ""
        console.out.print(f"{patch.status:9} {patch.id} {patch.title}{extra}", markup=False)
    console.out.print(f"rebased onto {state.target['tag']}; report {report}", markup=False)
