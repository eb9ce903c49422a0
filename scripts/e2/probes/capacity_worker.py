"""KV-capacity worker: runs inside a vLLM venv (stock or with the e2 view first on
PYTHONPATH) and writes one JSON result per job. Not imported by the driver.

Two parts, both through vLLM's own code, no weights and no accelerator, in the
modules beside this script (imported from its folder, which Python puts first on
sys.path; the venv has no e2 package, so they import only the stdlib and vllm):

* worker_target.py: vLLM's CUDA platform at the target compute capability, and
  the attention backend its selection picks there.
* worker_planner.py: the per-layer KV cache specs as a CUDA boot builds them,
  then ``get_kv_cache_configs`` for the budget, then the boot line's
  ``KV cache size: N tokens`` (``get_kv_cache_capacity``).
* worker_workload.py: the real v1 ``Scheduler`` on that KV cache config, fed
  fake model outputs, measuring how many requests of total length L run at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # PYTHONSAFEPATH (-P) leaves the script's folder off sys.path
    sys.path.append(HERE)  # appended: nothing here may shadow a module vLLM imports

from worker_planner import (  # noqa: E402
    GIB,
    Job,
    build_config,
    build_specs,
    check_tp,
    plan,
)
from worker_target import (  # noqa: E402
    ProbeInputError,
    emulate_cuda,
    load_model_classes,
    parse_capability,
)
from worker_workload import ideal_concurrency, run_workload  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--capability", default="8.6",
                        help="target GPU compute capability, MAJOR.MINOR")
    parser.add_argument("--jobs", type=Path, required=True,
                        help="JSON list of runs: {out, budget_gib, tp, max_num_seqs, "
                             "max_model_len, kv_dtype, mamba_cache_mode, lengths}")
    return parser.parse_args()


def _check_model(model: Path) -> dict:
    from vllm.model_executor.models import ModelRegistry

    config_file = model / "config.json"
    if not config_file.is_file():
        raise ProbeInputError(f"{model}: no config.json in the model folder")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ProbeInputError(f"{config_file}: not valid JSON ({exc})") from None
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ProbeInputError(f"{config_file}: key `architectures` is missing or empty")
    supported = set(ModelRegistry.get_supported_archs())
    unknown = [a for a in archs if a not in supported]
    if unknown:
        raise ProbeInputError(
            f"{config_file}: key `architectures` names {', '.join(unknown)}, which "
            f"vLLM {_vllm_version()} does not know")
    return data


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


# ---------------------------------------------------------------- main


def _emit(path: Path, payload: dict) -> None:
    # A file, not stdout: vLLM and its imports print to stdout. Written whole
    # (rename) so an interrupted matrix never leaves half a result behind.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def run_job(job: Job, model: Path, config: dict) -> dict:
    """One plan and its workloads, as the JSON the driver reads."""
    import vllm

    started = time.monotonic()
    check_tp(config, job.tp)
    vllm_config, backend, backend_facts = build_config(job, model)
    specs, facts = build_specs(vllm_config, backend)
    budget = int(job.budget_gib * GIB)
    kv_config, planner = plan(vllm_config, backend, specs, budget)
    workload = []
    for length in job.lengths:
        if length > job.max_model_len:
            raise ProbeInputError(f"workload length {length} exceeds max_model_len "
                                  f"{job.max_model_len}")
        ideal = ideal_concurrency(facts, budget, length, job.max_num_seqs)
        cap = job.max_requests or job.max_num_seqs
        count = max(1, min(cap, ideal + max(8, ideal // 4)))
        row: dict[str, Any] = {"length": length, "ideal": ideal}
        for name, shared in (("distinct", False), ("shared_prefix", True)):
            run = run_workload(vllm_config, kv_config, length, count, shared, ideal)
            run["ratio"] = run["saturation"] / ideal if ideal else None
            row[name] = run
        workload.append(row)
    return {
        "ok": True, "vllm_version": vllm.__version__, "vllm_file": vllm.__file__,
        "backend": backend_facts,
        "inputs": {"model": str(model), "budget_gib": job.budget_gib, "tp": job.tp,
                   "max_num_seqs": job.max_num_seqs, "max_model_len": job.max_model_len,
                   "max_num_batched_tokens": job.max_num_batched_tokens,
                   "kv_dtype": job.kv_dtype, "mamba_cache_mode": job.mamba_cache_mode,
                   "capability": backend_facts["capability"]},
        "facts": facts, "planner": planner, "workload": workload,
        "seconds": round(time.monotonic() - started, 2)}


def _failure(exc: BaseException) -> dict:
    if isinstance(exc, ProbeInputError):
        return {"ok": False, "input_error": True, "message": str(exc), **exc.extra}
    return {"ok": False, "input_error": False, "message": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:]}


def main() -> int:
    args = _parse()
    jobs = [Job.from_json(item) for item in json.loads(args.jobs.read_text())]
    try:
        parse_capability(args.capability)
        config = _check_model(args.model)
        load_model_classes(config["architectures"])
        emulate_cuda(args.capability)
    except Exception as exc:  # noqa: BLE001 - every run gets the same failure
        for job in jobs:
            _emit(job.out, _failure(exc))
        return 2 if isinstance(exc, ProbeInputError) else 1
    status = 0
    for job in jobs:
        try:
            result = run_job(job, args.model, config)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, with the trace
            result = _failure(exc)
            status = status or (2 if isinstance(exc, ProbeInputError) else 1)
        _emit(job.out, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
