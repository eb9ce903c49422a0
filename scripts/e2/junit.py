"""What a pytest run reported: each test's outcome and, where it did not pass, why,
read from pytest's JUnit XML (``--junitxml``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

MESSAGE_CHARS = 600                     # of a failure message kept for the report


@dataclass
class PytestRun:
    label: str
    returncode: int
    started: float                      # epoch seconds: parallel runs overlap
    seconds: float
    outcomes: dict[str, str]            # test id -> passed | failed | error | skipped
    messages: dict[str, str]            # test id -> why it did not pass (not passed only)
    log: str

    def count(self, *kinds: str) -> int:
        return sum(1 for outcome in self.outcomes.values() if outcome in kinds)

    def summary(self) -> str:
        parts = [f"{self.count(k)} {k}" for k in ("passed", "failed", "error", "skipped")
                 if self.count(k)]
        return ", ".join(parts) or f"no tests (exit {self.returncode})"


def _test_id(case: ElementTree.Element) -> str:
    """pytest's node id (path::Class::name) from a JUnit testcase (xunit1 has the file)."""
    classname, name, path = case.get("classname", ""), case.get("name", ""), case.get("file")
    if path and path.endswith(".py"):
        module = path[:-3].replace("/", ".")
        inner = classname[len(module):].strip(".") if classname.startswith(module) else ""
        return "::".join([path, *(inner.split(".") if inner else []), name])
    return f"{classname}::{name}".lstrip(":")


def _message(element: ElementTree.Element) -> str:
    """What the classifier reads: the message, then the traceback's ``E`` lines and its
    last ``file.py:line:`` (a skip: its reason, from the text for a module-level skip)."""
    text = (element.text or "").splitlines()
    lines = [element.get("message") or ""]
    if element.tag == "skipped":
        if lines[0] == "collection skipped":  # the text is (path, line, "Skipped: why")
            lines = [re.sub(r"^.*'Skipped: (.*)'\)$", r"\1", text[0])] if text else lines
    else:
        lines += [line[1:].strip() for line in text if line.startswith("E ")]
        places = [line for line in text if re.match(r"^\S+\.py:\d+: \w+", line)]
        lines += places[-1:]
    return "\n".join(line for line in lines if line)[:MESSAGE_CHARS]


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Per-test outcome and message from pytest's JUnit XML; the worst outcome wins."""
    if not path.is_file():
        return {}, {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        test_id = _test_id(case)
        outcome, message = "passed", ""
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind and rank[kind] > rank[outcome]:
                outcome, message = kind, _message(child)
        if rank[outcome] >= rank.get(outcomes.get(test_id, "passed"), 0):
            outcomes[test_id] = outcome
            if message:
                messages[test_id] = message
    return outcomes, messages
