"""The CI entry point and job definitions call what the README promises."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import copy_checkout

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make test    #" in readme and "make image   #" in readme
    ci_run = (REPO_ROOT / ".ci" / "run").read_text()
    assert ci_run.rstrip().splitlines()[-1] == "make test"
    assert os.access(REPO_ROOT / ".ci" / "run", os.X_OK)


def test_cpu_workflow_runs_the_ci_entry_point():
    job = yaml.safe_load((REPO_ROOT / "ci/workflows/cpu.yml").read_text())["jobs"]["test"]
    commands = [step.get("run", "") for step in job["steps"]]
    assert any(".ci/run" in command for command in commands)
    assert job["timeout-minutes"] <= 90


def test_gpu_workflow_runs_both_probes_on_the_self_hosted_runner():
    job = yaml.safe_load((REPO_ROOT / "ci/workflows/gpu-probes.yml").read_text())["jobs"]["probes"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert job["env"]["TP"] == "4"
    commands = " ".join(step.get("run", "") for step in job["steps"])
    assert "scripts/probe-gpu.sh" in commands
    wrapper = (REPO_ROOT / "scripts/probe-gpu.sh").read_text()
    assert "e2 probe serve --docker --gpus all" in wrapper
    assert "e2 probe capacity --zoo" in wrapper
    assert "--boot --docker --gpus all" in wrapper
    assert "e2 image build --no-fallback" in wrapper  # the GPU image, never the CPU one
    # the seam tests on CUDA tensors, in that image, once it is built
    assert wrapper.index("e2 test kit .e2/seam-kit --image --gpus all") > wrapper.index(
        "e2 image build --no-fallback")


def test_probe_gpu_without_a_host_is_a_usage_error():
    result = subprocess.run([str(REPO_ROOT / "scripts/probe-gpu.sh")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "usage: scripts/probe-gpu.sh DOCKER_HOST" in result.stderr


def test_probe_gpu_with_an_unreachable_host_fails_clearly(tmp_path, upstream_cache):
    # The script runs e2 on the checkout it sits in, which writes there (.e2/image):
    # here, a copy; its `e2` is the tests' own, on the tests' cache.
    checkout = copy_checkout(tmp_path / "checkout")
    (checkout / "scripts").mkdir()
    shutil.copy2(REPO_ROOT / "scripts/probe-gpu.sh", checkout / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "e2").write_text(f'#!/bin/sh\nexec {sys.executable} -m e2.cli '
                                f'--cache "{upstream_cache.cache.root}" "$@"\n')
    (bin_dir / "e2").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    socket = tmp_path / "nothing.sock"
    result = subprocess.run([str(checkout / "scripts/probe-gpu.sh"), f"unix://{socket}"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "docker" in result.stderr.lower() and str(socket) in result.stderr
