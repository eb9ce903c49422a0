"""e2 export: a worktree's commits back into patches/ and series.yaml."""

from __future__ import annotations

import argparse
from pathlib import Path

from e2 import console
from e2.errors import E2Error
from e2.export import export_series
from e2.options import ExportOptions, GlobalOptions
from e2.rebase import rebase_in_progress


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="turn a worktree's commits into patches/ and series.yaml",
        description="Write each commit on top of the pinned tag in the worktree as "
                    "patches/NNNN-slug.patch (git format-patch --zero-commit "
                    "--no-signature, fixed abbrev) and update series.yaml. Exporting an "
                    "unchanged worktree rewrites nothing.")
    parser.add_argument("--from", dest="source", type=Path, metavar="DIR",
                        help="worktree made by e2 apply (default .e2/work)")
    parser.set_defaults(run=run, options=ExportOptions)


def run(options: GlobalOptions, export: ExportOptions) -> int:
    project = options.project
    series = project.load()
    source = (export.source or project.default_worktree).absolute()
    stopped = rebase_in_progress(project)
    if stopped:  # the rebase rewrites patches/ and series.yaml when it ends
        raise E2Error(f"not exporting: {stopped}",
                      hint="export would write patches/ and series.yaml under it; finish "
                           "or abort the rebase first")
    with project.changing():
        result = export_series(project, series, source)
    if not result.changed:
        console.out.print(f"patches/ and series.yaml already match {source}", markup=False)
        return 0
    console.out.print(f"exported {len(result.entries)} patches from {source}", markup=False)
    for line in result.dropped:
        console.out.print(f"  dropped {line} (no commit for it any more)", markup=False)
    if result.new:
        console.warn("new patches " + ", ".join(result.new) + " need metadata: fill in "
                     "switch, drop_when and tests in series.yaml, then run e2 verify")
        return 1
    return 0
