"""e2 overlay: regenerate overlay/ from the series applied exactly."""

from __future__ import annotations

import argparse

from e2 import console
from e2.apply import ScratchTree
from e2.faults import checkpoint
from e2.fsio import recover_dir, refuse_link
from e2.options import GlobalOptions, OverlayOptions
from e2.overlay import overlay_drift, plan_overlay, write_overlay


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "overlay", help="write overlay/: the vllm package files the series adds or changes",
        description="Apply the series exactly in a scratch tree and write overlay/ (every "
                    "changed file under vllm/, vllm/e2_series.json and MANIFEST.json). "
                    "The old overlay stays intact until the new one is complete.")
    parser.set_defaults(run=run, options=OverlayOptions)


def run(options: GlobalOptions, overlay: OverlayOptions) -> int:
    project = options.project
    series = project.load()
    with project.changing():
        refuse_link(project.overlay_dir)
        recover_dir(project.overlay_dir)
        with ScratchTree(project, series, options.upstream) as tree:
            plan = plan_overlay(series, project, tree)
        drift = overlay_drift(project, plan)
        if not drift:
            console.out.print(f"overlay/ already up to date ({len(plan.files)} files)",
                              markup=False)
            return 0
        checkpoint("overlay-planned")
        write_overlay(project, plan)
        console.out.print(f"overlay/ written: {len(plan.files)} files, {len(plan.deleted)} "
                          f"deletions, series {plan.manifest['series_digest'][:12]}",
                          markup=False)
        return 0
