"""e2 probe capacity: how many tokens and requests a hybrid model's KV pool holds.

The vLLM side runs in a venv of the pinned release (``capacity_worker.py`` and its
``worker_*.py`` siblings, with that venv's python), once on stock vLLM and once
with the e2 view first on PYTHONPATH, planning for a target GPU (compute
capability, default 8.6) with the attention backend vLLM's own selection picks
there. This module checks the input, runs the worker for both sides (and boots
the engine with ``--boot``) and compares them; capacity_report.py records the
result, capacity_matrix.py runs the whole scenario matrix.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from e2 import console
from e2.errors import E2Error
from e2.image import connect, engine_images
from e2.probes.boot import read_boot_line, read_boot_line_docker
from e2.probes.runtime import Runtime
from e2.series import Project

PROBES = Path(__file__).resolve().parent
WORKER = PROBES / "capacity_worker.py"
# The worker and the modules it imports from its own folder (the script's folder
# is on its sys.path; the venv has no e2 package): what a matrix result depends on.
WORKER_FILES = (WORKER, PROBES / "worker_target.py", PROBES / "worker_planner.py",
                PROBES / "worker_workload.py")
ZOO = PROBES / "models"
DEFAULT_LENGTHS = (128, 1024, 4096, 16384, 32768)
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_CAPABILITY = "8.6"  # RTX 3090, the target host
WORKER_TIMEOUT = 600
SIDES = ("stock", "e2")


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


def boot_images(project: Project, gpus: str | None, stock_image: str | None,
                e2_image: str | None) -> dict:
    """Stock and E2 engine images on DOCKER_HOST for --boot --docker (the GPU host)."""
    client = connect()  # an unreachable DOCKER_HOST fails here, before any boot
    return {"client": client, "gpus": gpus,
            "images": engine_images(project, project.load(), stock_image, e2_image)}


# ---------------------------------------------------------------- stock vs E2


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

