"""e2 probe capacity|serve: measure what the series changes, stock vs E2.

* ``capacity`` (probes/capacity*.py): how many tokens and requests a hybrid
  model's KV pool holds, planned as a CUDA boot on the target GPU would, and the
  scenario matrix behind docs/capacity-baseline.md (``--baseline``).
* ``serve`` (probes/serve.py): stock and E2 engines serving a tiny hybrid model,
  token for token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from e2 import console
from e2.errors import E2Error
from e2.options import CapacityOptions, GlobalOptions, ServeOptions
from e2.probes.capacity import (
    DEFAULT_CAPABILITY,
    DEFAULT_LENGTHS,
    Settings,
    boot_all,
    boot_images,
    resolve_model,
    run_all,
    zoo_names,
)
from e2.probes.capacity_matrix import run_baseline
from e2.probes.capacity_report import print_tables, probe_record, write_record
from e2.probes.runtime import make_runtime
from e2.probes.serve import run_serve
from e2.probes.serve_settings import ALL_MODES, KV_CACHE_BYTES, MAX_MODEL_LEN

CAPACITY_DESCRIPTION = ("Plan the KV cache of a model (config.json only, no weights) for a "
               "budget per rank with vLLM's planner as a CUDA boot on the target GPU "
               "would (the attention backend vLLM's own selection picks for its "
               "compute capability and the KV dtype), then drive vLLM's v1 scheduler with "
               "fake outputs to measure how many requests of length L run at once, "
               "against the ideal of a separate state pool. Stock and E2 side by "
               "side; the record goes to docs/validation/.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="measure what the series changes: KV capacity of hybrid models",
        description="Probes that run vLLM's own code in the test venv, stock and E2.")
    parser.set_defaults(run=run)
    probes = parser.add_subparsers(dest="probe", metavar="PROBE", required=True)
    cap = probes.add_parser(
        "capacity", help="KV pool size and scheduler saturation for hybrid models",
        description=CAPACITY_DESCRIPTION)
    _add_capacity_arguments(cap)
    serve = probes.add_parser(
        "serve", help="stock vs E2 engines serving a tiny hybrid model, token for token",
        description="Serve a tiny random-weight Qwen3-Next model with stock and E2 vLLM "
                    "(the local e2 env, or --docker images on DOCKER_HOST) and compare "
                    "output token ids request by request: prompts of block-1, block and "
                    "block+1 tokens, a shared prefix, more requests than fit (preemption), "
                    "sync and async scheduling. Any mismatch fails; records go to "
                    "docs/validation/.")
    _add_serve_arguments(serve)


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


def _add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=[], metavar="DIR|NAME",
                        help="model folder with config.json, or a zoo name (repeatable)")
    parser.add_argument("--zoo", action="store_true", help="every model in the zoo: "
                        + ", ".join(zoo_names()))
    parser.add_argument("--budget-gib", type=float, default=10.0,
                        help="KV cache memory per rank in GiB (default 10)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="(default 256)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="default: 32768, or the model's maximum if smaller")
    parser.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--mamba-cache-mode", choices=("none", "align"), default="none",
                        help="align turns prefix caching on (default none)")
    parser.add_argument("--capability", type=_capability, default=DEFAULT_CAPABILITY,
                        metavar="MAJOR.MINOR",
                        help="target GPU compute capability (default 8.6, an RTX 3090; "
                             "9.0: H100/H200)")
    parser.add_argument("--lengths", type=_lengths, default=DEFAULT_LENGTHS,
                        help="workload request lengths (default 128,1024,4096,16384,32768)")
    parser.add_argument("--python", type=Path, metavar="PATH",
                        help="python of a vLLM venv (default: e2 env's cpu venv, made or "
                             "reused)")
    parser.add_argument("--vllm-path", type=Path, metavar="DIR",
                        help="with --python: an overlaid copy of vllm to run as E2 (default: "
                             "e2 env's view)")
    parser.add_argument("--stock-only", action="store_true", help="skip the E2 side")
    parser.add_argument("--boot", action="store_true",
                        help="also boot the engine on each model (dummy weights) and record its "
                             "'KV cache size: N tokens' line, stock and E2 (here: --tp 1)")
    parser.add_argument("--docker", action="store_true",
                        help="with --boot: boot the engine images on DOCKER_HOST (the GPU host)")
    _add_engine_image_arguments(parser)
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="where records go (default docs/validation)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.add_argument("--baseline", action="store_true",
                        help="run the whole scenario matrix (every zoo model; 10 GiB, 256 and "
                             "1024 seqs, KV auto and fp8, mamba none and align; Qwen3.5-27B "
                             "at TP 4, 6 GiB, 64 seqs), stock and E2, resuming from "
                             ".e2/results/capacity-matrix/; write docs/capacity-baseline.md "
                             "and .png")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.set_defaults(options=CapacityOptions)


def _add_engine_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The stock/E2 image pair and GPUs of the probes' --docker paths (the GPU host)."""
    parser.add_argument("--stock-image", metavar="REF",
                        help="stock engine image (--docker; default: image.base of series.yaml)")
    parser.add_argument("--e2-image", metavar="REF",
                        help="E2 engine image (--docker; default: vllm-e2:<version>-<digest12>)")
    parser.add_argument("--gpus", metavar="all|IDS", help="--docker: GPUs for the engines "
                        "(docker run --gpus; 'all' or comma-separated ids)")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docker", action="store_true",
                        help="run the engines in images through the Docker SDK (DOCKER_HOST, "
                             "ssh:// included) instead of the local e2 env")
    _add_engine_image_arguments(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES, metavar="N",
                        help="each engine's KV cache (--kv-cache-memory-bytes; default "
                             f"{KV_CACHE_BYTES}: small, so the oversubscribed case preempts; "
                             f"must hold {MAX_MODEL_LEN} tokens)")
    parser.add_argument("--mode", action="append", choices=ALL_MODES, dest="modes",
                        help="mode to run (repeatable; default: sync and async "
                             "scheduling, and align, the chunked-prefill cases on a model whose "
                             "state block is finer than stock's; the CPU engine turns async "
                             "off, so there its boot only confirms that; gate and gate-fp8, "
                             "only when named: Qwen3.5-0.8B with dummy weights, as served by "
                             "default, the GPU gate of make probe-gpu)")
    parser.add_argument("--gate-scale", type=float, default=1.0, metavar="F",
                        help="gate modes on the CPU: every prompt length times F (0 < F <= 1), "
                             "for a shorter run (default 1; below 0.4 stock's 640-token CPU "
                             "block is longer than the shared prefix: no hits to compare)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="where the JSON and Markdown go (default docs/validation)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.set_defaults(options=ServeOptions)


def _check_numbers(probe: CapacityOptions) -> None:
    if probe.budget_gib <= 0:
        raise E2Error(f"--budget-gib {probe.budget_gib}: must be positive")
    if probe.tp < 1:
        raise E2Error(f"--tp {probe.tp}: must be at least 1")
    if probe.max_num_seqs < 1:
        raise E2Error(f"--max-num-seqs {probe.max_num_seqs}: must be at least 1")


def _check_options(probe: CapacityOptions) -> None:
    _check_numbers(probe)
    if (probe.docker or probe.stock_image or probe.e2_image or probe.gpus) and not probe.boot:
        raise E2Error("--docker, --stock-image, --e2-image and --gpus go with --boot")
    if (probe.stock_image or probe.e2_image or probe.gpus) and not probe.docker:
        raise E2Error("--stock-image, --e2-image and --gpus go with --docker")
    if probe.baseline and (probe.model or probe.boot or probe.stock_only or probe.no_record):
        raise E2Error("--baseline runs its own scenario matrix on the whole zoo, "
                      "both sides", hint="drop --model, --boot, --stock-only and "
                      "--no-record; --capability picks the target GPU")


def _capacity(options: GlobalOptions, probe: CapacityOptions) -> int:
    project = options.project
    _check_options(probe)
    if probe.baseline:
        return run_baseline(options, probe)
    specs = list(probe.model) + (zoo_names() if probe.zoo else [])
    if not specs:
        raise E2Error("no model given", hint="--model DIR|NAME (repeatable) or --zoo")
    models = list(dict.fromkeys(resolve_model(spec) for spec in specs))
    runtime = make_runtime(options, probe.python, probe.vllm_path, probe.stock_only)
    if runtime.view is None:
        console.warn(f"E2 side skipped: {runtime.why_no_view}; running stock only")
    settings = Settings(probe.budget_gib, probe.tp, probe.max_num_seqs, probe.max_model_len,
                        probe.kv_dtype, probe.mamba_cache_mode, tuple(probe.lengths),
                        probe.capability)
    images = (boot_images(project, probe.gpus, probe.stock_image, probe.e2_image)
              if probe.boot and probe.docker else None)  # reach it first
    per_model = run_all(runtime, models, settings)
    if probe.boot:
        boot_all(runtime, models, settings, per_model, images)
    record = probe_record(project, probe, runtime, per_model)
    if probe.json:
        console.out.print_json(json.dumps(record))
    else:
        print_tables(per_model)
    if not probe.no_record:
        write_record(project, probe.results, record)
    if record["leaks"]:
        raise E2Error("blocks leaked after every request finished:\n  "
                      + "\n  ".join(record["leaks"]))
    return 0


def run(options: GlobalOptions, probe: CapacityOptions | ServeOptions) -> int:
    if isinstance(probe, CapacityOptions):
        return _capacity(options, probe)
    return run_serve(options, probe)
