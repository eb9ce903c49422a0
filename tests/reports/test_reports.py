"""The Markdown reports, byte for byte: each record under data/ rendered as the driver
renders it must give exactly the text kept beside it (data/<case>.md).

The records are real ones (a rebase on crafted releases, the seam and upstream
runs, a capacity probe with boot lines, four runs of the capacity baseline), cut
to a few entries; the variants change what the real ones lack (no conflicts, a
merge base in a hunk, a failing check, regressions of several classes, a
stock-only record, a matrix with nothing flagged) so that every line of every
template is in some expected text. Any change to a template's output fails here; when the change is meant,
the expected file changes with it in the same commit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from e2 import junit, validate
from e2.classify import Verdict
from e2.probes import capacity_matrix, capacity_report
from e2.rebase import report as rebase_report

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


# ---------------------------------------------------------------- rebase


def rebase_quiet() -> dict:
    """A rebase without conflicts or upstream changes, one patch replayed by rerere,
    one check failed."""
    report = _load("rebase-skip-0.31.0-to-0.32.0.json")
    for patch in report["patches"]:
        patch["conflicts"] = []
    report["patches"][0]["replayed"] = True
    report["upstream_changes"] = []
    report["verify"][0]["ok"] = False
    return report


def rebase_with_merge_base() -> dict:
    """A conflict whose hunk carries the merge base's lines (diff3 style)."""
    report = _load("rebase-skip-0.31.0-to-0.32.0.json")
    [conflict] = [c for patch in report["patches"] for c in patch["conflicts"]]
    conflict["hunks"][0]["base"] = ["    def run_engine_core(*args, **kwargs):",
                                    "        engine_core = None"]
    return report


# ---------------------------------------------------------------- validate


def _run(data: dict) -> junit.PytestRun:
    fields = junit.PytestRun.__dataclass_fields__
    return junit.PytestRun(**{key: data[key] for key in fields})


def _header(record: dict) -> dict:
    keys = ("format", "upstream_version", "upstream_tag", "series_digest", "target",
            "installed", "date", "seconds")
    return {key: record[key] for key in keys}


def seam_inputs(failing: bool = False) -> tuple[dict, list[validate.SeamPatch]]:
    record = _load("seam.json")
    patches = [validate.SeamPatch(p["id"], p["title"], p["switch"], p["tests"],
                                  [validate.SeamCheck(c["kind"], c["expect"], c["ok"], _run(c))
                                   for c in p["checks"]])
               for p in record["patches"]]
    if failing:
        patches[1].checks[2].ok = False
    return _header(record), patches


def upstream_inputs(regressions: bool = False) -> dict:
    record = _load("upstream.json")
    runs = {name: _run(record["runs"][name]) for name in ("stock", "e2")}
    verdicts = [Verdict(test, v["class"], v["reason"], v["stock"], v["e2"])
                for test, v in record["verdicts"].items()]
    switches = record["e2_switches"]
    if regressions:
        switches = {"VLLM_E2_STATE_POOL": "0", "VLLM_E2_REPORT": "0"}
        failed = [t for t in runs["e2"].outcomes if "kv_cache_utils" in t][:3]
        for test in failed:
            runs["e2"].outcomes[test] = "failed"
        runs["stock again"] = _run({**record["runs"]["stock"], "label": "upstream stock again",
                                    "outcomes": {t: "passed" for t in failed},
                                    "seconds": 21.4})
        verdicts = [
            Verdict(failed[0], "regression", "AssertionError: free blocks", "passed", "failed"),
            Verdict("tests/v1/core/test_prefix_caching.py::t1", "device-only",
                    "needs CUDA", "skipped", "skipped"),
            Verdict(failed[1], "regression", "KeyError: 'pool'", "passed", "failed"),
            Verdict(failed[2], "regression", "KeyError: 'pool'", "passed", "error"),
            Verdict("tests/test_envs.py::t3", "flaky", "outcome changed on rerun",
                    "failed", "passed"),
            Verdict("tests/v1/core/test_prefix_caching.py::t2", "device-only",
                    "needs a GPU kernel", "skipped", "skipped"),
        ]
    return {"header": _header(record), "suites": record["suites"], "runs": runs,
            "verdicts": verdicts, "switches": switches}


# ---------------------------------------------------------------- capacity


def capacity_stock_only() -> dict:
    """A record of `--stock-only`: no E2 side, no boot, nothing to compare."""
    record = _load("capacity-record.json")
    record["view"], record["why_no_view"] = None, "--stock-only"
    for sides in record["models"].values():
        del sides["e2"]
        sides["stock"].pop("boot")
    record["differences"] = []
    return record


def baseline_unflagged() -> dict:
    """The matrix on another target with every E2 run at or above the bar."""
    record = _load("capacity-baseline.json")
    record["capability"] = "9.0"
    record["flags"] = []
    record["runs"] = [run for run in record["runs"]
                      if all(row["distinct_ratio"] is None
                             or row["distinct_ratio"] >= capacity_matrix.E2_MIN_RATIO
                             for row in run["e2"]["rows"])]
    return record


# ---------------------------------------------------------------- cases


def _upstream(inputs: dict) -> str:
    return validate.upstream_markdown(inputs["header"], inputs["suites"], inputs["runs"],
                                      inputs["verdicts"], inputs["switches"])


CASES: dict[str, Callable[[], str]] = {
    "rebase-every-status": lambda: rebase_report.render_markdown(
        _load("rebase-0.31.0-to-0.33.0.json")),
    "rebase-skip": lambda: rebase_report.render_markdown(
        _load("rebase-skip-0.31.0-to-0.32.0.json")),
    "rebase-quiet": lambda: rebase_report.render_markdown(rebase_quiet()),
    "rebase-merge-base": lambda: rebase_report.render_markdown(rebase_with_merge_base()),
    "seam": lambda: validate.seam_markdown(*seam_inputs()),
    "seam-failing": lambda: validate.seam_markdown(*seam_inputs(failing=True)),
    "upstream": lambda: _upstream(upstream_inputs()),
    "upstream-regressions": lambda: _upstream(upstream_inputs(regressions=True)),
    "capacity-record": lambda: capacity_report.record_markdown(_load("capacity-record.json")),
    "capacity-stock-only": lambda: capacity_report.record_markdown(capacity_stock_only()),
    "capacity-baseline": lambda: capacity_matrix.render_matrix(
        _load("capacity-baseline.json"), "capacity-baseline.png"),
    "capacity-baseline-unflagged": lambda: capacity_matrix.render_matrix(
        baseline_unflagged(), "plot.png"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_report_matches_the_recorded_text(case):
    expected = (DATA / f"{case}.md").read_text()
    assert CASES[case]() == expected


def test_templates_ship_with_the_package():
    """The templates are package data: an installed e2 finds them beside its modules."""
    from e2 import reports

    names = set(reports.environment().list_templates())
    assert {"rebase.md.j2", "seam.md.j2", "upstream.md.j2", "capacity.md.j2",
            "capacity-baseline.md.j2"} <= names
