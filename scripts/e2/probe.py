"""e2 probe capacity: how many tokens and requests a hybrid model's KV pool holds.

The vLLM side runs in a venv of the pinned release (``probes/capacity_worker.py``
with that venv's python), once on stock vLLM and once with the e2 view first on
PYTHONPATH; this module checks the input, runs both, compares them and records
the result (JSON + Markdown) under docs/validation/. ``--baseline`` also writes
the commit-ready table and plot (docs/capacity-baseline.md, .png).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from e2 import console
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.probes.serve import add_engine_image_arguments, add_serve_arguments
from e2.series import Project, series_digest

PROBES = Path(__file__).resolve().parent / "probes"
WORKER = PROBES / "capacity_worker.py"
STUBS = PROBES / "stubs"
ZOO = PROBES / "models"
DEFAULT_LENGTHS = (128, 1024, 4096, 16384, 32768)
DEFAULT_MAX_MODEL_LEN = 32768
WORKER_TIMEOUT = 600
SIDES = ("stock", "e2")


@dataclass(frozen=True)
class Runtime:
    """The venv python that runs the worker, and the e2 view (None: stock only)."""

    python: Path
    view: Path | None
    why_no_view: str | None
    needs_stub: bool

    def env(self, side: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("VLLM_E2_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["HF_HUB_OFFLINE"] = "1"
        paths = [str(self.view)] if side == "e2" and self.view else []
        if self.needs_stub:
            paths.append(str(STUBS))  # after the view: it must never shadow vllm
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env


# ---------------------------------------------------------------- input


def resolve_model(spec: str) -> Path:
    """A folder with config.json, or the name of one in the zoo; checked here so a
    bad folder fails before a venv starts."""
    path = Path(spec)
    if not path.exists() and (ZOO / spec).is_dir():
        path = ZOO / spec
    if not path.is_dir():
        zoo = ", ".join(zoo_names())
        raise E2Error(f"{spec}: not a folder, nor a model in the zoo", hint=f"zoo: {zoo}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise E2Error(f"{path}: no config.json in the model folder",
                      hint="point --model at a folder holding the model's config.json "
                           "(weights are not needed)")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise E2Error(f"{config_file}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}")
    archs = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise E2Error(f"{config_file}: key `architectures` is missing or not a list of "
                      "class names", hint='e.g. "architectures": ["Qwen3NextForCausalLM"]')
    return path.resolve()


def zoo_names() -> list[str]:
    return sorted(p.name for p in ZOO.iterdir() if (p / "config.json").is_file())


def model_max_len(model: Path) -> int:
    """max_position_embeddings of the text model (top level or text_config)."""
    data = json.loads((model / "config.json").read_text())
    text = data.get("text_config") or data
    return int(text.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)


# ---------------------------------------------------------------- runtime


def make_runtime(args: argparse.Namespace) -> Runtime:
    """The CPU test env (made or reused as by e2 env) and its e2 view, or --python."""
    if args.python:
        python, view = Path(args.python), None
        if not python.is_file():
            raise E2Error(f"{python}: no such python", hint="pass --python of a vLLM venv")
        if args.vllm_path is not None:
            if not (args.vllm_path / "vllm" / "__init__.py").is_file():
                raise E2Error(f"--vllm-path {args.vllm_path}: no vllm package in it")
            view = args.vllm_path.resolve()
        why = None if view or args.stock_only else "--python without --vllm-path: stock only"
    else:
        from e2.testenv import prepare

        env, made = prepare(args.project, args.project.load(), args.upstream.cache.root,
                            "cpu", overlay=not args.stock_only)
        python, view, why = env.python, made.path if made else None, None
    if args.stock_only:
        view, why = None, "--stock-only"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None,"
                            " u.find_spec('torchvision') is None)"],
        capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or not probe.stdout.startswith("True"):
        raise E2Error(f"{python} cannot import vllm", hint="pass --python of a vLLM venv")
    return Runtime(python, view, why, probe.stdout.split()[1] == "True")


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class Settings:
    budget_gib: float
    tp: int
    max_num_seqs: int
    max_model_len: int          # 0: min(32768, the model's max_position_embeddings)
    kv_dtype: str
    mamba_cache_mode: str
    lengths: tuple[int, ...]


def run_worker(runtime: Runtime, side: str, model: Path, settings: Settings) -> dict:
    max_len = settings.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_max_len(model))
    lengths = [n for n in settings.lengths if n <= max_len]
    with tempfile.TemporaryDirectory(prefix="e2-probe-") as scratch:
        out = Path(scratch) / "result.json"
        command = [str(runtime.python), str(WORKER), "--model", str(model),
                   "--budget-gib", str(settings.budget_gib), "--tp", str(settings.tp),
                   "--max-num-seqs", str(settings.max_num_seqs),
                   "--max-model-len", str(max_len), "--kv-dtype", settings.kv_dtype,
                   "--mamba-cache-mode", settings.mamba_cache_mode,
                   "--lengths", ",".join(map(str, lengths)), "--out", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=scratch,
                                  env=runtime.env(side), timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise E2Error(f"{model.name} ({side}): the worker ran past {WORKER_TIMEOUT}s")
        if not out.is_file():
            tail = "\n".join(done.stderr.splitlines()[-20:])
            raise E2Error(f"{model.name} ({side}): the worker exited {done.returncode} "
                          f"without a result:\n{tail}")
        result = json.loads(out.read_text())
    if not result["ok"]:
        if result["input_error"]:
            raise E2Error(f"{model.name}: {result['message']}")
        raise E2Error(f"{model.name} ({side}): {result['message']}\n{result['traceback']}")
    result["skipped_lengths"] = [n for n in settings.lengths if n > max_len]
    return result


def run_all(runtime: Runtime, models: list[Path], settings: Settings) -> dict[str, dict]:
    sides = SIDES if runtime.view else SIDES[:1]
    jobs = [(model, side) for model in models for side in sides]
    results: dict[str, dict] = {model.name: {} for model in models}
    with console.progress(count=True) as bar, ThreadPoolExecutor(max_workers=2) as pool:
        task = bar.add_task("probing capacity", total=len(jobs))
        futures = {pool.submit(run_worker, runtime, side, model, settings): (model, side)
                   for model, side in jobs}
        for future, (model, side) in futures.items():
            results[model.name][side] = future.result()
            bar.advance(task)
    return results


def boot_all(runtime: Runtime, models: list[Path], settings: Settings,
             per_model: dict[str, dict], docker: dict | None = None) -> None:
    """Boot each side once per model (one at a time: each holds the model's weights);
    ``docker`` ({client, images, gpus}) boots the engine images instead."""
    from e2.probes.boot import read_boot_line, read_boot_line_docker

    for model in models:
        max_len = settings.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_max_len(model))
        model_settings = dataclasses.replace(settings, max_model_len=max_len)
        for side in per_model[model.name]:
            with console.status(f"booting {model.name} ({side})"):
                if docker is not None:
                    boot = read_boot_line_docker(docker["client"], docker["images"][side],
                                                 model, model_settings, docker["gpus"])
                    boot["image"] = docker["images"][side]
                else:
                    boot = read_boot_line(runtime.python, model, model_settings,
                                          runtime.env(side))
            per_model[model.name][side]["boot"] = boot
            console.info(f"{model.name} {side}: {boot['kv_line']} ({boot['seconds']} s)")


def boot_images(args: argparse.Namespace) -> dict:
    """Stock and E2 engine images on DOCKER_HOST for --boot --docker (the GPU host)."""
    from e2.image import connect, engine_images

    client = connect()  # an unreachable DOCKER_HOST fails here, before any boot
    return {"client": client, "gpus": args.gpus,
            "images": engine_images(args.project, args.project.load(), args.stock_image,
                                    args.e2_image)}


def render_boot(per_model: dict[str, dict]) -> str:
    rows = [(name, side, result["boot"]) for name, sides in per_model.items()
            for side, result in sides.items() if "boot" in result]
    if not rows:
        return ""
    lines = ["", "## Boot line (this host's engine, dummy weights)", "",
             "| model | side | KV cache size line | boot s |", "|---|---|---|---:|"]
    lines += [f"| {name} | {side} | {boot['kv_line']} | {boot['seconds']} |"
              for name, side, boot in rows]
    return "\n".join(lines) + "\n"


def differences(per_model: dict[str, dict]) -> list[str]:
    """Planner and workload figures where E2 differs from stock."""
    found = []
    for name, sides in per_model.items():
        if "e2" not in sides:
            continue
        stock, e2 = sides["stock"], sides["e2"]
        for key in ("block_size", "num_blocks", "kv_cache_tokens", "max_concurrency"):
            if stock["planner"][key] != e2["planner"][key]:
                found.append(f"{name}: {key} {stock['planner'][key]} -> {e2['planner'][key]}")
        for s_row, e_row in zip(stock["workload"], e2["workload"]):
            for kind in ("distinct", "shared_prefix"):
                if s_row[kind]["saturation"] != e_row[kind]["saturation"]:
                    found.append(f"{name}: L={s_row['length']} {kind} saturation "
                                 f"{s_row[kind]['saturation']} -> {e_row[kind]['saturation']}")
        if "boot" in stock and "boot" in e2 and stock["boot"]["tokens"] != e2["boot"]["tokens"]:
            found.append(f"{name}: boot KV cache tokens {stock['boot']['tokens']} -> "
                         f"{e2['boot']['tokens']}")
    return found


def leaks(per_model: dict[str, dict]) -> list[str]:
    found = []
    for name, sides in per_model.items():
        for side, result in sides.items():
            for row in result["workload"]:
                for kind in ("distinct", "shared_prefix"):
                    run = row[kind]
                    if run["leaked_blocks"] or run["finished"] != run["requests"]:
                        found.append(f"{name} ({side}) L={row['length']} {kind}: "
                                     f"{run['leaked_blocks']} blocks leaked, "
                                     f"{run['finished']}/{run['requests']} finished")
    return found


# ---------------------------------------------------------------- reporting


def _ratio(run: dict) -> str:
    return "n/a" if run.get("ratio") is None else f"{run['ratio']:.3f}"


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
                                 str(d["saturation"]), _ratio(d), str(s["saturation"]),
                                 _ratio(s), str(d["preemptions"] + s["preemptions"]),
                                 str(d["leaked_blocks"] + s["leaked_blocks"]))
    console.out.print(planner)
    console.out.print(workload)


def render_markdown(record: dict) -> str:
    s = record["settings"]
    lines = [
        "# KV capacity probe", "",
        f"- upstream: vLLM {record['upstream_version']}; series digest "
        f"`{record['series_digest']}`",
        f"- host: {record['host']}; device: {record['device']}",
        f"- python: `{record['python']}`; e2 view: "
        f"{'`' + record['view'] + '`' if record['view'] else 'none (' + str(record['why_no_view']) + ')'}",
        f"- command: `{record['command']}`",
        f"- budget {s['budget_gib']} GiB per rank, TP {s['tp']}, max_num_seqs "
        f"{s['max_num_seqs']}, KV dtype {s['kv_dtype']}, mamba cache mode "
        f"{s['mamba_cache_mode']}; assumed attention backend {record['backend_assumed']}",
        f"- when: {record['created']}", "",
        "## Planner", "",
        "| model | side | max_model_len | block size | pool blocks | KV cache tokens "
        "| max concurrency |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, sides in record["models"].items():
        for side, result in sides.items():
            p = result["planner"]
            lines.append(f"| {name} | {side} | {result['inputs']['max_model_len']} | "
                         f"{p['block_size']} | {p['num_blocks']:,} | {p['kv_cache_tokens']:,} "
                         f"| {p['max_concurrency']:.2f} |")
    lines += ["", "## Workload", "",
              "Saturation: most requests running at once before any preemption; ideal "
              "`min(max_num_seqs, budget // (state_bytes_per_request + L * "
              "kv_bytes_per_token))`.", "",
              "| model | side | L | ideal | distinct | ratio | shared prefix | ratio "
              "| preemptions | leaked blocks |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, sides in record["models"].items():
        for side, result in sides.items():
            for row in result["workload"]:
                d, s2 = row["distinct"], row["shared_prefix"]
                lines.append(
                    f"| {name} | {side} | {row['length']} | {row['ideal']} | "
                    f"{d['saturation']} | {_ratio(d)} | {s2['saturation']} | {_ratio(s2)} | "
                    f"{d['preemptions'] + s2['preemptions']} | "
                    f"{d['leaked_blocks'] + s2['leaked_blocks']} |")
    lines += ["", f"E2 vs stock: {', '.join(record['differences']) or 'identical'}.", ""]
    return "\n".join(lines)


def render_baseline(record: dict, plot_name: str) -> str:
    s = record["settings"]
    lengths = sorted({row["length"] for sides in record["models"].values()
                      for row in sides["stock"]["workload"]})
    head = "| model | side | " + " | ".join(f"L={n}" for n in lengths) + " |"
    lines = [
        "# KV capacity baseline", "",
        "Workload saturation over the ideal (distinct prompts) for the model zoo, stock "
        "vLLM and E2 side by side. The ideal is what a separate state pool could reach: "
        "`min(max_num_seqs, floor(budget / (state_bytes_per_request + L * "
        "kv_bytes_per_token)))`. Made by `e2 probe capacity --zoo --baseline`; details "
        f"and the planner figures in `{record['record_md']}`.", "",
        f"vLLM {record['upstream_version']}, series `{record['series_digest'][:16]}`, budget "
        f"{s['budget_gib']} GiB per rank, TP {s['tp']}, max_num_seqs {s['max_num_seqs']}, KV "
        f"dtype {s['kv_dtype']}, mamba cache mode {s['mamba_cache_mode']}, planner as on "
        f"{record['backend_assumed']}; max_model_len is 32768 or the model's own maximum "
        "if smaller (n/a: longer than that).", "",
        head, "|---|---|" + "---:|" * len(lengths)]
    for name, sides in record["models"].items():
        for side, result in sides.items():
            by_len = {row["length"]: _ratio(row["distinct"]) for row in result["workload"]}
            lines.append(f"| {name} | {side} | "
                         + " | ".join(by_len.get(n, "n/a") for n in lengths) + " |")
    lines += ["", "| model | max_model_len | block size | pool blocks | KV cache tokens "
              "| max concurrency |", "|---|---:|---:|---:|---:|---:|"]
    for name, sides in record["models"].items():
        p = sides["stock"]["planner"]
        lines.append(f"| {name} | {sides['stock']['inputs']['max_model_len']} | "
                     f"{p['block_size']} | {p['num_blocks']:,} | "
                     f"{p['kv_cache_tokens']:,} | {p['max_concurrency']:.2f} |")
    lines += ["", f"![ratio vs L]({plot_name})", "",
              f"E2 vs stock: {', '.join(record['differences']) or 'identical'}.", ""]
    return "\n".join(lines)


def _publish(path: Path, content: str) -> None:
    write_atomic(path, content)
    path.chmod(0o644)  # records are committed; mkstemp made them owner-only


def plot_baseline(record: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise E2Error("the baseline plot needs matplotlib",
                      hint=f"{sys.executable} -m pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, side in zip(axes, SIDES):
        for name, sides in record["models"].items():
            if side not in sides:
                continue
            rows = sides[side]["workload"]
            axis.plot([r["length"] for r in rows], [r["distinct"]["ratio"] for r in rows],
                      marker="o", label=name)
        axis.set_xscale("log", base=2)
        axis.set_title(f"{side}: saturation / ideal")
        axis.set_xlabel("request length L (tokens)")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("ratio")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"KV capacity, {record['settings']['budget_gib']} GiB per rank, "
                    f"vLLM {record['upstream_version']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Fixed metadata so an unchanged result writes the same bytes.
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)


# ---------------------------------------------------------------- command


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated token counts, e.g. 128,4096")
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError("each length must be at least 2 tokens")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="measure what the series changes: KV capacity of hybrid models",
        description="Probes that run vLLM's own code in the test venv, stock and E2.")
    probes = parser.add_subparsers(dest="probe", metavar="PROBE", required=True)
    cap = probes.add_parser(
        "capacity", help="KV pool size and scheduler saturation for hybrid models",
        description="Plan the KV cache of a model (config.json only, no weights) for a "
                    "budget per rank with vLLM's planner as a CUDA boot would (attention "
                    "backend FLASH_ATTN on SM90), then drive vLLM's v1 scheduler with "
                    "fake outputs to measure how many requests of length L run at once, "
                    "against the ideal of a separate state pool. Stock and E2 side by "
                    "side; the record goes to docs/validation/.")
    cap.add_argument("--model", action="append", default=[], metavar="DIR|NAME",
                     help="model folder with config.json, or a zoo name (repeatable)")
    cap.add_argument("--zoo", action="store_true", help="every model in the zoo: "
                     + ", ".join(zoo_names()))
    cap.add_argument("--budget-gib", type=float, default=10.0,
                     help="KV cache memory per rank in GiB (default 10)")
    cap.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    cap.add_argument("--max-num-seqs", type=int, default=256, help="(default 256)")
    cap.add_argument("--max-model-len", type=int, default=0,
                     help="default: 32768, or the model's maximum if smaller")
    cap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto")
    cap.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none",
                     help="align turns prefix caching on (default none)")
    cap.add_argument("--lengths", type=_lengths, default=DEFAULT_LENGTHS,
                     help="workload request lengths (default 128,1024,4096,16384,32768)")
    cap.add_argument("--python", type=Path, metavar="PATH",
                     help="python of a vLLM venv (default: e2 env's cpu venv, made or "
                          "reused)")
    cap.add_argument("--vllm-path", type=Path, metavar="DIR",
                     help="with --python: an overlaid copy of vllm to run as E2 (default: "
                          "e2 env's view)")
    cap.add_argument("--stock-only", action="store_true", help="skip the E2 side")
    cap.add_argument("--boot", action="store_true",
                     help="also boot the engine on each model (dummy weights) and record its "
                          "'KV cache size: N tokens' line, stock and E2 (here: --tp 1)")
    cap.add_argument("--docker", action="store_true",
                     help="with --boot: boot the engine images on DOCKER_HOST (the GPU host)")
    add_engine_image_arguments(cap)
    cap.add_argument("--results", type=Path, metavar="DIR",
                     help="where records go (default docs/validation)")
    cap.add_argument("--no-record", action="store_true", help="print only")
    cap.add_argument("--baseline", action="store_true",
                     help="also write docs/capacity-baseline.md and .png")
    cap.add_argument("--json", action="store_true", help="print the record as JSON")
    cap.set_defaults(run=run)
    serve = probes.add_parser(
        "serve", help="stock vs E2 engines serving a tiny hybrid model, token for token",
        description="Serve a tiny random-weight Qwen3-Next model with stock and E2 vLLM "
                    "(the local e2 env, or --docker images on DOCKER_HOST) and compare "
                    "output token ids request by request: prompts of block-1, block and "
                    "block+1 tokens, a shared prefix, more requests than fit (preemption), "
                    "sync and async scheduling. Any mismatch fails; records go to "
                    "docs/validation/.")
    add_serve_arguments(serve)


def _check_numbers(args: argparse.Namespace) -> None:
    if args.budget_gib <= 0:
        raise E2Error(f"--budget-gib {args.budget_gib}: must be positive")
    if args.tp < 1:
        raise E2Error(f"--tp {args.tp}: must be at least 1")
    if args.max_num_seqs < 1:
        raise E2Error(f"--max-num-seqs {args.max_num_seqs}: must be at least 1")


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    if (args.docker or args.stock_image or args.e2_image or args.gpus) and not args.boot:
        raise E2Error("--docker, --stock-image, --e2-image and --gpus go with --boot")
    if (args.stock_image or args.e2_image or args.gpus) and not args.docker:
        raise E2Error("--stock-image, --e2-image and --gpus go with --docker")
    specs = list(args.model) + (zoo_names() if args.zoo else [])
    if not specs:
        raise E2Error("no model given", hint="--model DIR|NAME (repeatable) or --zoo")
    if args.baseline and not args.zoo:
        raise E2Error("--baseline describes the whole zoo", hint="add --zoo")
    models = list(dict.fromkeys(resolve_model(spec) for spec in specs))
    runtime = make_runtime(args)
    if runtime.view is None:
        console.warn(f"E2 side skipped: {runtime.why_no_view}; running stock only")
    settings = Settings(args.budget_gib, args.tp, args.max_num_seqs, args.max_model_len,
                        args.kv_dtype, args.mamba_cache_mode, tuple(args.lengths))
    images = boot_images(args) if args.boot and args.docker else None  # reach it first
    per_model = run_all(runtime, models, settings)
    if args.boot:
        boot_all(runtime, models, settings, per_model, images)
    series = args.project.load()
    first = next(iter(per_model.values()))["stock"]
    record = {
        "format": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "upstream_version": series.upstream.version,
        "vllm_version": first["vllm_version"],
        "series_digest": series_digest(series, args.project.patches_dir),
        "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                f"{os.cpu_count()} CPUs)",
        "device": "none: CPU only; the planner reproduces the CUDA boot path",
        "backend_assumed": first["backend_assumed"],
        "python": str(runtime.python), "view": str(runtime.view) if runtime.view else None,
        "why_no_view": runtime.why_no_view,
        "command": "e2 " + shlex.join(sys.argv[1:]),
        "settings": {"budget_gib": args.budget_gib, "tp": args.tp,
                     "max_num_seqs": args.max_num_seqs, "kv_dtype": args.kv_dtype,
                     "mamba_cache_mode": args.mamba_cache_mode,
                     "lengths": list(args.lengths)},
        "models": per_model,
        "differences": differences(per_model),
        "leaks": leaks(per_model),
    }
    if args.json:
        console.out.print_json(json.dumps(record))
    else:
        print_tables(per_model)
    if not args.no_record:
        results = args.results or args.project.root / "docs" / "validation"
        stamp = record["created"].replace(":", "").replace("-", "")[:15]
        base = results / f"capacity-{stamp}"
        record["record_md"] = str(base.with_suffix(".md").relative_to(args.project.root)
                                  if base.is_relative_to(args.project.root)
                                  else base.with_suffix(".md"))
        _publish(base.with_suffix(".json"), json.dumps(record, indent=1) + "\n")
        _publish(base.with_suffix(".md"), render_markdown(record) + render_boot(per_model))
        console.info(f"recorded {base}.json and .md")
        if args.baseline:
            docs = args.project.root / "docs"
            plot_baseline(record, docs / "capacity-baseline.png")
            _publish(docs / "capacity-baseline.md",
                         render_baseline(record, "capacity-baseline.png"))
            console.info(f"wrote {docs / 'capacity-baseline.md'} and .png")
    if record["leaks"]:
        raise E2Error("blocks leaked after every request finished:\n  "
                      + "\n  ".join(record["leaks"]))
    return 0
