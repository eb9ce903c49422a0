"""The runs of e2 test seam|upstream (commands/test.py): the series' own tests and
upstream's suites, stock vs E2, on CPU, classified and reported.

Both run pytest from the patched tree (the series applied exactly into a
scratch checkout, so upstream's conftest files are there) with the venv of
``e2 env``: stock imports site-packages' vllm, E2 puts the e2 view first on
PYTHONPATH. ``-P`` and ``--import-mode=importlib`` keep the checkout's own
``vllm/`` off sys.path, so the tests always import the installed package.

* seam: per patch, its declared tests must pass on E2 with every switch at
  its default, must still pass with the patch's switch flipped (the control:
  the tests read the switch from the environment and must then find
  upstream's behaviour), and must fail on stock (proof they test the patch:
  files that import there fail on their assertions).
* upstream: upstream's own suites run twice; a test that passes on stock
  and fails on E2 is a regression (non-zero exit).

Results go to a results dir as JSON and Markdown, with the upstream version
and series digest they were made from.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from e2 import console, reports
from e2.apply import ScratchTree
from e2.classify import CLASSES, FAILING, Verdict, classify, counts
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.junit import PytestRun, parse_junit
from e2.models import prepare_store
from e2.options import GlobalOptions, SeamOptions, UpstreamSuitesOptions
from e2.series import Patch, Project, Series, series_digest
from e2.testenv import TestEnv, View, prepare

# Upstream's suites over what the series changes: all of tests/v1/core and
# tests/v1/worker, test_envs.py (envs.py serves the E2 switches) and the
# engine files that run on the CPU. Their hub models come from the offline store
# (e2 models); what still cannot pass on a CPU is classified, not left out.
DEFAULT_SUITES = (
    "tests/test_envs.py",
    "tests/v1/core",
    "tests/v1/worker",
    "tests/v1/engine/test_iteration_logging.py",
    "tests/v1/engine/test_logprobs_processor.py",
    "tests/v1/engine/test_parallel_sampling.py",
)
# What CI runs of them (`--ci`): the files closest to the KV pool (sizing, block
# frees, per-type managers), the mamba `align` split and checkpoints the series
# hooks (upstream's tests call the split on a stub scheduler), and the switch
# registry, sized to keep `.ci/run` in its time budget; `make validate` runs
# DEFAULT_SUITES in full.
CI_SUITES = (
    "tests/test_envs.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
)
SEAM_TIMEOUT = 120
UPSTREAM_TIMEOUT = 300
# pytest exit codes: 1 tests failed, 2 interrupted (collection errors included)
PYTEST_FAILED = (1, 2)


# ---------------------------------------------------------------- running pytest


# The CPU harness: a pytest plugin both sides load (harness/e2_cpu_harness.py).
HARNESS = Path(__file__).resolve().parent / "harness"
HARNESS_PLUGIN = "e2_cpu_harness"
# VLLM_CPU_KVCACHE_SPACE for both sides: upstream's CPU smoke tests use 1 ("avoid OOM")
KV_CACHE_SPACE_GIB = "1"
# One pytest run: (side, targets, label, switches to set on top of the side's env).
Job = tuple[str, list[str], str, dict[str, str] | None]


@dataclass(frozen=True)
class Sides:
    """How pytest runs upstream's tests on stock and on E2 from one venv.

    Both sides get the same model store (``HF_HUB_CACHE``, offline) and the
    same CPU harness plugin; only E2 puts the e2 view first on PYTHONPATH.
    """

    env: TestEnv
    view: View
    tree: Path
    hub_cache: Path
    logs: Path
    timeout: int

    def environment(self, side: str, switches: dict[str, str] | None) -> dict[str, str]:
        env = self.env.run_env(self.view.path if side == "e2" else None)
        paths = [str(self.view.path)] if side == "e2" else []
        alias = self.env.dist_alias()
        paths += [str(HARNESS), *([str(alias)] if alias else [])]
        env["PYTHONPATH"] = os.pathsep.join(paths)  # the view stays first
        env["HF_HUB_CACHE"] = str(self.hub_cache)
        # vllm-cpu reserves gpu_memory_utilization (0.92 unless a test says) of the
        # machine's RAM for an engine and refuses to start when that much is not free,
        # which on a shared machine running both sides it never is; a fixed KV cache
        # space in GiB, as upstream's CPU CI sets, starts it. Other platforms ignore it.
        env["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_SPACE_GIB
        # -P for every python the tests start too (vLLM inspects models in a subprocess):
        # the patched checkout's vllm/ in the cwd must never shadow the side's package
        env["PYTHONSAFEPATH"] = "1"
        return {**env, **(switches or {})}

    def run(self, side: str, targets: list[str], label: str,
            switches: dict[str, str] | None = None) -> PytestRun:
        with console.status(f"pytest: {label}"):
            return self._run(side, targets, label, switches)

    def run_many(self, jobs: list[Job], what: str, workers: int | None = None) -> list[PytestRun]:
        """Runs at once (at most ``workers``), one pytest process each, results in the
        jobs' order: a run is mostly vLLM's import and upstream's single-threaded per-test
        teardown, so two cores take two runs in about the time of one."""
        pool_size = min(workers or len(jobs), len(jobs))
        with console.status(f"pytest: {what}"), ThreadPoolExecutor(pool_size) as pool:
            return [future.result() for future in [pool.submit(self._run, *job)
                                                   for job in jobs]]

    def _run(self, side: str, targets: list[str], label: str,
             switches: dict[str, str] | None) -> PytestRun:
        self.logs.mkdir(parents=True, exist_ok=True)
        slug = label.replace(" ", "-").replace("=", "-")
        junit, log = self.logs / f"{slug}.xml", self.logs / f"{slug}.log"
        junit.unlink(missing_ok=True)
        command = [str(self.env.python), "-P", "-m", "pytest", "--import-mode=importlib",
                   "-p", "no:cacheprovider", "-p", HARNESS_PLUGIN, "-q",
                   "-o", "junit_family=xunit1", f"--junitxml={junit}",
                   # each test's captured output, where a root cause logged by vLLM's
                   # engine processes is (junit.root_cause). Not junit_log_passing_tests
                   # =false: pytest then drops the output of a failed setup too
                   "-o", "junit_logging=out-err",
                   # a file that cannot import on a side is an error there, and the
                   # other files still run: a seam test that imports on stock vLLM
                   # must fail on what it asserts, not only on an import
                   "--continue-on-collection-errors",
                   f"--timeout={self.timeout}", *targets]
        started, wall = time.monotonic(), time.time()
        with log.open("w") as handle:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            code = subprocess.run(command, cwd=self.tree, env=self.environment(side, switches),
                                  stdout=handle, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL).returncode
        outcomes, messages = parse_junit(junit)
        result = PytestRun(label, code, round(wall, 1), round(time.monotonic() - started, 1),
                           outcomes, messages, str(log))
        console.info(f"{label}: {result.summary()} in {result.seconds:.0f}s (exit {code})")
        return result


def prepare_sides(options: GlobalOptions, target: str, timeout: int, series: Series,
                  tree: Path, logs: Path) -> Sides:
    project = options.project
    env, view = prepare(project, series, options.cache, target, overlay=True)
    assert view is not None
    hub_cache = prepare_store(series, options.cache, env.python)
    return Sides(env, view, tree, hub_cache, logs, timeout)


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


def seam_jobs(patch: Patch) -> list[Job]:
    """The patch's three runs: E2 as shipped, the control (its switch flipped), stock."""
    name, control = patch.switch.name, flipped(patch)
    return [("e2", patch.tests, f"{patch.id} e2", None),
            ("e2", patch.tests, f"{patch.id} e2 {name}={control}", {name: control}),
            ("stock", patch.tests, f"{patch.id} stock", None)]


