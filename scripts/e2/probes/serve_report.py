"""The serve probe's record: its header, the table printed, the JSON and the Markdown.

The Markdown comes from ``templates/serve.md.j2`` beside the driver's code.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import jinja2
from rich.markup import escape
from rich.table import Table

from e2 import console
from e2.fsio import write_atomic
from e2.probes.engines import Runner
from e2.probes.serve_compare import Row, compare
from e2.probes.serve_settings import (
    ALIGN_BATCHED_TOKENS,
    ALIGN_KV_CACHE_BYTES,
    ALIGN_MAX_MODEL_LEN,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_TOKENS,
    SEED,
    SIDES,
)
from e2.series import Project, Series, series_digest

_TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("e2", "templates"),
                                autoescape=False, trim_blocks=True, lstrip_blocks=True,
                                keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


def markdown(record: dict, rows: list[Row]) -> str:
    h = record["header"]
    engines = [{"side": side, "mode": mode, **engine, "e2_banner": engine.get("e2_banner") or "—"}
               for side in SIDES for mode, engine in _engines(record["sides"][side])]
    whats = {n: c.get("what", "") for m in record["sides"]["stock"]["modes"].values()
             for n, c in m.get("cases", {}).items()}
    views = [_row_view(row, whats.get(row.case, "")) for row in rows]
    problems = [f"{r.mode} {r.case}: {p}" for r in rows for p in r.problems]
    return _TEMPLATES.get_template("serve.md.j2").render(
        h=h, runner=json.dumps(h["runner_detail"], sort_keys=True), engines=engines,
        rows=views, problems=problems)


def _engines(side: dict) -> list[tuple[str, dict]]:
    """A side's engines by mode; E2's align reference as "align, no prefix caching";
    none for a mode skipped before its boot (gate-fp8 on the CPU)."""
    engines = []
    for mode, entry in side["modes"].items():
        if "engine" not in entry:
            continue
        engines.append((mode, entry["engine"]))
        if "no_prefix_caching" in entry:
            engines.append((f"{mode}, no prefix caching", entry["no_prefix_caching"]["engine"]))
    return engines


def _row_view(row: Row, what: str) -> dict:
    """A row's cells as the Markdown table shows them (a side without a count: 0)."""
    path = " / ".join(row.exercised.get(s, "") for s in SIDES) if row.exercised else ""
    return {"mode": row.mode, "case": row.case, "what": what, "skipped": row.skipped,
            "requests": row.requests, "matched": _matched(row), "path": path,
            "verdict": row.verdict,
            "complete": {s: row.complete.get(s, 0) for s in SIDES},
            "output_tokens": {s: row.output_tokens.get(s, 0) for s in SIDES}}


def _matched(row: Row) -> str:
    """Exact matches of all, those that parted only at a near tie, and (align
    mode) E2's exact matches with its own engine run with prefix caching off."""
    close = f" (+{row.close} at a near tie)" if row.close else ""
    reference = f"; e2 vs e2 without prefix caching {row.reference}" if row.reference else ""
    return f"{row.matched}/{row.requests}{close}{reference}"


def conclude(record: dict, report_dir: Path | None, name: str) -> int:
    """Compare the sides of a record, print the table, write the record; the exit code."""
    rows = compare(record["sides"]["stock"], record["sides"]["e2"])
    record["rows"] = [{**asdict(r), "ok": r.ok, "verdict": r.verdict} for r in rows]
    record["ok"] = all(r.ok for r in rows)
    table = Table("sched", "case", "complete s/e2", "tokens s/e2", "match", "path s/e2",
                  "verdict", title="serving parity: stock vs E2")
    for row in rows:
        if row.skipped:
            table.add_row(row.mode, "all", "", "", "", "", escape(row.skipped))
            continue
        colour = "green" if row.ok else "red"
        table.add_row(row.mode, row.case,
                      f"{row.complete.get('stock', 0)}/{row.complete.get('e2', 0)} of "
                      f"{row.requests}",
                      f"{row.output_tokens.get('stock', 0)}/{row.output_tokens.get('e2', 0)}",
                      _matched(row),
                      escape(" / ".join(row.exercised.get(s, "") for s in SIDES)),
                      f"[{colour}]{row.verdict}[/]")
    console.out.print(table)
    for side in SIDES:
        for mode, engine in _engines(record["sides"][side]):
            console.out.print(f"{side} {mode}: {engine['kv_line']} (block "
                              f"{engine['block_size']})", markup=False)
    for row in rows:
        for problem in row.problems:
            console.error(f"{row.mode} {row.case}: {problem}")
    if report_dir is not None:
        write_atomic(report_dir / f"{name}.json", record_json(record))
        write_atomic(report_dir / f"{name}.md", markdown(record, rows))
        console.info(f"records: {report_dir / name}.json, {report_dir / name}.md")
    return 0 if record["ok"] else 1


def record_json(record: dict) -> str:
    """The record as indented JSON whose innermost lists (token ids, top tokens)
    stay on one line each: indented whole, a concurrent case's top tokens took
    a line per number, 3.4 MB for the CPU run."""
    def leaf(value: object) -> bool:
        return not isinstance(value, (dict, list)) or (
            isinstance(value, list) and all(map(leaf, value)) and len(json.dumps(value)) < 80)

    def dump(value: object, depth: int) -> str:
        pad, inner = "  " * depth, "  " * (depth + 1)
        if isinstance(value, dict) and value:
            items = [f"{inner}{json.dumps(k)}: {dump(v, depth + 1)}"
                     for k, v in sorted(value.items())]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list) and value and not all(map(leaf, value)):
            return "[\n" + ",\n".join(inner + dump(v, depth + 1) for v in value) + f"\n{pad}]"
        return json.dumps(value, sort_keys=True)

    return dump(record, 0) + "\n"


def header(project: Project, series: Series, runner: Runner, model: str, device: str | None,
           modes: tuple[str, ...], seconds: float) -> dict:
    """The record's header; ``device`` None: this host's CPU."""
    detail = runner.describe()
    return {"upstream_version": series.upstream.version, "upstream_tag": series.upstream.tag,
            "series_digest": series_digest(series, project.patches_dir),
            "runner": runner.kind, "runner_detail": detail,
            "image_digests": ({s: i["digest"] or i["id"] for s, i in detail["images"].items()}
                              if "images" in detail else None),
            "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                    f"python {platform.python_version()})",
            "device": device or _cpu_name(), "model": f"{model} (tiny Qwen3-Next, seed {SEED})",
            "settings": {"max_model_len": MAX_MODEL_LEN, "max_tokens": MAX_TOKENS,
                         "kv_cache_memory_bytes": runner.kv_bytes, "max_num_seqs": MAX_NUM_SEQS,
                         "seed": SEED, "modes": list(modes),
                         "align": {"max_model_len": ALIGN_MAX_MODEL_LEN,
                                   "max_num_batched_tokens": ALIGN_BATCHED_TOKENS,
                                   "kv_cache_memory_bytes": ALIGN_KV_CACHE_BYTES}},
            "command": _command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1)}


def _command_line() -> str:
    if Path(sys.argv[0]).name == "e2":
        return "e2 " + shlex.join(sys.argv[1:])
    return shlex.join(sys.argv)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
