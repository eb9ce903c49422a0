"""e2 status: what the series pins and whether its generated files are in sync."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from e2 import console
from e2.options import GlobalOptions, StatusOptions
from e2.status import collect


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status", help="the pinned upstream, each patch and switch, and whether all is in sync")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=run, options=StatusOptions)


def run(options: GlobalOptions, status: StatusOptions) -> int:
    project = options.project
    series = project.load()
    state = collect(project, series, options.upstream.cache)
    if status.json:
        print(json.dumps(state, indent=2, sort_keys=True))
        return 0 if state["in_sync"] else 1
    up = series.upstream
    console.out.print(f"upstream  {up.project} {up.version} ({up.tag}), sdist sha256 "
                      f"{up.sdist_sha256[:12]}, "
                      + ("cached" if state["upstream_cached"] else "not fetched yet"),
                      markup=False)
    digest = series.image.digest or "unpinned"
    console.out.print(f"base      {series.image.base} ({digest}), vllm in "
                      f"{series.image.site_packages}", markup=False)
    console.out.print(f"series    {state['series_digest'] or '?'}", markup=False)
    table = Table("id", "switch", "default", "compiled", "title", box=None, pad_edge=False)
    for patch in state["patches"]:
        table.add_row(patch["id"], patch["switch"], patch["default"],
                      "yes" if patch["compiled"] else "no", patch["title"])
    console.out.print(table)
    console.out.print(f"overlay   {state['overlay_files']} files", markup=False)
    if state["in_sync"]:
        console.out.print("[green]in sync[/]")
        return 0
    for problem in state["problems"]:
        console.out.print(f"[red]out of sync:[/] {problem}")
    return 1
