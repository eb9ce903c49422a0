"""e2 test seam|upstream against the real CPU venv, and the outcome comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SEAM_TESTS_WITHOUT_GPU
from e2 import testenv
from e2.classify import classify, counts, explain
from e2.errors import E2Error
from e2.junit import parse_junit
from e2.series import Project
from e2.validate import KV_CACHE_SPACE_GIB, Sides
from validation_helpers import add_patch, cpu_env, real_project, results  # noqa: F401

ENVS = "vllm/envs.py"
SHM_TEST = "tests/test_envs.py::test_object_storage_shm_default_name"


def breaking_patch(e2) -> None:
    """The next patch: lengthens the shm name past the limit upstream's SHM_TEST pins, and adds a
    test that passes on stock too (so it proves nothing about the patch)."""
    add_patch(e2, [(ENVS, 'return "vllm_mm_" + encoded_uuid', 'return "vllm_mm_e2_" + encoded_uuid'),
                   ("tests/e2/test_proves_nothing.py", None,
                    "def test_passes_everywhere():\n    assert True\n")],
              "envs: a longer shm name", "VLLM_E2_SHM", "tests/e2/test_proves_nothing.py")


@pytest.mark.slow
def test_seam_real_series(real_project, tmp_path):
    _, out, _ = real_project("test", "seam", "--jobs", "2", "--report", str(tmp_path))
    assert "0001" in out and "0002" in out and "passed" in out
    data = results(tmp_path, "seam")
    # --jobs 2: the six runs go two at a time, so some run started before another ended
    runs = sorted((c["started"], c["started"] + c["seconds"])
                  for p in data["patches"] for c in p["checks"])
    assert len(runs) == 6 and any(b[0] < a[1] for a, b in zip(runs, runs[1:]))
    assert data["upstream_version"] == "0.31.0" and len(data["series_digest"]) == 64
    patches = {p["id"]: p for p in data["patches"]}
    assert list(patches) == ["0001", "0002"]
    for patch_id, control in (("0001", "VLLM_E2_REPORT=0"), ("0002", "VLLM_E2_STATE_POOL=0")):
        patch = patches[patch_id]
        assert patch["verdict"] == "passed"
        checks = {c["kind"]: c for c in patch["checks"]}
        assert all(c["ok"] for c in checks.values())
        for kind in ("e2", "control"):
            outcomes = list(checks[kind]["outcomes"].values())
            assert checks[kind]["returncode"] == 0
            assert (len(outcomes), outcomes.count("skipped")) == SEAM_TESTS_WITHOUT_GPU[
                patch_id][kind]
            assert set(outcomes) <= {"passed", "skipped"}
        assert control in checks["control"]["label"]
        stock = checks["stock"]["outcomes"]
        # 0001's registry and 0002's pool tests import E2's modules: collection errors;
        # 0002's align tests import on stock and fail on what they assert
        if patch_id == "0001":
            assert checks["stock"]["returncode"] == 1 and set(stock.values()) == {"error"}
        else:
            assert checks["stock"]["returncode"] == 1
            align = {t: o for t, o in stock.items() if "test_state_pool_align" in t}
            assert align and "failed" in align.values()
    markdown = (tmp_path / "seam.md").read_text()
    assert "| 0001 | VLLM_E2_REPORT |" in markdown
    assert "| 0002 | VLLM_E2_STATE_POOL |" in markdown


@pytest.mark.slow
def test_seam_fails_a_patch_whose_tests_pass_on_stock(real_project, tmp_path):
    breaking_patch(real_project)  # 0003, on top of the real series
    _, out, err = real_project("test", "seam", "--patch", "0003", "--report", str(tmp_path),
                               expect=1)
    assert "0003: expected to fail on stock vLLM, got 1 passed" in err
    (patch,) = results(tmp_path, "seam")["patches"]
    assert patch["verdict"] == "failed"
    assert [c["ok"] for c in patch["checks"]] == [True, True, False]


BLOCK_POOL = "vllm/v1/core/block_pool.py"
DEFERRED_FREE = "tests/v1/core/test_deferred_block_free.py"
# Builds a scheduler for facebook/opt-125m (from the offline model store), then checks
# the block pool gets back every block a finished request held.
FREES_ALL = f"{DEFERRED_FREE}::test_gate_disabled_without_connector"
NO_FREE = f"{DEFERRED_FREE}::test_gate_enabled_for_async_consumer"


def leaking_block_pool_patch(e2) -> None:
    """The next patch: the block pool keeps one block of every batch it frees (a changed free count)."""
    add_patch(e2, [(BLOCK_POOL, "self.free_block_queue.prepend_n(blocks_to_evict_first)",
                    "self.free_block_queue.prepend_n(blocks_to_evict_first[1:])")],
              "block pool: leak a block per free", "VLLM_E2_LEAK",
              "tests/e2/test_switch_registry.py")


@pytest.mark.slow
def test_upstream_reports_a_broken_block_pool_as_regression(real_project, tmp_path):
    leaking_block_pool_patch(real_project)
    _, out, _ = real_project("test", "upstream", "--suite", FREES_ALL, "--suite", NO_FREE,
                             "--report", str(tmp_path), expect=1)
    assert "regression" in out and "test_gate_disabled_without_connector" in out
    data = results(tmp_path, "upstream")
    assert data["runs"]["stock"]["outcomes"] == {FREES_ALL: "passed", NO_FREE: "passed"}
    assert data["regressions"] == {FREES_ALL: {"stock": "passed", "e2": "failed"}}
    verdict = data["verdicts"][FREES_ALL]
    assert verdict["class"] == "regression" and "assert" in verdict["reason"]
    # the stock rerun of the differing test confirmed it is not flaky
    assert data["runs"]["stock_again"]["outcomes"] == {FREES_ALL: "passed"}
    assert data["classes"]["regression"] == 1 and data["classes"]["flaky"] == 0
    markdown = (tmp_path / "upstream.md").read_text()
    assert "**1 regressions**" in markdown and "| regression | 1 |" in markdown


@pytest.mark.slow
def test_upstream_clean_series_has_no_regression(real_project, tmp_path):
    """--also-switches-off: E2 as shipped and E2 with every switch at 0, both against one
    stock run, all three at once with --parallel, each written as its own report."""
    real_project("test", "upstream", "--suite", FREES_ALL, "--suite", SHM_TEST,
                 "--also-switches-off", "--parallel", "--report", str(tmp_path))
    shipped, off = results(tmp_path, "upstream"), results(tmp_path, "upstream-switches-off")
    assert shipped["runs"]["stock"] == off["runs"]["stock"]
    stock, e2, e2_off = shipped["runs"]["stock"], shipped["runs"]["e2"], off["runs"]["e2"]
    assert e2 != e2_off
    # --parallel: each run started before the others ended
    for a, b in [(stock, e2), (stock, e2_off), (e2, e2_off)]:
        assert a["started"] < b["started"] + b["seconds"]
        assert b["started"] < a["started"] + a["seconds"]
    assert shipped["e2_switches"] == {}
    assert off["e2_switches"] == {"VLLM_E2_REPORT": "0", "VLLM_E2_STATE_POOL": "0"}
    for data in (shipped, off):
        assert not data["regressions"] and not data["verdicts"]
        assert "stock_again" not in data["runs"]
    assert stock["outcomes"] == e2["outcomes"] == e2_off["outcomes"] == {
        FREES_ALL: "passed", SHM_TEST: "passed"}
    assert "- E2 switches: VLLM_E2_REPORT=0, VLLM_E2_STATE_POOL=0" in (
        tmp_path / "upstream-switches-off.md").read_text()


@pytest.mark.slow
def test_upstream_test_that_flips_on_stock_is_flaky(real_project, tmp_path, monkeypatch):
    """A test that passes once and then fails: stock passes, E2 fails, stock's rerun fails."""
    monkeypatch.setenv("E2_FLIP_MARKER", str(tmp_path / "flipped"))
    add_patch(real_project, [("tests/test_e2_flips.py", None,
                              "import os, pathlib\n\n\ndef test_flips():\n"
                              "    marker = pathlib.Path(os.environ['E2_FLIP_MARKER'])\n"
                              "    first = not marker.exists()\n"
                              "    marker.touch()\n"
                              "    assert first, 'ran before'\n")],
              "tests: a test that flips", "VLLM_E2_FLIPS", "tests/e2/test_switch_registry.py")
    real_project("test", "upstream", "--suite", "tests/test_e2_flips.py",
                 "--report", str(tmp_path / "report"))
    data = results(tmp_path / "report", "upstream")
    test = "tests/test_e2_flips.py::test_flips"
    assert data["verdicts"][test] == {"class": "flaky", "reason": "stock gave passed, then failed",
                                      "stock": "passed", "e2": "failed"}
    assert not data["regressions"] and data["classes"]["flaky"] == 1


