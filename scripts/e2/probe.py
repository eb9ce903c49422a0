"""e2 probe capacity: how many tokens and requests a hybrid model's KV pool holds.

The vLLM side runs in a venv of the pinned release (``probes/capacity_worker.py``
with that venv's python), once on stock vLLM and once with the e2 view first on
PYTHONPATH, planning for a target GPU (compute capability, default 8.6) with the
attention backend vLLM's own selection picks there; this module checks the input,
runs both, compares them and records the result (JSON + Markdown) under
docs/validation/. ``--baseline`` runs the whole scenario matrix instead (every zoo
model and setting, resumable) and writes docs/capacity-baseline.md and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import git
from filelock import FileLock
from rich.table import Table

from e2 import console
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.probes.serve import add_engine_image_arguments, add_serve_arguments
from e2.series import series_digest
from e2.testenv import clean_env

PROBES = Path(__file__).resolve().parent / "probes"
WORKER = PROBES / "capacity_worker.py"
STUBS = PROBES / "stubs"
ZOO = PROBES / "models"
DEFAULT_LENGTHS = (128, 1024, 4096, 16384, 32768)
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_CAPABILITY = "8.6"  # RTX 3090, the target host
WORKER_TIMEOUT = 600
SIDES = ("stock", "e2")
# What E2 must reach in every run of the matrix (issue: state pool, switch and proof).
E2_MIN_RATIO = 0.98
# Packages of the CUDA engine image that vLLM's backend selection imports (FlashInfer
# and what it imports at load); pinned by the release's requirements/cuda.txt, the
# rest follows flashinfer's own requirements.
IMAGE_PACKAGES = ("flashinfer-python", "apache-tvm-ffi")
IMAGE_PACKAGES_UNPINNED = ("nvidia-ml-py",)


@dataclass(frozen=True)
class Runtime:
    """The venv python that runs the worker, and the e2 view (None: stock only)."""

    python: Path
    view: Path | None
    why_no_view: str | None
    needs_stub: bool
    image_packages: Path | None = None  # the engine image's packages the selection needs

    def env(self, side: str) -> dict[str, str]:
        env = clean_env()
        env["HF_HUB_OFFLINE"] = "1"
        paths = [str(self.view)] if side == "e2" and self.view else []
        if self.needs_stub:
            paths.append(str(STUBS))  # after the view: it must never shadow vllm
        if self.image_packages:
            paths.append(str(self.image_packages))  # holds no vllm either
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
        raise E2Error(f"{config_file}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
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


def image_requirements(args: argparse.Namespace) -> list[str]:
    """The pins of IMAGE_PACKAGES in the pinned release's requirements/cuda.txt."""
    series = args.project.load()
    commit = args.upstream.ensure(series)
    text = git.Repo(args.upstream.cache.repo_dir).git.show(f"{commit}:requirements/cuda.txt")
    pins = {}
    for line in text.splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name in IMAGE_PACKAGES and version:
            pins[name] = f"{name}=={version.strip()}"
    missing = [name for name in IMAGE_PACKAGES if name not in pins]
    if missing:
        raise E2Error(f"requirements/cuda.txt of vLLM {series.upstream.version} pins no "
                      f"{', '.join(missing)}", hint="the CUDA backend selection cannot be "
                      "reproduced without them; update IMAGE_PACKAGES in e2/probe.py")
    return [pins[name] for name in IMAGE_PACKAGES] + list(IMAGE_PACKAGES_UNPINNED)


