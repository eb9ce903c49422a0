"""The serve probe's Markdown record, byte for byte, from fixed records.

``data/serve-record.json`` is a recorded CPU run (token ids cut to 16 per
request); the expected Markdown beside it was rendered before the report
moved into a template, so any change in the text shows up here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from e2.probes.serve_compare import compare
from e2.probes.serve_report import markdown

DATA = Path(__file__).resolve().parent / "data"


def _record() -> dict:
    return json.loads((DATA / "serve-record.json").read_text())


def _failing(record: dict) -> dict:
    """A mismatch, an incomplete request, a missing overlay banner and a one-sided skip."""
    record = copy.deepcopy(record)
    e2 = record["sides"]["e2"]["modes"]
    e2["sync"]["cases"]["oversubscribed"]["requests"][3]["token_ids"][7] += 1
    e2["sync"]["cases"]["len-block"]["requests"][0]["token_ids"].pop()
    e2["sync"]["engine"]["e2_banner"] = None
    del e2["async"]["skipped"]
    e2["async"]["cases"] = {}
    return record


@pytest.mark.parametrize("name, make", [("serve-record", _record),
                                        ("serve-record-failing", lambda: _failing(_record()))])
def test_markdown_is_byte_identical_to_the_recorded_text(name, make):
    record = make()
    rows = compare(record["sides"]["stock"], record["sides"]["e2"])
    assert markdown(record, rows) == (DATA / f"{name}.md").read_text()


def test_the_failing_record_reports_its_problems():
    record = _failing(_record())
    rows = compare(record["sides"]["stock"], record["sides"]["e2"])
    text = markdown(record, rows)
    assert "**5 problems**" in text and "| FAIL |" in text
    assert "- sync oversubscribed: request 3: token ids differ from position 7" in text


def test_running_peak_from_readings_and_mean_from_step_counters():
    """The oversubscribed cases' running figures: the peak of the gauge's readings,
    and the mean as requests per engine step (tokens generated over steps taken)."""
    from e2.probes.serve_cases import RunningSamples, requests_per_step

    assert RunningSamples([0, 0, 5, 5, 4, 2, 0]).peak == 5
    assert RunningSamples([]).peak == 0
    # 32 requests of 16 outputs: 5 at a time in 7 waves of 16 steps, the last of 2
    assert requests_per_step(32 * 16, 7 * 16) == 4.57
    assert requests_per_step(0, 0) == 0.0