def test_classify_gives_every_non_pass_a_class():
    stock = {"a": "passed", "b": "passed", "c": "failed", "d": "failed", "e": "skipped",
             "f": "passed", "h": "error", "i": "skipped", "j": "failed", "k": "passed"}
    e2 = {"a": "passed", "b": "failed", "c": "failed", "d": "passed", "e": "error",
          "g": "passed", "h": "error", "i": "skipped", "j": "failed", "k": "failed"}
    messages = {
        "c": "ValueError: Invalid repository ID or local directory specified: 'org/model'.",
        "h": "RuntimeError: Torch not compiled with CUDA enabled",
        "i": "Skipped: Requires CUDA for the fused kernel",
        "j": "AssertionError: 3 == 4"}
    e2_messages = {"b": "AssertionError: free blocks 9 != 10\nmore", "k": "boom"}
    verdicts = {v.test: v for v in classify(stock, e2, messages, e2_messages,
                                             stock_again={"b": "passed", "k": "failed"})}
    assert set(verdicts) == set("bcdefghijk")  # only "a" passes on both
    assert (verdicts["b"].kind, verdicts["b"].reason) == (
        "regression", "AssertionError: free blocks 9 != 10")
    assert verdicts["e"].kind == "regression"  # skipped on stock, error on E2
    assert (verdicts["f"].kind, verdicts["f"].e2) == ("regression", "absent")
    assert (verdicts["k"].kind, verdicts["k"].reason) == (
        "flaky", "stock gave passed, then failed")
    assert verdicts["d"].kind == verdicts["g"].kind == "new-pass"
    assert (verdicts["c"].kind, verdicts["c"].reason) == (
        "hub-data", "no model org/model in the offline store")
    assert verdicts["h"].kind == "device-only" and "CUDA" in verdicts["h"].reason
    assert verdicts["i"].kind == "device-only" and "fused kernel" in verdicts["i"].reason
    assert (verdicts["j"].kind, verdicts["j"].reason) == ("unexplained", "AssertionError: 3 == 4")
    assert counts(list(verdicts.values())) == {
        "regression": 3, "flaky": 1, "new-pass": 2, "device-only": 2, "hub-data": 1,
        "upstream-failure": 0, "unexplained": 1}


