"""A plain (non-editable) install of e2 has every file e2 reads at run time: the
wheel built from pyproject.toml holds every tracked file under scripts/e2, the
templates, harness, hub store and probe zoo included (pyproject's package-data)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO_ROOT

# Named here as well, so a change to how the list below is made cannot hide them.
RUN_TIME_FILES = ("e2/templates/upstream.md.j2", "e2/harness/e2_cpu_harness.py",
                  "e2/hub/ids.yaml", "e2/hub/make_tokenizer.py",
                  "e2/hub/models/facebook/opt-125m/tokenizer.yaml",
                  "e2/probes/models/Qwen3.5-0.8B/config.json",
                  "e2/probes/stubs/torchvision/__init__.py")


def tracked_e2_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "scripts/e2"], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return {path.removeprefix("scripts/") for path in listed}


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources (a build writes build/ and egg-info beside them)."""
    source = tmp_path / "source"
    (source / "scripts").mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "pyproject.toml", source)
    shutil.copytree(REPO_ROOT / "scripts" / "e2", source / "scripts" / "e2",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path)]
    if importlib.util.find_spec("wheel") is not None:
        command.append("--no-build-isolation")  # else pip fetches setuptools for the build
    result = subprocess.run([*command, str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = tmp_path.glob("vllm_e2-*.whl")
    return wheel


def test_the_wheel_holds_every_file_e2_reads(tmp_path):
    expected = tracked_e2_files()
    assert set(RUN_TIME_FILES) <= expected and len(expected) > 100
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        packaged = {name for name in wheel.namelist() if name.startswith("e2/")}
    assert expected - packaged == set(), "tracked but not in the wheel"
    assert packaged - expected == set(), "in the wheel but not tracked"
