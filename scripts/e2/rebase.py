"""e2 rebase: move the series onto a new upstream release, resumably.

Like git's own rebase, the work happens in steps that leave their state on
disk (``.e2/rebase/state.json``, written atomically after every step) and a
worktree (``.e2/rebase/work``) where conflicts are resolved by hand:

    e2 rebase --onto 0.32.0       # stops at a conflict or an obsolete patch
    e2 rebase --continue          # after resolving and staging (git add)
    e2 rebase --skip --reason R   # drop the current patch
    e2 rebase --abort             # series.yaml, patches/, overlay/, Dockerfile as before

series.yaml, patches/, overlay/ and the Dockerfile are only written at the
end, and the originals are kept in ``.e2/rebase/backup`` until the rebase is
done, so a process killed at any point loses nothing. Recorded resolutions
live in ``.e2/rr-cache`` (git rerere), outside the rebase, so they replay on
the next attempt.

This module is the verb: its parser and the run that drives the others:
``rebase_state`` (state.json, paths, backup), ``rebase_steps`` (the step loop),
``rebase_conflicts`` (hunks and verdicts), ``rebase_resume`` (--continue,
--skip) and ``rebase_result`` (the files written at the end).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from e2 import console
from e2.apply import UpstreamOptions
from e2.errors import E2Error
from e2.rebase_result import finish
from e2.rebase_resume import continue_rebase, skip
from e2.rebase_state import VERDICTS, Rebase, RebaseState
from e2.rebase_steps import apply_remaining, start
from e2.series import RELEASE_VERSION, Project, Upstream
from e2.verify import verify

if TYPE_CHECKING:
    from e2.cli import GlobalOptions

# ---------------------------------------------------------------- target pin


def resolve_target(onto: str, current: Upstream, upstream: UpstreamOptions) -> Upstream:
    """The pin to rebase onto: the index's own sha256 of that release.

    A local tarball (--upstream) must be that release: its version is checked
    when it is imported, and its hash against the index's where the index is
    reachable; only without an index is its own hash pinned (with a warning).
    """
    from e2.upstream import find_sdist, local_version, sha256_file

    version = onto[1:] if onto.startswith("v") else onto
    if not RELEASE_VERSION.match(version):
        raise E2Error(f"--onto {onto!r} is not a release version like 0.32.0")
    local = upstream.local
    if local is not None:
        found_version = local_version(local)
        if found_version != version:
            raise E2Error(f"--upstream {local} is vLLM {found_version}, not {version}",
                          hint=f"pass the {version} sdist or tree")
    try:
        found = find_sdist(current.project, version)
    except E2Error as exc:
        if local is None or not local.is_file():
            raise
        console.warn(f"{exc.message}: pinning {local.name} by its own sha256, unchecked "
                     "against the release")
        sha = sha256_file(local)
    else:
        if not found.sha256:
            raise E2Error(f"the index lists no sha256 for {found.filename}")
        sha = found.sha256
    return Upstream(project=current.project, version=version, tag=f"v{version}",
                    sdist_sha256=sha, git=current.git.model_copy(update={"commit": None})
                    if current.git else None)


# ---------------------------------------------------------------- command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rebase", help="move the series onto a new upstream release, with a conflict report",
        description="Forward-port every patch onto another upstream release (git am --3way, "
                    "rerere on). Stops at a conflict or at a patch upstream already has; "
                    "resume with --continue, --skip or --abort. Writes "
                    "docs/rebases/<from>-to-<to>.md and .json at the end.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--onto", metavar="VERSION", help="release to move to (0.32.0 or v0.32.0)")
    action.add_argument("--continue", dest="resume", action="store_true",
                        help="go on after resolving and staging a conflict")
    action.add_argument("--skip", action="store_true", help="drop the patch the rebase stopped at")
    action.add_argument("--abort", action="store_true",
                        help="put series.yaml, patches/, overlay/ and Dockerfile back as before")
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
    parser.set_defaults(run=run)


def rebase_in_progress(project: Project) -> str | None:
    """One line for e2 status when a rebase is stopped (or was killed) half way."""
    rebase = Rebase(project, None)
    if not rebase.in_progress():
        return None
    try:
        state = rebase.load()
    except E2Error as exc:
        return f"a rebase is in progress, its state is damaged: {exc.message}"
    current = state.current()
    where = (f"stopped at {current.id} {current.title} ({current.status})" if current
             else "writing its result")
    return (f"a rebase from {state.source['tag']} onto {state.target['tag']} is in "
            f"progress, {where} (e2 rebase --continue, --skip or --abort)")


def run(options: GlobalOptions, args: argparse.Namespace) -> int:
    from e2 import rebase_report

    rebase = Rebase(options.project, options.upstream)
    with options.project.changing():
        return _run_locked(options, args, rebase, rebase_report)


def _run_locked(options: GlobalOptions, args: argparse.Namespace, rebase: Rebase,
                rebase_report: ModuleType) -> int:
    # rebase_report: the module e2.rebase_report, which run() imports late
    if args.validate_suite and not args.validate:
        raise E2Error("--validate-suite needs --validate")
    if args.abort:
        if not rebase.in_progress():
            rebase.load()  # raises "no rebase in progress"
        rebase.abort()
        console.out.print("rebase aborted: series.yaml, patches/, overlay/ and Dockerfile "
                          "are as before", markup=False)
        return 0
    if args.onto is not None:
        series = options.project.load()
        target = resolve_target(args.onto, series.upstream, options.upstream)
        state = start(rebase, series, target, args.drop_obsolete)
    else:
        state = rebase.load()
        series = rebase.backup_series()
        if args.skip:
            skip(rebase, state, args.reason)
        else:
            continue_rebase(rebase, state, args.verdict, args.reason)
    if state.phase != "finishing" and not apply_remaining(rebase, state, series):
        _print_stop(rebase, state)
        return 1
    new_series = finish(rebase, state, series)
    checks = verify(options.project, new_series, options.upstream)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise E2Error("the rebased series does not verify:\n  " + "\n  ".join(
            f"{c.name}: {p}" for c in failed for p in c.problems),
            hint="fix it in .e2/rebase/work and run e2 rebase --continue, or e2 rebase --abort")
    if args.validate:
        checks += validation_checks(options, args)
    report = rebase_report.write(rebase, state, series, new_series, checks)
    rebase.done()
    _print_summary(state, report)
    return 0


def validation_checks(options: GlobalOptions, args: argparse.Namespace) -> list:
    """The seam tests and the upstream delta, as report lines (--validate)."""
    from e2.verify import Check

    checks = []
    suites = [arg for suite in args.validate_suite or () for arg in ("--suite", suite)]
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


def _print_stop(rebase: Rebase, state: RebaseState) -> None:
    current = state.current()
    assert current is not None
    if state.phase == "obsolete":
        console.out.print(f"{current.id} {current.title}: already in {state.target['tag']} "
                          "(applies in reverse)", markup=False)
        console.out.print("  drop it: e2 rebase --skip   keep it: e2 rebase --continue   "
                          "give up: e2 rebase --abort", markup=False)
        return
    console.out.print(f"conflict in {current.id} {current.title} "
                      f"(worktree {rebase.work}):", markup=False)
    for conflict in current.conflicts:
        console.out.print(f"  {conflict.file}: {len(conflict.hunks)} hunk(s) at line(s) "
                          + ", ".join(str(h["line"]) for h in conflict.hunks), markup=False)
    console.out.print(f"  resolve the files in {rebase.work}, git add them, then\n"
                      "  e2 rebase --continue [--verdict V --reason R]   (or --skip, --abort)",
                      markup=False)


def _print_summary(state: RebaseState, report: Path) -> None:
    for patch in state.patches:
        extra = f" ({patch.reason})" if patch.reason else ""
        console.out.print(f"{patch.status:9} {patch.id} {patch.title}{extra}", markup=False)
    console.out.print(f"rebased onto {state.target['tag']}; report {report}", markup=False)