def seam_patch(patch: Patch, runs: list[PytestRun]) -> SeamPatch:
    """The verdicts on the runs of seam_jobs(patch), in that order."""
    e2_run, control_run, stock_run = runs
    result = SeamPatch(patch.id, patch.title, patch.switch.name, list(patch.tests))

    def passes(run: PytestRun) -> bool:
        return run.returncode == 0 and run.count("passed") > 0

    result.checks.append(SeamCheck("e2", "pass with every switch at its default",
                                   passes(e2_run), e2_run))
    result.checks.append(SeamCheck("control", f"pass with {patch.switch.name}={flipped(patch)}",
                                   passes(control_run), control_run))
    stock_fails = stock_run.returncode in PYTEST_FAILED and stock_run.count(*FAILING) > 0
    result.checks.append(SeamCheck("stock", "fail on stock vLLM", stock_fails, stock_run))
    return result


def seam_markdown(header: dict, patches: list[SeamPatch]) -> str:
    return reports.render("seam.md.j2", header=header, patches=patches)


def run_seam(options: GlobalOptions, request: SeamOptions) -> int:
    project = options.project
    series = project.load()
    patches = [series.by_id(i) for i in request.patch] if request.patch else list(series.patches)
    if not patches:
        raise E2Error("series.yaml has no patches to test")
    started, digest = time.monotonic(), series_digest(series, project.patches_dir)
    with project.test_logs("seam") as logs, ScratchTree(
            project, series, options.upstream, sparse=False, prefix="validate-") as applied:
        sides = prepare_sides(options, request.target, request.timeout, series, applied.path, logs)
        # every run is its own pytest process over the same tree, so they can overlap
        runs = sides.run_many([job for patch in patches for job in seam_jobs(patch)],
                              "seam tests", workers=request.jobs)
        results = [seam_patch(patch, runs[3 * i:3 * i + 3]) for i, patch in enumerate(patches)]
    header = _header(digest, series, sides.env, time.monotonic() - started)
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
    _write_results(request.report or project.state_dir / "results", "seam", data,
                   seam_markdown(header, results))
    return 0 if all(p.ok for p in results) else 1


