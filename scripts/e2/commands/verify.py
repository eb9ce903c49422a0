"""e2 verify: every check of the series, overlay/ and the Dockerfile."""

from __future__ import annotations

import argparse

from e2 import console
from e2.options import GlobalOptions, VerifyOptions
from e2.verify import verify


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check the series is whole, applies exactly and matches overlay/",
        description="Schema, ids, series.yaml vs patches/, exact apply of every patch, "
                    "switch read sites, declared tests, the pinned release's own checks "
                    "(ruff check and format at its pin, SPDX headers, forbidden imports, "
                    "config docstrings) on the files the series changes, failing on "
                    "findings stock's files lack, and overlay/ (and Dockerfile) equal "
                    "to what the series generates.")
    parser.set_defaults(run=run, options=VerifyOptions)


def run(options: GlobalOptions, _: VerifyOptions) -> int:
    project = options.project
    series = project.load()  # schema errors raise with file:line:column
    failed = 0
    for check in verify(project, series, options.upstream):
        mark = "[green]ok[/]  " if check.ok else "[red]FAIL[/]"
        console.out.print(f"{mark} {check.name}")
        for problem in check.problems:
            console.out.print("     " + problem.replace("\n", "\n     "), markup=False)
        failed += not check.ok
    if failed:
        console.error(f"{failed} check(s) failed")
        return 1
    console.out.print(f"series verified: {len(series.patches)} patches on "
                      f"{series.upstream.tag}", markup=False)
    return 0
