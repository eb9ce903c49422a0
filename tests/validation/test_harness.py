"""The CPU harness plugin: accelerator calls in fixtures are safe, in a test body they fail."""

from __future__ import annotations

import subprocess

import pytest

from e2.validate import HARNESS, HARNESS_PLUGIN
from validation_helpers import cpu_env  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

TESTS = '''
import pytest, torch

@pytest.fixture
def cleanup():
    yield
    torch.accelerator.empty_cache()  # what upstream's cleanup_fixture reaches

def test_teardown_touches_accelerator(cleanup):
    assert 1 + 1 == 2

def test_body_touches_accelerator():
    torch.accelerator.empty_cache()
'''


def run(cpu_env, tmp_path, *plugin: str) -> str:
    (tmp_path / "test_accel.py").write_text(TESTS)
    env = {**cpu_env.run_env(None), "PYTHONPATH": str(HARNESS)}
    result = subprocess.run([str(cpu_env.python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-rA", *plugin, "test_accel.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    return result.stdout


def test_harness_makes_teardown_safe_and_keeps_body_failures(cpu_env, tmp_path):
    without = run(cpu_env, tmp_path)
    assert "ERROR test_accel.py::test_teardown_touches_accelerator" in without
    assert "FAILED test_accel.py::test_body_touches_accelerator" in without
    assert "Cannot access accelerator device when none is available" in without

    with_harness = run(cpu_env, tmp_path, "-p", HARNESS_PLUGIN)
    assert "PASSED test_accel.py::test_teardown_touches_accelerator" in with_harness
    assert "FAILED test_accel.py::test_body_touches_accelerator" in with_harness
    assert "1 failed, 1 passed" in with_harness