# ---------------------------------------------------------------- upstream


RERUN_LIMIT = 500   # more tests than this differing is a broken side, not flakiness


def rerun_targets(stock: PytestRun, e2: PytestRun) -> list[str]:
    """Tests whose outcome differs between the sides, as node ids pytest can rerun."""
    differ = [t for t in sorted(stock.outcomes.keys() | e2.outcomes.keys())
              if stock.outcomes.get(t) != e2.outcomes.get(t)]
    return [t for t in differ if ".py::" in t]


def per_file(run: PytestRun) -> dict[str, dict[str, int]]:
    files: dict[str, dict[str, int]] = {}
    for test, outcome in run.outcomes.items():
        counts = files.setdefault(test.split("::", 1)[0], {})
        counts[outcome] = counts.get(outcome, 0) + 1
    return dict(sorted(files.items()))


def verdict_groups(verdicts: list[Verdict]) -> list[tuple[str, list[tuple[str, list[Verdict]]]]]:
    """Per class that has tests (in CLASSES' order), its verdicts by reason, the
    commonest reason first."""
    classes = []
    for kind in CLASSES:
        reasons: dict[str, list[Verdict]] = {}
        for verdict in verdicts:
            if verdict.kind == kind:
                reasons.setdefault(verdict.reason, []).append(verdict)
        if reasons:
            classes.append((kind, sorted(reasons.items(), key=lambda item: -len(item[1]))))
    return classes


def upstream_markdown(header: dict, suites: list[str], runs: dict[str, PytestRun],
                      verdicts: list[Verdict], switches: dict[str, str]) -> str:
    stock_files, e2_files = per_file(runs["stock"]), per_file(runs["e2"])
    files = [(name, stock_files.get(name, {}), e2_files.get(name, {}))
             for name in sorted(stock_files.keys() | e2_files.keys())]
    return reports.render("upstream.md.j2", header=header, suites=suites, runs=runs,
                          switches=switches, harness=HARNESS_PLUGIN, tally=counts(verdicts),
                          files=files, classes=verdict_groups(verdicts))


def e2_variants(series: Series, also_switches_off: bool) -> dict[str, dict[str, str]]:
    """Report name -> the E2 side's switches: as shipped (their defaults) and, with
    --also-switches-off, every switch at "0" (upstream behaviour) against the same stock."""
    variants: dict[str, dict[str, str]] = {"upstream": {}}
    if also_switches_off:
        variants["upstream-switches-off"] = {p.switch.name: "0" for p in series.patches}
    return variants


