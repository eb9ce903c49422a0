"""e2 apply: the pinned upstream with the series on top, one commit per patch."""

from __future__ import annotations

import argparse
from pathlib import Path

from e2 import console
from e2.apply import apply_series
from e2.options import ApplyOptions, GlobalOptions


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "apply", help="check out the pinned upstream and apply the series, one commit per patch",
        description="Check out the pinned upstream release into a worktree (default .e2/work) "
                    "and apply each patch with git am --3way, one commit per patch. Reports "
                    "patches that only apply with an offset or a 3-way merge.")
    parser.add_argument("--through", metavar="ID", help="stop after this patch id")
    parser.add_argument("--out", type=Path, metavar="DIR", help="worktree directory")
    parser.add_argument("--exact", action="store_true",
                        help="refuse patches that need an offset or a 3-way merge")
    parser.add_argument("--force", action="store_true", help="replace an existing worktree")
    parser.set_defaults(run=run, options=ApplyOptions)


def run(options: GlobalOptions, apply: ApplyOptions) -> int:
    project = options.project
    series = project.load()
    dest = (apply.out or project.default_worktree).absolute()
    with project.changing():
        tree = apply_series(project, series, dest, options.upstream, through=apply.through,
                            exact=apply.exact, replace=apply.force)
    for result in tree.results:
        style = {"clean": "green", "offset": "yellow", "merged": "yellow"}[result.status]
        console.out.print(f"[{style}]{result.status:6}[/] {result.patch.id} {result.patch.title}")
        for note in result.notes:
            console.out.print(f"         {note}", markup=False)
    console.out.print(f"worktree {dest} (branch e2 on {tree.base_tag}, "
                      f"{len(tree.results)} patches)", markup=False)
    return 0