def test_parse_junit_node_ids_and_worst_outcome(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.t" name="ok" file="tests/t.py"/>'
        '<testcase classname="tests.t" name="bad" file="tests/t.py">'
        '<failure message="AssertionError: 1 == 2">def test_bad():\n&gt;   assert 1 == 2\n'
        'E   assert 1 == 2</failure></testcase>'
        '<testcase classname="tests.t.TestGroup" name="skip[x-1]" file="tests/t.py">'
        '<skipped message="Skipped: needs CUDA"/></testcase>'
        '<testcase classname="tests.t" name="teardown" file="tests/t.py"><failure/>'
        '<error message="failed on teardown with &quot;RuntimeError: x&quot;"/></testcase>'
        '<testcase classname="" name="tests.broken"><error message="collection"/></testcase>'
        '</testsuite></testsuites>')
    outcomes, messages = parse_junit(xml)
    assert outcomes == {"tests/t.py::ok": "passed", "tests/t.py::bad": "failed",
                        "tests/t.py::TestGroup::skip[x-1]": "skipped",
                        "tests/t.py::teardown": "error", "tests.broken": "error"}
    assert messages == {"tests/t.py::bad": "AssertionError: 1 == 2\nassert 1 == 2",
                        "tests/t.py::TestGroup::skip[x-1]": "Skipped: needs CUDA",
                        "tests/t.py::teardown": 'failed on teardown with "RuntimeError: x"',
                        "tests.broken": "collection"}
    assert parse_junit(tmp_path / "missing.xml") == ({}, {})


# What pytest wrote for test_scheduler_e2e.py on the CPU: the engine's start-up failure,
# its cause only in the workers' log; the module-scoped fixture's second test has no log.
ENGINE_FAILED = ('failed on setup with &quot;RuntimeError: Engine core initialization failed. '
                 'See root cause above. Failed core proc(s): {}&quot;')
WORKER_LOG = ("(EngineCore pid=7) INFO 12-02 12:55:33 [core.py:1] starting\n"
              "(Worker pid=8) ERROR 12-02 12:55:33 [multiproc_executor.py:948]     raise "
              "ValueError(\n"
              "(Worker pid=8) ERROR 12-02 12:55:33 [multiproc_executor.py:948] ValueError: No "
              "common block size for 16 (CPU_ATTN: [MultipleOf(32)]).\n"
              "(EngineCore pid=7) ERROR 12-02 12:55:34 [core.py:1433] RuntimeError: Worker "
              "failed with error 'No common block size'\n")


