"""e2 test seam|upstream against the real CPU venv, and the outcome comparison."""

from __future__ import annotations

import pytest

from e2.validate import compare, parse_junit
from validation_helpers import add_patch, cpu_env, real_project, results  # noqa: F401

ENVS = "vllm/envs.py"
SHM_TEST = "tests/test_envs.py::test_object_storage_shm_default_name"


def breaking_patch(e2) -> None:
    """0002: lengthens the shm name past the limit upstream's SHM_TEST pins, and adds a
    test that passes on stock too (so it proves nothing about the patch)."""
    add_patch(e2, [(ENVS, 'return "vllm_mm_" + encoded_uuid', 'return "vllm_mm_e2_" + encoded_uuid'),
                   ("tests/e2/test_proves_nothing.py", None,
                    "def test_passes_everywhere():\n    assert True\n")],
              "envs: a longer shm name", "VLLM_E2_SHM", "tests/e2/test_proves_nothing.py")


@pytest.mark.slow
def test_seam_real_series(real_project, tmp_path):
    _, out, _ = real_project("test", "seam", "--report", str(tmp_path))
    assert "0001" in out and "passed" in out
    data = results(tmp_path, "seam")
    assert data["upstream_version"] == "0.31.0" and len(data["series_digest"]) == 64
    (patch,) = data["patches"]
    assert patch["verdict"] == "passed"
    checks = {c["kind"]: c for c in patch["checks"]}
    assert all(c["ok"] for c in checks.values())
    for kind in ("e2", "control"):
        assert checks[kind]["returncode"] == 0
        assert set(checks[kind]["outcomes"].values()) == {"passed"}
        assert len(checks[kind]["outcomes"]) == 32
    assert "VLLM_E2_REPORT=0" in checks["control"]["label"]
    assert checks["stock"]["returncode"] == 2  # vllm.e2 does not exist: collection error
    assert set(checks["stock"]["outcomes"].values()) == {"error"}
    assert "| 0001 | VLLM_E2_REPORT |" in (tmp_path / "seam.md").read_text()


@pytest.mark.slow
def test_seam_fails_a_patch_whose_tests_pass_on_stock(real_project, tmp_path):
    breaking_patch(real_project)
    _, out, err = real_project("test", "seam", "--patch", "0002", "--report", str(tmp_path),
                               expect=1)
    assert "0002: expected to fail on stock vLLM, got 1 passed" in err
    (patch,) = results(tmp_path, "seam")["patches"]
    assert patch["verdict"] == "failed"
    assert [c["ok"] for c in patch["checks"]] == [True, True, False]


@pytest.mark.slow
def test_upstream_reports_regression(real_project, tmp_path):
    breaking_patch(real_project)
    suites = [SHM_TEST, "tests/test_envs.py::test_is_envs_cache_enabled"]
    _, out, _ = real_project("test", "upstream", *[a for s in suites for a in ("--suite", s)],
                             "--report", str(tmp_path), expect=1)
    assert "regression" in out and "test_object_storage_shm_default_name" in out
    data = results(tmp_path, "upstream")
    (regression,) = data["regressions"].values()
    assert regression == {"stock": "passed", "e2": "failed"}
    assert data["unchanged"] == 1 and not data["new_passes"] and not data["failing_on_both"]
    assert "**1 regressions**" in (tmp_path / "upstream.md").read_text()


@pytest.mark.slow
def test_upstream_clean_series_has_no_regression(real_project, tmp_path):
    real_project("test", "upstream", "--suite", SHM_TEST, "--report", str(tmp_path))
    data = results(tmp_path, "upstream")
    assert not data["regressions"] and data["unchanged"] == 1
    assert data["runs"]["stock"]["outcomes"] == data["runs"]["e2"]["outcomes"]


def test_compare_classifies_outcomes():
    stock = {"a": "passed", "b": "passed", "c": "failed", "d": "failed", "e": "skipped",
             "f": "passed"}
    e2 = {"a": "passed", "b": "failed", "c": "failed", "d": "passed", "e": "error",
          "g": "passed"}
    result = compare(stock, e2)
    assert result.regressions == {"b": ("passed", "failed"), "e": ("skipped", "error"),
                                  "f": ("passed", "absent")}
    assert result.new_passes == {"d": ("failed", "passed"), "g": ("absent", "passed")}
    assert result.both_fail == ["c"] and result.same == 1


def test_parse_junit_worst_outcome_wins(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.t" name="ok"/>'
        '<testcase classname="tests.t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.t" name="skip"><skipped message="s"/></testcase>'
        '<testcase classname="tests.t" name="teardown"><failure/><error/></testcase>'
        '<testcase classname="" name="tests.broken"><error message="collection"/></testcase>'
        '</testsuite></testsuites>')
    assert parse_junit(xml) == {"tests.t::ok": "passed", "tests.t::bad": "failed",
                                "tests.t::skip": "skipped", "tests.t::teardown": "error",
                                "tests.broken": "error"}
    assert parse_junit(tmp_path / "missing.xml") == {}
