#!/usr/bin/env python3
"""Run vLLM E2's seam tests from this kit, offline, on this machine's python and torch.

    python3 run.py [--out DIR] [--allow-cpu]

Written into the kit by ``e2 test kit``; needs the standard library, torch and
pip, and reaches no network. It installs the kit's wheels that this python
lacks into a scratch folder (never into the python's own site-packages), puts
the patched vllm package first on PYTHONPATH, and runs each patch's tests
twice: every switch at its default, then the patch's switch flipped (the
control). The worker and planner tests put their tensors on CUDA wherever torch
sees a GPU; without one the run stops unless --allow-cpu says the CPU cases are
enough. JUnit files, logs and summary.json go to --out (default: results/ in
the kit). Exit 0 only if every run passed and, with a GPU, CUDA cases ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
import xml.etree.ElementTree as ElementTree
from pathlib import Path

KIT = Path(__file__).resolve().parent
TEST_TIMEOUT = 300  # seconds per test; the slowest seam test takes about 10 on a CPU


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> set[str]:
    return {normalized(d.metadata["Name"]) for d in importlib.metadata.distributions()
            if d.metadata["Name"]}


def fail(message: str) -> int:
    print(f"run.py: {message}", file=sys.stderr)
    return 2


def junit_counts(path: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "cuda_passed": 0}
    if not path.is_file():
        return counts
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("failed" if tags & {"failure", "error"} else
                   "skipped" if "skipped" in tags else "passed")
        counts[outcome] += 1
        if outcome == "passed" and "cuda" in case.get("name", ""):
            counts["cuda_passed"] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=KIT / "results",
                        help="where JUnit files, logs and summary.json go")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without a GPU (the CUDA cases are then skipped)")
    args = parser.parse_args()
    kit = json.loads((KIT / "kit.json").read_text())
    try:
        with warnings.catch_warnings():  # numpy may come with the kit's wheels, later
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        return fail(f"{sys.executable} has no torch; the kit runs on the machine's own torch")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if device is None and not args.allow_cpu:
        return fail(f"torch {torch.__version__} sees no CUDA device, so the CUDA cases would "
                    "be skipped; --allow-cpu runs the CPU cases alone")
    machine = {"python": sys.version.split()[0], "torch": torch.__version__, "device": device}
    with tempfile.TemporaryDirectory(prefix="e2-seam-kit-") as scratch:
        return run_kit(kit, Path(scratch), args.out.resolve(), machine)


def run_kit(kit: dict, scratch: Path, out: Path, machine: dict) -> int:
    with tarfile.open(KIT / kit["vllm_archive"]) as archive:
        # the kit's own archive; the "data" filter where this python has one (3.11.4+)
        if hasattr(tarfile, "data_filter"):
            archive.extractall(scratch / "vllm-site", filter="data")
        else:
            archive.extractall(scratch / "vllm-site")
    have = installed()
    missing = [wheel for wheel in kit["wheels"] if normalized(wheel["name"]) not in have]
    for wheel in missing:
        if not (KIT / "wheels" / wheel["file"]).is_file():
            return fail(f"this python lacks {wheel['name']} and the kit lacks "
                        f"wheels/{wheel['file']}: rebuild the kit (e2 test kit)")
    if missing:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-compile", "--disable-pip-version-check", "--target",
                   str(scratch / "deps"), *[str(KIT / "wheels" / w["file"]) for w in missing]]
        if subprocess.run(command).returncode != 0:
            return fail("pip could not install the kit's wheels: " + " ".join(command))
    paths = [scratch / "vllm-site", KIT / "site", KIT / "harness", scratch / "deps"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)),
           "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    out.mkdir(parents=True, exist_ok=True)
    print(f"python {machine['python']}, torch {machine['torch']}, "
          f"CUDA device: {machine['device'] or 'none'}; series {kit['series_digest'][:12]} "
          f"on vLLM {kit['upstream_version']}; {len(missing)} of the kit's "
          f"{len(kit['wheels'])} wheels installed for this run")

    runs = []
    for patch in kit["patches"]:
        for label, switches in (("e2", {}), ("control", {patch["switch"]: patch["flipped"]})):
            name = f"{patch['id']}-{label}"
            junit, log = out / f"{name}.xml", out / f"{name}.log"
            command = [sys.executable, "-P", "-m", "pytest", "--import-mode=importlib",
                       "-p", "no:cacheprovider", "-p", "e2_cpu_harness", "-q", "-rs",
                       "-o", "junit_family=xunit1", f"--junitxml={junit}",
                       f"--timeout={TEST_TIMEOUT}", *patch["tests"]]
            with log.open("w") as handle:
                code = subprocess.run(command, cwd=KIT / "tree", env={**env, **switches},
                                      stdout=handle, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL).returncode
            counts = junit_counts(junit)
            ok = code == 0 and counts["passed"] > 0
            runs.append({"patch": patch["id"], "run": label, "switches": switches,
                         "exit": code, "ok": ok, **counts, "log": str(log)})
            print(f"{name:<16} {'passed' if ok else 'FAILED':<7} {counts['passed']} passed "
                  f"({counts['cuda_passed']} on CUDA), {counts['failed']} failed, "
                  f"{counts['skipped']} skipped  (log: {log})")
    cuda_passed = sum(run["cuda_passed"] for run in runs)
    cuda = machine["device"] is not None
    ok = all(run["ok"] for run in runs) and (cuda_passed > 0 or not cuda)
    (out / "summary.json").write_text(json.dumps(
        {"series_digest": kit["series_digest"], **machine, "cuda_passed": cuda_passed,
         "ok": ok, "runs": runs}, indent=1))
    if cuda and cuda_passed == 0:
        print("run.py: torch sees a GPU but no CUDA case passed", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
