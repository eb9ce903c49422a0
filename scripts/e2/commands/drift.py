"""e2 drift: how far upstream has moved from the pin, release by release.

For every release on the package index newer than the pinned one (or those
named with --release), a rebase dry run (e2.rebase.dryrun): a report by hunk,
class, proposal and hot spot under docs/drift/ (or --report DIR), one summary
line per release printed and kept in the folder's README.md. The checkout is
not changed otherwise.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from e2 import console
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.options import DriftOptions, GlobalOptions
from e2.rebase import resolve_target
from e2.rebase.dryrun import dry_run
from e2.upstream import index_files


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "drift", help="a rebase dry run onto every newer release, reported",
        description="For every release on the package index newer than the pin: a rebase "
                    "dry run and its report (conflicting hunks classified, proposals, hot "
                    "spots), one summary line per release. Writes only the reports.")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="where the reports go (default docs/drift/)")
    parser.add_argument("--release", action="append", metavar="VERSION",
                        help="only this release (repeatable; default: every newer one)")
    parser.set_defaults(run=run, options=DriftOptions)


FINAL_RELEASE = re.compile(r"^[0-9]+(\.[0-9]+)+$")  # no pre, post or dev releases


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def newer_releases(project: str, pinned: str) -> list[str]:
    """Releases of ``project`` with an sdist on the index, newer than ``pinned``."""
    pattern = re.compile(rf"^{re.escape(project)}-(.+)\.tar\.gz$")
    found = {m.group(1) for entry in index_files(project)
             if (m := pattern.match(entry["filename"])) and FINAL_RELEASE.match(m.group(1))}
    return sorted((v for v in found if version_key(v) > version_key(pinned)), key=version_key)


def run(options: GlobalOptions, request: DriftOptions) -> int:
    series = options.project.load()
    pinned = series.upstream.version
    if not FINAL_RELEASE.match(pinned):
        raise E2Error(f"the pin {pinned} is not a final release: e2 drift compares X.Y.Z")
    releases = list(request.release or newer_releases(series.upstream.project, pinned))
    for version in releases:
        if not FINAL_RELEASE.match(version) or version_key(version) <= version_key(pinned):
            raise E2Error(f"--release {version}: not a release newer than the pinned {pinned}")
    folder = request.report or options.project.root / "docs" / "drift"
    if not releases:
        console.out.print(f"no release newer than {pinned} on the index", markup=False)
        return 0
    lines = []
    for version in releases:
        target = resolve_target(version, series.upstream, options.upstream)
        done = dry_run(options.project, series, target, options.upstream, folder)
        line = f"{version}: {done.summary}"
        console.out.print(f"{line}\n  report {done.report}", markup=False)
        lines.append(f"- [{version}]({done.report.name}): {done.summary}")
    index = folder / "README.md"
    write_atomic(index, f"# Upstream drift from vLLM {pinned}\n\nOne rebase dry run per newer "
                        "release (`e2 drift`); each report lists the conflicting hunks with "
                        "their class and proposal, and the hot spots.\n\n"
                 + "\n".join(lines) + "\n")
    return 0
