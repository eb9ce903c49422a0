"""What a pytest run reported: each test's outcome and, where it did not pass, why,
read from pytest's JUnit XML (``--junitxml``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

MESSAGE_CHARS = 600                     # of a failure message kept for the report
# vLLM's engine start-up failures ("Engine core initialization failed. See root cause
# above.") carry their cause only in the engine's and workers' log, which pytest captures:
# the first exception line logged there (a log line's "(Worker pid=N) ERROR ... ]" prefix
# dropped) is what the classifier needs to read. Upstream's RemoteOpenAIServer says only
# "Server exited unexpectedly." when `vllm serve` dies; the server's log, captured the
# same way, holds the cause.
ROOT_CAUSE_HINT = re.compile(r"root cause|Server exited unexpectedly")
LOGGED_EXCEPTION = re.compile(r"^(?:\(\S+ pid=\d+\) ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception)"
                              r": \S.*)$", re.MULTILINE)


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


def root_cause(message: str, captured: str) -> str | None:
    """The first exception the captured output logged, for a message that points there."""
    if not ROOT_CAUSE_HINT.search(message):
        return None
    found = LOGGED_EXCEPTION.search(captured)
    return f"root cause: {found.group(1).strip()}" if found else None


def _message(element: ElementTree.Element, captured: str = "",
             causes: dict[str, str] | None = None) -> str:
    """What the classifier reads: the message, then the traceback's ``E`` lines and its
    last ``file.py:line:`` (a skip: its reason, from the text for a module-level skip);
    where the message points at a root cause logged above, that cause comes second
    (``causes``: message -> cause found for an earlier test of the run)."""
    causes = {} if causes is None else causes
    text = (element.text or "").splitlines()
    lines = [element.get("message") or ""]
    if element.tag == "skipped":
        if lines[0] == "collection skipped":  # the text is (path, line, "Skipped: why")
            lines = [re.sub(r"^.*'Skipped: (.*)'\)$", r"\1", text[0])] if text else lines
    else:
        cause = root_cause("\n".join([lines[0], *text]), captured)
        if cause:
            causes[lines[0]] = cause
        else:  # a module-scoped fixture fails once: later tests get its error, not its log
            cause = causes.get(lines[0]) if ROOT_CAUSE_HINT.search(lines[0]) else None
        lines += [cause] if cause else []
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
    causes: dict[str, str] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        test_id = _test_id(case)
        outcome, message = "passed", ""
        # what pytest captured (the run asks for it with junit_logging)
        captured = "\n".join(child.text or "" for child in case
                             if child.tag in ("system-out", "system-err"))
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind and rank[kind] > rank[outcome]:
                outcome, message = kind, _message(child, captured, causes)
        if rank[outcome] >= rank.get(outcomes.get(test_id, "passed"), 0):
            outcomes[test_id] = outcome
            if message:
                messages[test_id] = message
    return outcomes, messages