def test_parse_junit_reads_a_logged_root_cause(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.e" name="first" file="tests/e.py">'
        f'<error message="{ENGINE_FAILED}">E   RuntimeError: Engine core</error>'
        f'<system-out>{WORKER_LOG}</system-out></testcase>'
        '<testcase classname="tests.e" name="second" file="tests/e.py">'
        f'<error message="{ENGINE_FAILED}">E   RuntimeError: Engine core</error></testcase>'
        '<testcase classname="tests.e" name="plain" file="tests/e.py">'
        '<failure message="AssertionError: 1 == 2">E   assert 1 == 2</failure>'
        f'<system-err>{WORKER_LOG}</system-err></testcase>'
        '</testsuite></testsuites>')
    outcomes, messages = parse_junit(xml)
    cause = "root cause: ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    for test in ("tests/e.py::first", "tests/e.py::second"):
        assert messages[test].splitlines()[1] == cause, test
        assert explain(messages[test], outcomes[test]) == (
            "device-only", "vLLM's CPU attention backend takes only block sizes that are a "
            "multiple of 32 (No common block size for 16 (CPU_ATTN: [MultipleOf(32)]))")
    # a message that points nowhere keeps to itself, whatever was logged
    assert messages["tests/e.py::plain"] == "AssertionError: 1 == 2\nassert 1 == 2"


SERVER_EXITED = 'failed on setup with &quot;RuntimeError: Server exited unexpectedly.&quot;'
SERVER_LOG = ("Launching RemoteOpenAIServer with: vllm serve Qwen/Qwen3.5-0.8B --port 1\n"
              "(APIServer pid=9) ERROR 12-02 15:06:34 [registry.py:1098] Error in loading "
              "model architecture 'Qwen3_5ForConditionalGeneration'\n"
              "(APIServer pid=9) ERROR 12-02 15:06:34 [registry.py:1098] ModuleNotFoundError: "
              "No module named 'torchvision'\n")


def test_parse_junit_reads_the_cause_of_a_server_that_exited(tmp_path):
    """RemoteOpenAIServer's one line points at the server's captured log, as the engine's does."""
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.s" name="t[base]" file="tests/s.py">'
        f'<error message="{SERVER_EXITED}">E   RuntimeError: Server exited unexpectedly.</error>'
        f'<system-out>{SERVER_LOG}</system-out></testcase></testsuite></testsuites>')
    outcomes, messages = parse_junit(xml)
    message = messages["tests/s.py::t[base]"]
    assert message.splitlines()[1] == "root cause: ModuleNotFoundError: No module named 'torchvision'"
    assert explain(message, outcomes["tests/s.py::t[base]"])[0] == "device-only"
    # without the log the line alone explains nothing
    assert explain(message.splitlines()[0])[0] == "unexplained"


MAMBA_WIDTHS = ("assert [4, 0, 4, 0, 8] == [4, 0, 4, 0, 12]\n  \n  At index 4 diff: 8 != 12\n"
                "assert [4, 0, 4, 0, 8] == [4, 0, 4, 0, 12]\n"
                "tests/v1/worker/test_mamba_utils.py:554: AssertionError")


def test_upstream_failure_is_named_only_for_its_cause():
    kind, reason = explain(MAMBA_WIDTHS)
    assert kind == "upstream-failure" and "VLLM_SSM_CONV_STATE_LAYOUT=DS" in reason
    # the same widths the other way round, or from another file, are not that cause
    assert explain(MAMBA_WIDTHS.replace("8] == [4, 0, 4, 0, 12", "12] == [4, 0, 4, 0, 8"))[0] \
        == "unexplained"
    assert explain(MAMBA_WIDTHS.replace("test_mamba_utils", "test_other"))[0] == "unexplained"
    verdicts = classify({"t": "failed"}, {"t": "failed"}, {"t": MAMBA_WIDTHS}, {}, {})
    assert counts(verdicts)["upstream-failure"] == 1


def test_both_sides_get_a_fixed_cpu_kv_cache_space(tmp_path):
    sides = Sides(testenv.TestEnv(tmp_path / "venv", "cpu", "0.31.0"),
                  testenv.View(tmp_path / "view", "d", 0, 0),
                  tmp_path, tmp_path / "hub", tmp_path / "logs", 60)
    stock, e2 = sides.environment("stock", None), sides.environment("e2", None)
    assert stock["VLLM_CPU_KVCACHE_SPACE"] == e2["VLLM_CPU_KVCACHE_SPACE"] == KV_CACHE_SPACE_GIB
    assert int(KV_CACHE_SPACE_GIB) >= 1  # 0 GiB would leave an engine no KV cache
    assert Path(stock["HF_HUB_CACHE"]) == tmp_path / "hub"


def test_one_run_at_a_time_writes_a_checkouts_logs(tmp_path):
    """A second seam or upstream run in the same checkout is refused, not interleaved."""
    project = Project(tmp_path)
    with project.test_logs("upstream") as logs:
        assert logs == tmp_path / ".e2" / "logs" / "upstream"
        with pytest.raises(E2Error, match="another `e2 test upstream` is running"), \
                project.test_logs("upstream"):
            pass
        with project.test_logs("seam"):  # the other kind has its own files
            pass
    with project.test_logs("upstream"):  # released when the first run ends
        pass
