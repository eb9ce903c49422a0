"""e2 test seam|upstream|kit: the series' seam tests, upstream's suites stock vs E2
(the runs, their classes and reports are e2.validate's), and the seam tests packed
to run offline elsewhere (e2.seam_kit)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from e2.options import GlobalOptions, KitOptions, SeamOptions, UpstreamSuitesOptions
from e2.seam_kit import build_kit
from e2.testenv import TARGETS
from e2.validate import (
    CI_SUITES,
    DEFAULT_SUITES,
    SEAM_TIMEOUT,
    UPSTREAM_TIMEOUT,
    run_seam,
    run_upstream,
)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test", help="run the series' seam tests or upstream's suites, stock vs E2, on CPU; "
                     "pack the seam tests for a GPU machine",
        description="Run tests in the venv of e2 env (made or reused as needed), from the "
                    "series applied exactly into a scratch checkout.")
    parser.set_defaults(run=run)
    verbs = parser.add_subparsers(dest="test_command", metavar="KIND", required=True)
    seam = verbs.add_parser(
        "seam", help="each patch's tests: pass on E2, pass with its switch flipped, fail on stock")
    seam.add_argument("--patch", action="append", metavar="ID",
                      help="only this patch (repeatable; default: all)")
    seam.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, metavar="N",
                      help="pytest runs at once (default: the number of CPUs)")
    seam.set_defaults(options=SeamOptions, timeout=SEAM_TIMEOUT)
    suites = verbs.add_parser(
        "upstream", help="upstream's own suites on stock and on E2; exit 1 on any regression")
    suites.add_argument("--suite", action="append", metavar="PATH",
                        help="test path or node id in the patched tree (repeatable; default: "
                             + ", ".join(DEFAULT_SUITES) + ")")
    suites.add_argument("--ci", action="store_true",
                        help="only the suites CI runs: " + ", ".join(CI_SUITES))
    suites.add_argument("--parallel", action="store_true",
                        help="run the stock and E2 sides at once (for suites that share no "
                             "ports or files between processes; CI's do)")
    suites.add_argument("--also-switches-off", action="store_true",
                        help="run E2 a second time with every switch of the series at 0 "
                             "(upstream behaviour), against the same stock run; written as "
                             "upstream-switches-off.json and .md")
    suites.set_defaults(options=UpstreamSuitesOptions, timeout=UPSTREAM_TIMEOUT)
    _add_kit_parser(verbs)
    for verb in (seam, suites):
        verb.add_argument("--target", choices=tuple(TARGETS), default="cpu",
                          help="which env of e2 env to test in (default: cpu)")
        verb.add_argument("--report", type=Path, metavar="DIR",
                          help="write the JSON and Markdown results here "
                               "(default .e2/results)")
        verb.add_argument("--timeout", type=int, metavar="SECONDS",
                          help="per-test timeout (pytest-timeout)")


def _add_kit_parser(verbs: argparse._SubParsersAction) -> None:
    kit = verbs.add_parser(
        "kit", help="pack the seam tests to run offline on another machine's python and "
                    "torch (a GPU machine: the CUDA cases run there)",
        description="Write DEST: the e2 view's vllm package, the tests and what they import, "
                    "and wheels for the target's python of every distribution the tests "
                    "loaded here except torch, triton and NVIDIA's libraries. On the target, "
                    "`python3 DEST/run.py` runs each patch's tests and its control with no "
                    "network.")
    kit.add_argument("dest", type=Path, metavar="DEST", help="the kit's folder (replaced whole)")
    kit.add_argument("--python-version", type=_python_version, metavar="X.Y",
                     help="the target's python (default: the test env's)")
    kit.add_argument("--present", type=Path, metavar="FILE",
                     help="distributions the target has (pip freeze, or a name a line): "
                          "not carried, which keeps the kit small")
    kit.add_argument("--image", nargs="?", const="", metavar="REF",
                     help="then run the kit in a container of this image (alone: this "
                          "series' engine image, vllm-e2:<version>-<digest12>), the kit made "
                          "for its python3 and leaving out what it has")
    kit.add_argument("--gpus", metavar="GPUS",
                     help="docker run --gpus for that container ('all', or ids); without "
                          "it the run is CPU-only")
    kit.add_argument("--report", type=Path, metavar="DIR",
                     help="that run's JUnit files, logs and summary.json go to "
                          "DIR/seam-kit (default .e2/results)")
    kit.set_defaults(options=KitOptions)


def _python_version(text: str) -> str:
    if not re.fullmatch(r"3\.\d{1,2}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a python version like 3.12")
    return text


def run(options: GlobalOptions, test: SeamOptions | UpstreamSuitesOptions | KitOptions) -> int:
    if isinstance(test, KitOptions):
        return build_kit(options, test)
    if isinstance(test, SeamOptions):
        return run_seam(options, test)
    return run_upstream(options, test)