def run_upstream(options: GlobalOptions, request: UpstreamSuitesOptions) -> int:
    project = options.project
    series = project.load()
    suites = list(request.suite or (CI_SUITES if request.ci else DEFAULT_SUITES))
    variants = e2_variants(series, request.also_switches_off)
    started, digest = time.monotonic(), series_digest(series, project.patches_dir)
    with project.test_logs("upstream") as logs, ScratchTree(
            project, series, options.upstream, sparse=False, prefix="validate-") as applied:
        tree = applied.path
        missing = [s for s in suites if not (tree / s.split("::", 1)[0]).exists()]
        if missing:
            raise E2Error("no such suite in the patched tree: " + ", ".join(missing))
        sides = prepare_sides(options, request.target, request.timeout, series, tree, logs)
        jobs: list[Job] = [("stock", suites, "upstream stock", None)]
        jobs += [("e2", suites, name.replace("upstream", "upstream e2"), switches)
                 for name, switches in variants.items()]
        stock, *e2_runs = (sides.run_many(jobs, "upstream stock and e2") if request.parallel
                           else [sides.run(*job) for job in jobs])
        if not stock.outcomes:
            raise E2Error(f"the stock run reported no tests (exit {stock.returncode})",
                          hint=f"see {stock.log}")
        again = sorted({test for run in e2_runs for test in rerun_targets(stock, run)})
        stock_again = None
        if len(again) > RERUN_LIMIT:
            console.warn(f"{len(again)} tests differ between the sides; not rerunning stock "
                         "to look for flaky ones")
        elif again:
            stock_again = sides.run("stock", again, "upstream stock again")
    header = _header(digest, series, sides.env, time.monotonic() - started)
    regressions = 0
    for (name, switches), e2 in zip(variants.items(), e2_runs):
        runs = {"stock": stock, "e2": e2, **({"stock again": stock_again} if stock_again else {})}
        regressions += report_upstream(request.report, project, name, header, suites, runs, switches,
                                       str(sides.hub_cache))
    return 1 if regressions else 0


def report_upstream(report: Path | None, project: Project, name: str, header: dict,
                    suites: list[str], runs: dict[str, PytestRun], switches: dict[str, str],
                    hub_cache: str) -> int:
    """Classify E2's run against stock's, print and write it as ``name``; the regressions."""
    stock, e2 = runs["stock"], runs["e2"]
    verdicts = classify(stock.outcomes, e2.outcomes, stock.messages, e2.messages,
                        runs["stock again"].outcomes if "stock again" in runs else {})
    tally = counts(verdicts)
    state = ", ".join(f"{k}={v}" for k, v in switches.items()) or "switches at their defaults"
    console.out.print(f"stock: {stock.summary()}; E2 ({state}): {e2.summary()}", markup=False)
    for verdict in verdicts:
        if verdict.kind in ("regression", "flaky", "new-pass", "unexplained"):
            style = {"regression": "red", "new-pass": "green"}.get(verdict.kind, "yellow")
            console.out.print(f"[{style}]{verdict.kind}[/] {verdict.test}: {verdict.stock} → "
                              f"{verdict.e2} ({verdict.reason})", highlight=False)
    console.out.print(", ".join(f"{n} {k}" for k, n in tally.items()), markup=False)
    data = {**header, "suites": suites, "e2_switches": switches,
            "harness": HARNESS_PLUGIN, "hub_cache": hub_cache,
            "runs": {label.replace(" ", "_"): asdict(run) for label, run in runs.items()},
            "per_file": {"stock": per_file(stock), "e2": per_file(e2)},
            "classes": tally,
            "verdicts": {v.test: {"class": v.kind, "reason": v.reason, "stock": v.stock,
                                  "e2": v.e2} for v in verdicts},
            "regressions": {v.test: {"stock": v.stock, "e2": v.e2} for v in verdicts
                            if v.kind == "regression"}}
    _write_results(report or project.state_dir / "results", name, data,
                   upstream_markdown(header, suites, runs, verdicts, switches))
    return tally["regression"]


# ---------------------------------------------------------------- results


def _header(digest: str, series: Series, env: TestEnv, seconds: float) -> dict:
    """What a report says ran; ``digest`` is taken when the run applies the series, so
    a patch exported while it runs does not relabel it."""
    recorded = env.recorded() or {}
    return {"format": 1, "upstream_version": series.upstream.version,
            "upstream_tag": series.upstream.tag,
            "series_digest": digest,
            "target": env.target, "installed": recorded.get("installed", {}),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1)}


def _write_results(directory: Path, name: str, data: dict, markdown: str) -> None:
    write_atomic(directory / f"{name}.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    write_atomic(directory / f"{name}.md", markdown)
    console.info(f"results: {directory / name}.json, {directory / name}.md")
