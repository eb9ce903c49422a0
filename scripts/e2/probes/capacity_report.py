"""The capacity probe's record: the JSON under docs/validation/, its Markdown
(templates/capacity.md.j2) and the tables printed on the console.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from rich.table import Table

from e2 import console, reports
from e2.fsio import write_atomic
from e2.options import CapacityOptions
from e2.probes.capacity import differences, leaks
from e2.probes.runtime import Runtime
from e2.series import Project, series_digest


def probe_record(project: Project, probe: CapacityOptions, runtime: Runtime,
                 per_model: dict[str, dict]) -> dict:
    """Both sides' results per model with what produced them and how E2 differs."""
    series = project.load()
    first = next(iter(per_model.values()))["stock"]
    return {
        "format": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "upstream_version": series.upstream.version,
        "vllm_version": first["vllm_version"],
        "series_digest": series_digest(series, project.patches_dir),
        "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                f"{os.cpu_count()} CPUs)",
        "device": f"none: CPU only; the planner reproduces a CUDA boot on compute "
                  f"capability {probe.capability}",
        "capability": probe.capability,
        "backend": first["backend"],
        "python": str(runtime.python), "view": str(runtime.view) if runtime.view else None,
        "why_no_view": runtime.why_no_view,
        "command": "e2 " + shlex.join(sys.argv[1:]),
        "settings": {"budget_gib": probe.budget_gib, "tp": probe.tp,
                     "max_num_seqs": probe.max_num_seqs, "kv_dtype": probe.kv_dtype,
                     "mamba_cache_mode": probe.mamba_cache_mode,
                     "capability": probe.capability, "lengths": list(probe.lengths)},
        "models": per_model,
        "differences": differences(per_model),
        "leaks": leaks(per_model),
    }


def write_record(project: Project, results: Path | None, record: dict) -> None:
    """docs/validation/capacity-<time>.json and .md (or under --results)."""
    results = results or project.root / "docs" / "validation"
    stamp = record["created"].replace(":", "").replace("-", "")[:15]
    base = results / f"capacity-{stamp}"
    record["record_md"] = str(base.with_suffix(".md").relative_to(project.root)
                              if base.is_relative_to(project.root)
                              else base.with_suffix(".md"))
    publish(base.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
    publish(base.with_suffix(".md"), record_markdown(record))
    console.info(f"recorded {base}.json and .md")


def publish(path: Path, content: str) -> None:
    write_atomic(path, content)
    path.chmod(0o644)  # records are committed; mkstemp made them owner-only


def ratio_text(run: dict) -> str:
    return "n/a" if run.get("ratio") is None else f"{run['ratio']:.3f}"


def record_markdown(record: dict) -> str:
    """The record as Markdown: settings, planner and workload per model and side, and
    the boot lines where the engine was booted."""
    boots = [(name, side, result["boot"]) for name, sides in record["models"].items()
             for side, result in sides.items() if "boot" in result]
    return reports.render("capacity.md.j2", record=record, boots=boots, ratio=ratio_text)


def print_tables(per_model: dict[str, dict]) -> None:
    planner = Table(title="planner (boot-time KV cache plan)")
    for column in ("model", "side", "block size", "pool blocks", "KV cache tokens",
                   "max concurrency"):
        planner.add_column(column, justify="left" if column in ("model", "side") else "right")
    workload = Table(title="workload (scheduler saturation vs ideal)")
    for column in ("model", "side", "L", "ideal", "distinct", "ratio", "shared prefix",
                   "ratio", "preempt", "leaked"):
        workload.add_column(column, justify="left" if column in ("model", "side") else "right")
    for name, sides in per_model.items():
        for side, result in sides.items():
            p = result["planner"]
            planner.add_row(name, side, str(p["block_size"]), f"{p['num_blocks']:,}",
                            f"{p['kv_cache_tokens']:,}", f"{p['max_concurrency']:.2f}")
            for row in result["workload"]:
                d, s = row["distinct"], row["shared_prefix"]
                workload.add_row(name, side, str(row["length"]), str(row["ideal"]),
                                 str(d["saturation"]), ratio_text(d), str(s["saturation"]),
                                 ratio_text(s), str(d["preemptions"] + s["preemptions"]),
                                 str(d["leaked_blocks"] + s["leaked_blocks"]))
    console.out.print(planner)
    console.out.print(workload)

