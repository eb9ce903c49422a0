"""The capacity baseline: every zoo model and setting of the scenario matrix,
stock and E2, run resumably (one JSON per run under .e2/results/capacity-matrix/),
then docs/capacity-baseline.md (templates/capacity-baseline.md.j2), its plot and
the summary record docs/validation/capacity-baseline.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import platform
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2 import console, reports
from e2.errors import E2Error
from e2.options import CapacityOptions, GlobalOptions
from e2.probes.capacity import (
    DEFAULT_LENGTHS,
    SIDES,
    WORKER_FILES,
    ZOO,
    Settings,
    read_result,
    run_jobs,
    zoo_names,
)
from e2.probes.capacity_report import publish
from e2.probes.runtime import Runtime, make_runtime
from e2.series import Project, series_digest

# What E2 must reach in every run of the matrix (issue: state pool, switch and proof).
E2_MIN_RATIO = 0.98
KINDS = ("distinct", "shared_prefix")    # the two prompt kinds of every workload


def matrix_scenarios(capability: str) -> list[tuple[str, Settings]]:
    """The issue's capacity scenarios: every zoo model at 10 GiB with 256 and 1,024
    sequences, KV dtype auto and fp8, mamba cache mode none and align; and
    Qwen3.5-27B at TP 4 with 6 GiB per rank and 64 sequences (4x RTX 3090)."""
    zoo_grid = itertools.product((256, 1024), ("auto", "fp8"), ("none", "align"))
    runs = [(name, Settings(10.0, 1, seqs, 0, kv, mode, DEFAULT_LENGTHS, capability))
            for seqs, kv, mode in zoo_grid for name in zoo_names()]
    runs += [("Qwen3.5-27B", Settings(6.0, 4, 64, 0, kv, mode, DEFAULT_LENGTHS, capability))
             for kv, mode in itertools.product(("auto", "fp8"), ("none", "align"))]
    return runs


def matrix_folder(project: Project, results: Path | None, runtime: Runtime,
                  capability: str) -> Path:
    """Per-run results of one worker, series and target: a rerun resumes there."""
    assert runtime.view is not None  # the matrix compares stock with E2: there is an E2 side
    key = hashlib.sha256(b"".join(path.read_bytes() for path in WORKER_FILES)
                         + (runtime.view / "MANIFEST.json").read_bytes()
                         + capability.encode()).hexdigest()[:16]
    return (results or project.state_dir / "results") / "capacity-matrix" / key


def snapshot_view(view: Path, folder: Path) -> Path:
    """A hard-linked copy of the e2 view that lives as long as the matrix: the
    shared venv prunes old views when others build new ones."""
    copy = folder / "view"
    if not (copy / "MANIFEST.json").is_file():
        staging = folder / ".view.new"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(view, staging, copy_function=os.link)
        shutil.rmtree(copy, ignore_errors=True)
        staging.rename(copy)
    return copy


def run_matrix(runtime: Runtime, folder: Path,
               scenarios: list[tuple[str, Settings]]) -> dict[tuple[str, str, str], dict]:
    """Every scenario on both sides, one worker per model and side (two at a time);
    results already in ``folder`` are kept, failed ones rerun."""
    groups: dict[tuple[str, str], list[tuple[Settings, Path]]] = {}
    for name, settings in scenarios:
        for side in SIDES:
            out = folder / name / f"{settings.label()}-{side}.json"
            if out.is_file() and not json.loads(out.read_text())["ok"]:
                out.unlink()
            if not out.is_file():
                groups.setdefault((name, side), []).append((settings, out))
    done = len(scenarios) * len(SIDES) - sum(len(g) for g in groups.values())
    console.info(f"capacity matrix in {folder}: {done} runs done, "
                 f"{sum(len(g) for g in groups.values())} to go")
    failures = []
    with console.progress(count=True) as bar, ThreadPoolExecutor(max_workers=2) as pool:
        task = bar.add_task("capacity matrix (model x side)", total=len(groups))
        futures = {pool.submit(run_jobs, runtime, side, ZOO / name, runs): (name, side)
                   for (name, side), runs in groups.items()}
        for future, (name, side) in futures.items():
            try:
                future.result()
            except E2Error as exc:
                failures.append(f"{name} ({side}): {exc.message.splitlines()[0]}")
            bar.advance(task)
    results = {}
    for name, settings in scenarios:
        for side in SIDES:
            out = folder / name / f"{settings.label()}-{side}.json"
            if out.is_file():
                try:
                    results[name, settings.label(), side] = read_result(
                        out, ZOO / name, side, settings)
                except E2Error as exc:
                    failures.append(exc.message.splitlines()[0])
    if failures:
        raise E2Error("capacity matrix runs failed (the others are kept in "
                      f"{folder}; rerun to resume):\n  " + "\n  ".join(failures))
    return results


def summarize_run(result: dict) -> dict:
    """What the baseline shows of one run: backend, blocks, boot line, per-L figures."""
    planner, backend = result["planner"], result["backend"]
    attention = [g for g in planner["groups"] if "Attention" in g["kind"]]
    return {
        "backend": backend["name"], "kernel_block_sizes": backend["kernel_block_sizes"],
        "hybrid_block_size": backend["hybrid_block_size"],
        "attention_block_size": min(g["block_size"] for g in attention),
        "blocks_per_page": max(g.get("blocks_per_page", 1) for g in attention),
        "pool_blocks": planner["num_blocks"], "boot_tokens": planner["kv_cache_tokens"],
        "boot_concurrency": round(planner["max_concurrency"], 2),
        "max_model_len": result["inputs"]["max_model_len"],
        "rows": [{"length": row["length"], "ideal": row["ideal"],
                  **{f"{kind}_{key}": row[kind][key]
                     for kind in ("distinct", "shared_prefix")
                     for key in ("saturation", "ratio", "preemptions",
                                 "preemptions_below_ideal", "leaked_blocks")}}
                 for row in result["workload"]],
    }


def matrix_flags(runs: list[dict]) -> list[str]:
    """One line per E2 workload (model, setting, L) that falls below E2_MIN_RATIO of
    the ideal, admits more than the ideal and then preempts (admission that does
    not count what the requests will need), preempts below the ideal or more than
    stock does, or leaks blocks."""
    flags = []
    for run in runs:
        stock_rows = {row["length"]: row for row in run["stock"]["rows"]}
        for row in run["e2"]["rows"]:
            problems = []
            for kind in ("distinct", "shared_prefix"):
                found = []
                ratio = row[f"{kind}_ratio"]
                if ratio is not None and ratio < E2_MIN_RATIO:
                    found.append(f"ratio {ratio:.3f} ({row[f'{kind}_saturation']}/"
                                 f"{row['ideal']})")
                if ratio is not None and ratio > 1 and row[f"{kind}_preemptions"]:
                    found.append(f"admitted {row[f'{kind}_saturation']} of an ideal "
                                 f"{row['ideal']}, then preempted")
                if row[f"{kind}_preemptions_below_ideal"]:
                    found.append(f"{row[f'{kind}_preemptions_below_ideal']} preemptions "
                                 "below the ideal")
                stock_preemptions = stock_rows[row["length"]][f"{kind}_preemptions"]
                if row[f"{kind}_preemptions"] > stock_preemptions:
                    found.append(f"{row[f'{kind}_preemptions']} preemptions "
                                 f"(stock {stock_preemptions})")
                if row[f"{kind}_leaked_blocks"]:
                    found.append(f"{row[f'{kind}_leaked_blocks']} leaked blocks")
                if found:
                    problems.append(f"{kind.replace('_', ' ')}: {', '.join(found)}")
            if problems:
                flags.append(f"{run['model']} {run['setting']} L={row['length']}: "
                             + "; ".join(problems))
    return flags


def matrix_record(project: Project, runtime: Runtime, folder: Path,
                  scenarios: list[tuple[str, Settings]],
                  results: dict[tuple[str, str, str], dict]) -> dict:
    series = project.load()
    runs: list[dict] = []
    for name, settings in scenarios:
        runs.append({"model": name, "setting": settings.label(),
                     "settings": dataclasses.asdict(settings),
                     **{side: summarize_run(results[name, settings.label(), side])
                        for side in SIDES}})
    e2_ratios = [row["distinct_ratio"] for run in runs for row in run["e2"]["rows"]
                 if row["distinct_ratio"] is not None]
    return {
        "format": 2,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "upstream_version": series.upstream.version,
        "series_digest": series_digest(series, project.patches_dir),
        "capability": scenarios[0][1].capability,
        "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                f"{os.cpu_count()} CPUs)",
        "command": "e2 " + shlex.join(sys.argv[1:]),
        "results_folder": str(folder),
        "runs": runs,
        "e2_min_ratio": min(e2_ratios),
        "flags": matrix_flags(runs),
    }


# ---------------------------------------------------------------- the document


def _pair(stock: object, e2: object, fmt: str = "{}") -> str:
    return fmt.format(stock) if stock == e2 else f"{fmt.format(stock)} → {fmt.format(e2)}"


def _summed(side: dict, key: str) -> int:
    """A per-workload figure of one side, both prompt kinds and every L summed."""
    return sum(row[f"{kind}_{key}"] for row in side["rows"] for kind in KINDS)


def _ratio_cells(run: dict, lengths: list[int], flags: list[str]) -> list[tuple | None]:
    """Per L: (stock, E2 distinct-prompt ratio, flagged), None where a side has no row."""
    cells: list[tuple | None] = []
    for n in lengths:
        s_row = next((r for r in run["stock"]["rows"] if r["length"] == n), None)
        e_row = next((r for r in run["e2"]["rows"] if r["length"] == n), None)
        if s_row is None or e_row is None:
            cells.append(None)
            continue
        flagged = any(f.startswith(f"{run['model']} {run['setting']} L={n}:") for f in flags)
        cells.append((s_row["distinct_ratio"], e_row["distinct_ratio"], flagged))
    return cells


def _tables(record: dict, lengths: list[int]) -> list[tuple[dict, list[dict]]]:
    """One table per setting, in the order of the runs: its settings and a row per model."""
    by_setting: dict[str, list[dict]] = {}
    for run in record["runs"]:
        by_setting.setdefault(run["setting"], []).append(run)
    return [(runs[0]["settings"], [{
        "model": run["model"], "stock": run["stock"], "e2": run["e2"],
        "ratios": _ratio_cells(run, lengths, record["flags"]),
        "preemptions": tuple(_summed(run[side], "preemptions") for side in SIDES),
        "below_ideal": tuple(_summed(run[side], "preemptions_below_ideal") for side in SIDES),
        "leaked": tuple(_summed(run[side], "leaked_blocks") for side in SIDES),
    } for run in runs]) for runs in by_setting.values()]


def render_matrix(record: dict, plot_name: str) -> str:
    runs = record["runs"]
    lengths = sorted({row["length"] for run in runs for row in run["stock"]["rows"]})
    backends = sorted({(run["settings"]["kv_dtype"], run["stock"]["backend"],
                        ", ".join(map(str, run["stock"]["kernel_block_sizes"])))
                       for run in runs})
    short = sorted(f"{row['distinct_ratio']:.3f} {run['model']} {run['setting']} "
                   f"L={row['length']}" for run in runs for row in run["e2"]["rows"]
                   if row["distinct_ratio"] is not None
                   and row["distinct_ratio"] < E2_MIN_RATIO)
    return reports.render(
        "capacity-baseline.md.j2", record=record, plot_name=plot_name, pair=_pair,
        min_ratio=E2_MIN_RATIO, lengths=lengths, backends=backends, short=short,
        workloads=sum(len(run["e2"]["rows"]) for run in runs),
        early=sum(_summed(run["e2"], "preemptions_below_ideal") for run in runs),
        leaked=sum(_summed(run[side], "leaked_blocks") for run in runs for side in SIDES),
        tables=_tables(record, lengths))


def plot_matrix(record: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise E2Error("the baseline plot needs matplotlib",
                      hint=f"{sys.executable} -m pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(run["setting"] for run in record["runs"]))
    models = list(dict.fromkeys(run["model"] for run in record["runs"]))
    colors = {name: plt.get_cmap("tab10")(i) for i, name in enumerate(models)}
    columns = 3
    rows = -(-len(settings) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(15, 3.6 * rows), sharey=True,
                                squeeze=False)
    for axis, setting in zip(axes.flat, settings):
        for run in (r for r in record["runs"] if r["setting"] == setting):
            for side, style in (("stock", "--"), ("e2", "-")):
                rows_ = run[side]["rows"]
                axis.plot([r["length"] for r in rows_], [r["distinct_ratio"] for r in rows_],
                          style, marker="o", markersize=3, color=colors[run["model"]],
                          label=f"{run['model']}" if side == "e2" else None)
        axis.axhline(E2_MIN_RATIO, color="grey", linewidth=0.6)
        axis.set_xscale("log", base=2)
        axis.set_title(setting, fontsize=9)
        axis.set_xlabel("request length L (tokens)", fontsize=8)
        axis.grid(True, alpha=0.3)
    for axis in axes.flat[len(settings):]:
        axis.set_visible(False)
    axes[0][0].set_ylabel("saturation / ideal")
    axes[0][0].legend(fontsize=7, loc="lower right")
    figure.suptitle(f"KV capacity on compute capability {record['capability']}, "
                    f"vLLM {record['upstream_version']}: stock dashed, E2 solid")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Fixed metadata so an unchanged result writes the same bytes.
    figure.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(figure)


def run_baseline(options: GlobalOptions, probe: CapacityOptions) -> int:
    """The whole matrix, resumable, then docs/capacity-baseline.md and .png."""
    project = options.project
    runtime = make_runtime(options, probe.python, probe.vllm_path, probe.stock_only)
    if runtime.view is None:
        raise E2Error(f"--baseline compares stock with E2, and there is no E2 side: "
                      f"{runtime.why_no_view}")
    scenarios = matrix_scenarios(probe.capability)
    folder = matrix_folder(project, probe.results, runtime, probe.capability)
    folder.mkdir(parents=True, exist_ok=True)
    runtime = dataclasses.replace(runtime, view=snapshot_view(runtime.view, folder))
    results = run_matrix(runtime, folder, scenarios)
    record = matrix_record(project, runtime, folder, scenarios, results)
    docs = project.root / "docs"
    record["record"] = "docs/validation/capacity-baseline.json"
    publish(docs / "validation" / "capacity-baseline.json",
             json.dumps(record, indent=1) + "\n")
    plot_matrix(record, docs / "capacity-baseline.png")
    publish(docs / "capacity-baseline.md", render_matrix(record, "capacity-baseline.png"))
    console.info(f"wrote {docs / 'capacity-baseline.md'}, .png and "
                 f"{record['record']}: lowest E2 ratio {record['e2_min_ratio']:.3f}, "
                 f"{len(record['flags'])} E2 workloads flagged")
    return 0