def ensure_image_packages(args: argparse.Namespace, python: Path) -> Path:
    """A folder (made once, shared, locked) with the engine image's packages that
    vLLM's attention backend selection imports; --no-deps: only their import is used."""
    wanted = image_requirements(args)
    key = hashlib.sha256(json.dumps([str(python), wanted]).encode()).hexdigest()[:16]
    root = args.upstream.cache.root / "probe-packages"
    folder = root / key
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if (folder / "e2-packages.json").is_file():
            return folder
        staging = root / f".{key}.new"
        shutil.rmtree(staging, ignore_errors=True)
        with console.status("installing " + ", ".join(wanted) + " for the backend selection"):
            done = subprocess.run([str(python), "-m", "pip", "install", "--no-input", "-q",
                                   "--no-deps", "--target", str(staging), *wanted],
                                  capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = "\n".join(done.stderr.splitlines()[-5:])
            raise E2Error(f"pip could not install {' '.join(wanted)}:\n{tail}",
                          hint="check the package index pip is configured with")
        (staging / "e2-packages.json").write_text(json.dumps(wanted) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


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
    return Runtime(python, view, why, probe.stdout.split()[1] == "True",
                   ensure_image_packages(args, python))


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
    capability: str = DEFAULT_CAPABILITY

    def label(self) -> str:
        """Names the setting in file names and tables: 10g-tp1-256-auto-none."""
        return (f"{self.budget_gib:g}g-tp{self.tp}-{self.max_num_seqs}-{self.kv_dtype}-"
                f"{self.mamba_cache_mode}")


def _job(model: Path, settings: Settings, out: Path) -> dict:
    max_len = settings.max_model_len or min(DEFAULT_MAX_MODEL_LEN, model_max_len(model))
    return {"out": str(out), "budget_gib": settings.budget_gib, "tp": settings.tp,
            "max_num_seqs": settings.max_num_seqs, "max_model_len": max_len,
            "kv_dtype": settings.kv_dtype, "mamba_cache_mode": settings.mamba_cache_mode,
            "lengths": [n for n in settings.lengths if n <= max_len]}


def run_jobs(runtime: Runtime, side: str, model: Path,
             runs: list[tuple[Settings, Path]]) -> None:
    """One worker process (vLLM imported once) for several settings of one model and
    side; each result lands in its own file as soon as it is done. All settings
    share one capability."""
    [capability] = {settings.capability for settings, _ in runs}
    with tempfile.TemporaryDirectory(prefix="e2-probe-") as scratch:
        jobs = Path(scratch) / "jobs.json"
        jobs.write_text(json.dumps([_job(model, settings, out) for settings, out in runs]))
        command = [str(runtime.python), str(WORKER), "--model", str(model),
                   "--capability", capability, "--jobs", str(jobs)]
        timeout = WORKER_TIMEOUT * len(runs)
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=scratch,
                                  env=runtime.env(side), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise E2Error(f"{model.name} ({side}): the worker ran past {timeout}s") from None
    missing = [out for _, out in runs if not out.is_file()]
    if missing:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise E2Error(f"{model.name} ({side}): the worker exited {done.returncode} "
                      f"without a result:\n{tail}")


def read_result(path: Path, model: Path, side: str, settings: Settings) -> dict:
    result = json.loads(path.read_text())
    if not result["ok"]:
        if result["input_error"]:
            raise E2Error(f"{model.name}: {result['message']}")
        raise E2Error(f"{model.name} ({side}): {result['message']}\n{result['traceback']}")
    max_len = result["inputs"]["max_model_len"]
    result["skipped_lengths"] = [n for n in settings.lengths if n > max_len]
    return result


def run_worker(runtime: Runtime, side: str, model: Path, settings: Settings) -> dict:
    with tempfile.TemporaryDirectory(prefix="e2-probe-out-") as scratch:
        out = Path(scratch) / "result.json"
        run_jobs(runtime, side, model, [(settings, out)])
        return read_result(out, model, side, settings)


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
                    # The engine boots on this host's platform: the planner's
                    # CUDA-image packages stay out of its path.
                    engine = dataclasses.replace(runtime, image_packages=None)
                    boot = read_boot_line(runtime.python, model, model_settings,
                                          engine.env(side))
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
        f"{s['mamba_cache_mode']}; target compute capability {record['capability']}, "
        f"attention backend {record['backend']['name']} (vLLM's selection; kernel "
        f"blocks {', '.join(map(str, record['backend']['kernel_block_sizes']))})",
        f"- when: {record['created']}", "",
        "## Planner", "",
        "| model | side | backend | max_model_len | block size | pool blocks "
        "| KV cache tokens | max concurrency |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, sides in record["models"].items():
        for side, result in sides.items():
            p = result["planner"]
            lines.append(f"| {name} | {side} | {result['backend']['name']} | "
                         f"{result['inputs']['max_model_len']} | "
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


def _publish(path: Path, content: str) -> None:
    write_atomic(path, content)
    path.chmod(0o644)  # records are committed; mkstemp made them owner-only


# ---------------------------------------------------------------- the matrix


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


def matrix_folder(args: argparse.Namespace, runtime: Runtime, capability: str) -> Path:
    """Per-run results of one worker, series and target: a rerun resumes there."""
    assert runtime.view is not None  # the matrix compares stock with E2: there is an E2 side
    key = hashlib.sha256(WORKER.read_bytes()
                         + (runtime.view / "MANIFEST.json").read_bytes()
                         + capability.encode()).hexdigest()[:16]
    return (args.results or args.project.root / ".e2" / "results") / "capacity-matrix" / key


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


def matrix_record(args: argparse.Namespace, runtime: Runtime, folder: Path,
                  scenarios: list[tuple[str, Settings]],
                  results: dict[tuple[str, str, str], dict]) -> dict:
    series = args.project.load()
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
        "series_digest": series_digest(series, args.project.patches_dir),
        "capability": scenarios[0][1].capability,
        "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                f"{os.cpu_count()} CPUs)",
        "command": "e2 " + shlex.join(sys.argv[1:]),
        "results_folder": str(folder),
        "runs": runs,
        "e2_min_ratio": min(e2_ratios),
        "flags": matrix_flags(runs),
    }


def _pair(stock: object, e2: object, fmt: str = "{}") -> str:
    return fmt.format(stock) if stock == e2 else f"{fmt.format(stock)} → {fmt.format(e2)}"


def render_matrix(record: dict, plot_name: str) -> str:
    lengths = sorted({row["length"] for run in record["runs"] for row in run["stock"]["rows"]})
    backends = sorted({(run["settings"]["kv_dtype"], run["stock"]["backend"],
                        ", ".join(map(str, run["stock"]["kernel_block_sizes"])))
                       for run in record["runs"]})
    flags = record["flags"]
    early = sum(row[f"{k}_preemptions_below_ideal"] for run in record["runs"]
                for row in run["e2"]["rows"] for k in ("distinct", "shared_prefix"))
    leaked = sum(row[f"{k}_leaked_blocks"] for run in record["runs"]
                 for side in SIDES for row in run[side]["rows"]
                 for k in ("distinct", "shared_prefix"))
    workloads = sum(len(run["e2"]["rows"]) for run in record["runs"])
    short = sorted(f"{row['distinct_ratio']:.3f} {run['model']} {run['setting']} "
                    f"L={row['length']}" for run in record["runs"] for row in run["e2"]["rows"]
                    if row["distinct_ratio"] is not None
                    and row["distinct_ratio"] < E2_MIN_RATIO)
    lines = [
        "# KV capacity baseline", "",
        "How many requests of L tokens run at once, over the ideal of a separate state "
        "pool: `min(max_num_seqs, floor(budget / (state_bytes_per_request + L * "
        "kv_bytes_per_token)))`, for every zoo model, stock vLLM beside E2. vLLM's "
        "planner and v1 scheduler run on the CPU as a CUDA boot on the target GPU would "
        "(`e2 probe capacity`); the attention backend is the one vLLM's own selection "
        "picks for that compute capability and KV dtype.", "",
        f"- vLLM {record['upstream_version']}, series `{record['series_digest'][:16]}`, "
        f"target compute capability {record['capability']}"
        + (" (RTX 3090)" if record["capability"] == "8.6" else ""),
        "- attention backend chosen: " + "; ".join(
            f"KV {kv}: {name} (kernel blocks {sizes})" for kv, name, sizes in backends),
        f"- made by `{record['command']}` on {record['created'][:10]}",
        "- max_model_len is 32768 or the model's own maximum if smaller (n/a: longer)",
        "",
        "## Summary", "",
        f"- runs: {len(record['runs'])} scenarios x 2 sides; lowest E2 ratio (distinct "
        f"prompts): **{record['e2_min_ratio']:.3f}**",
        f"- E2 workloads flagged (ratio < {E2_MIN_RATIO}; admitted past the ideal, then "
        f"preempted; preemptions below the ideal or more than stock's; leaked blocks): "
        f"**{len(flags)}** of {workloads}; E2 preemptions below the ideal: {early}; "
        f"leaked blocks, both sides: {leaked}",
        f"- E2 workloads below {E2_MIN_RATIO} of the ideal: {len(short)}"
        + (f" (lowest: {short[0]})" if short else ""), "",
        "Cells are stock → E2 (one figure where they agree). Blocks: the attention "
        "block, stock's hybrid-aligned block → E2's natural one. Boot: the boot line's "
        "`KV cache size` tokens and its maximum concurrency at max_model_len. "
        "Preemptions: all of a workload (it submits a quarter more requests than the "
        "ideal, or max_num_seqs) and those of steps that ran fewer requests than the "
        "ideal, both prompt kinds and every L summed. A ratio above 1 is a scheduler "
        "that admitted more requests than the memory holds and preempted after "
        "(mamba `align`: admission counts neither decode growth nor the checkpoint "
        "state).", ""]
    if flags:
        lines += ["## Flagged E2 runs", ""] + [f"- {flag}" for flag in flags] + [""]
    by_setting: dict[str, list[dict]] = {}
    for run in record["runs"]:
        by_setting.setdefault(run["setting"], []).append(run)
    head = ("| model | backend | blocks | " + " | ".join(f"L={n}" for n in lengths)
            + " | boot tokens | boot concurrency | preemptions | below ideal | leaked |")
    for setting, runs in by_setting.items():
        st = runs[0]["settings"]
        lines += [f"## {st['budget_gib']:g} GiB per rank, TP {st['tp']}, max_num_seqs "
                  f"{st['max_num_seqs']}, KV {st['kv_dtype']}, mamba {st['mamba_cache_mode']}",
                  "", head, "|---|---|---|" + "---:|" * (len(lengths) + 5)]
        for run in runs:
            stock, e2 = run["stock"], run["e2"]
            ratios = []
            for n in lengths:
                s_row = next((r for r in stock["rows"] if r["length"] == n), None)
                e_row = next((r for r in e2["rows"] if r["length"] == n), None)
                if s_row is None or e_row is None:
                    ratios.append("n/a")
                    continue
                cell = _pair(s_row["distinct_ratio"], e_row["distinct_ratio"], "{:.3f}")
                if any(f.startswith(f"{run['model']} {setting} L={n} ") for f in flags):
                    cell += " ⚠"
                ratios.append(cell)
            early_pair = tuple(sum(r[f"{k}_preemptions_below_ideal"] for r in side["rows"]
                                   for k in ("distinct", "shared_prefix"))
                               for side in (stock, e2))
            preempt_pair = tuple(sum(r[f"{k}_preemptions"] for r in side["rows"]
                                     for k in ("distinct", "shared_prefix"))
                                 for side in (stock, e2))
            leak_pair = tuple(sum(r[f"{k}_leaked_blocks"] for r in side["rows"]
                                  for k in ("distinct", "shared_prefix"))
                              for side in (stock, e2))
            lines.append(
                f"| {run['model']} | {_pair(stock['backend'], e2['backend'])} | "
                f"{_pair(stock['attention_block_size'], e2['attention_block_size'])} | "
                + " | ".join(ratios) + " | "
                f"{_pair(stock['boot_tokens'], e2['boot_tokens'], '{:,}')} | "
                f"{_pair(stock['boot_concurrency'], e2['boot_concurrency'], '{:.2f}')} | "
                f"{_pair(*preempt_pair)} | {_pair(*early_pair)} | {_pair(*leak_pair)} |")
        lines.append("")
    lines += [f"![saturation over ideal vs L, stock dashed, E2 solid]({plot_name})", "",
              f"Summary record (every run and L, both prompt kinds): `{record['record']}`; "
              "the worker's full JSON per run (planner, groups, steps) stays under "
              f"`.e2/results/capacity-matrix/` of the machine that ran it.", ""]
    return "\n".join(lines)


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


def run_baseline(args: argparse.Namespace) -> int:
    """The whole matrix, resumable, then docs/capacity-baseline.md and .png."""
    runtime = make_runtime(args)
    if runtime.view is None:
        raise E2Error(f"--baseline compares stock with E2, and there is no E2 side: "
                      f"{runtime.why_no_view}")
    scenarios = matrix_scenarios(args.capability)
    folder = matrix_folder(args, runtime, args.capability)
    folder.mkdir(parents=True, exist_ok=True)
    runtime = dataclasses.replace(runtime, view=snapshot_view(runtime.view, folder))
    results = run_matrix(runtime, folder, scenarios)
    record = matrix_record(args, runtime, folder, scenarios, results)
    docs = args.project.root / "docs"
    record["record"] = "docs/validation/capacity-baseline.json"
    _publish(docs / "validation" / "capacity-baseline.json",
             json.dumps(record, indent=1) + "\n")
    plot_matrix(record, docs / "capacity-baseline.png")
    _publish(docs / "capacity-baseline.md", render_matrix(record, "capacity-baseline.png"))
    console.info(f"wrote {docs / 'capacity-baseline.md'}, .png and "
                 f"{record['record']}: lowest E2 ratio {record['e2_min_ratio']:.3f}, "
                 f"{len(record['flags'])} E2 workloads flagged")
    return 0


# ---------------------------------------------------------------- command


def _capability(text: str) -> str:
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError("a compute capability as MAJOR.MINOR, e.g. 8.6")
    return f"{int(major)}.{int(minor)}"


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated token counts, e.g. 128,4096") from None
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
                    "budget per rank with vLLM's planner as a CUDA boot on the target GPU "
                    "would (the attention backend vLLM's own selection picks for its "
                    "compute capability and the KV dtype), then drive vLLM's v1 scheduler with "
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
    cap.add_argument("--capability", type=_capability, default=DEFAULT_CAPABILITY,
                     metavar="MAJOR.MINOR",
                     help="target GPU compute capability (default 8.6, an RTX 3090; "
                          "9.0: H100/H200)")
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
                     help="run the whole scenario matrix (every zoo model; 10 GiB, 256 and "
                          "1024 seqs, KV auto and fp8, mamba none and align; Qwen3.5-27B "
                          "at TP 4, 6 GiB, 64 seqs), stock and E2, resuming from "
                          ".e2/results/capacity-matrix/; write docs/capacity-baseline.md "
                          "and .png")
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
    if args.baseline:
        if args.model or args.boot or args.stock_only or args.no_record:
            raise E2Error("--baseline runs its own scenario matrix on the whole zoo, "
                          "both sides", hint="drop --model, --boot, --stock-only and "
                          "--no-record; --capability picks the target GPU")
        return run_baseline(args)
    specs = list(args.model) + (zoo_names() if args.zoo else [])
    if not specs:
        raise E2Error("no model given", hint="--model DIR|NAME (repeatable) or --zoo")
    models = list(dict.fromkeys(resolve_model(spec) for spec in specs))
    runtime = make_runtime(args)
    if runtime.view is None:
        console.warn(f"E2 side skipped: {runtime.why_no_view}; running stock only")
    settings = Settings(args.budget_gib, args.tp, args.max_num_seqs, args.max_model_len,
                        args.kv_dtype, args.mamba_cache_mode, tuple(args.lengths),
                        args.capability)
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
        "device": f"none: CPU only; the planner reproduces a CUDA boot on compute "
                  f"capability {args.capability}",
        "capability": args.capability,
        "backend": first["backend"],
        "python": str(runtime.python), "view": str(runtime.view) if runtime.view else None,
        "why_no_view": runtime.why_no_view,
        "command": "e2 " + shlex.join(sys.argv[1:]),
        "settings": {"budget_gib": args.budget_gib, "tp": args.tp,
                     "max_num_seqs": args.max_num_seqs, "kv_dtype": args.kv_dtype,
                     "mamba_cache_mode": args.mamba_cache_mode,
                     "capability": args.capability, "lengths": list(args.lengths)},
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
    if record["leaks"]:
        raise E2Error("blocks leaked after every request finished:\n  "
                      + "\n  ".join(record["leaks"]))
    return 0
