"""KV-capacity worker: runs inside a vLLM venv (stock or with the e2 view first on
PYTHONPATH) and prints one JSON object on stdout. Not imported by the driver.

Two parts, both through vLLM's own code, no weights and no accelerator:

* planner: the per-layer KV cache specs as a CUDA boot builds them, then
  ``get_kv_cache_configs`` for the budget, then the boot line's
  ``KV cache size: N tokens`` (``get_kv_cache_capacity``).
* workload: the real v1 ``Scheduler`` on that KV cache config, fed fake model
  outputs, measuring how many requests of total length L run at once.

Assumed GPU attention backend: FLASH_ATTN (FA3), the first choice of
``_get_backend_priorities`` on SM90 (H100/H200) for non-MLA models; its kernel
block sizes are ``MultipleOf(16)``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
# The output token every fake step samples; not an EOS of any zoo model.
FAKE_TOKEN = 7
# Tokens each request generates after its prompt (ignore_eos, exact length).
MAX_DECODE = 16


class ProbeInputError(Exception):
    """Bad input the driver reports as a user error (exit status 2)."""

    def __init__(self, message: str, **extra: Any):
        super().__init__(message)
        self.extra = extra


# Compiled parts of the CUDA engine image that the CPU wheel lacks but whose
# presence vLLM's selection code checks: the CUDA platform's op library (imported
# at module level) and the FlashAttention 2/3 extensions; FA4 is Python files the
# image ships (``_vllm_fa4_cutedsl_C`` in cmake/external_projects/vllm_flash_attn.cmake).
IMAGE_EXTENSIONS = ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C",
                    "vllm.vllm_flash_attn._vllm_fa3_C")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--capability", default="8.6",
                        help="target GPU compute capability, MAJOR.MINOR")
    parser.add_argument("--jobs", type=Path, required=True,
                        help="JSON list of runs: {out, budget_gib, tp, max_num_seqs, "
                             "max_model_len, kv_dtype, mamba_cache_mode, lengths}")
    return parser.parse_args()


@dataclass(frozen=True)
class Job:
    """One run: a KV cache plan and its workloads; the result goes to ``out``."""

    out: Path
    budget_gib: float
    tp: int
    max_num_seqs: int
    max_model_len: int
    kv_dtype: str
    mamba_cache_mode: str
    lengths: tuple[int, ...]
    max_num_batched_tokens: int = 8192
    max_requests: int = 0  # cap on requests per workload run (0: max_num_seqs)

    @classmethod
    def from_json(cls, data: dict) -> Job:
        return cls(**{**data, "out": Path(data["out"]),
                      "lengths": tuple(int(n) for n in data["lengths"])})


# ---------------------------------------------------------------- target GPU


def parse_capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise ProbeInputError(f"--capability {text}: expected MAJOR.MINOR, "
                              "e.g. 8.6") from None
    return major, minor


def load_model_classes(archs: list[str]) -> None:
    """Import the model's module on the CPU platform: on a CUDA platform its
    imports call compiled CUDA ops that the CPU wheel does not have."""
    from vllm.model_executor.models import ModelRegistry

    for arch in archs:
        ModelRegistry._try_load_model_cls(arch)


def emulate_cuda(capability: str) -> Any:
    """Make vLLM's CUDA platform, at ``capability``, the current platform.

    Every loaded vLLM module that bound the CPU platform is pointed at it too, so
    all of vLLM sees one platform, as on a CUDA host. Only the device query is
    replaced; every choice below it (backend priorities, FA version, kernel block
    sizes) is vLLM's own code reading that capability.
    """
    import types

    major, minor = parse_capability(capability)
    for name in IMAGE_EXTENSIONS:
        sys.modules.setdefault(name, types.ModuleType(name))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    target = DeviceCapability(major, minor)

    class TargetCudaPlatform(CudaPlatformBase):
        # The target host has a GPU for every rank of the run (set per run).
        num_gpus = 1

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return target

        @classmethod
        def device_count(cls) -> int:
            return cls.num_gpus

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"CUDA device of compute capability {capability} (planned on the CPU)"

    platform = TargetCudaPlatform()
    previous = platforms.current_platform
    platforms._current_platform = platform
    platforms.current_platform = platform
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "current_platform", None) is previous:
            # a vLLM module's own binding, which ModuleType does not declare
            module.current_platform = platform  # type: ignore[attr-defined]
    # Attention backends loaded with the model ran their platform branches on the
    # CPU platform (fa_utils imports its CUDA kernels only on CUDA): run them again.
    for name in [n for n in sys.modules if n.startswith("vllm.v1.attention.backends.")]:
        importlib.reload(sys.modules[name])
    import vllm.vllm_flash_attn.flash_attn_interface as fa_interface

    fa_interface.FA4_AVAILABLE, fa_interface.FA4_UNAVAILABLE_REASON = True, None
    return platform


def select_backend(vllm_config: Any) -> tuple[Any, dict]:
    """The attention backend a decoder attention layer of this model gets at boot,
    with the candidates and why the others were rejected."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    head_size = model_config.get_head_size()
    with set_current_vllm_config(vllm_config):
        # Attention.__init__ passes the default dtype, which is the model's.
        backend = get_attn_backend(head_size, model_config.dtype, cache_config.cache_dtype)
        selector = AttentionSelectorConfig(
            head_size=head_size, dtype=model_config.dtype,
            kv_cache_dtype=cache_config.cache_dtype, block_size=None,
            use_batch_invariant=False)
        valid, rejected = current_platform.get_valid_backends(
            current_platform.get_device_capability(), selector)
        sizes = backend.get_supported_kernel_block_sizes()
        preferred = backend.get_preferred_block_size(cache_config.DEFAULT_BLOCK_SIZE)
    chosen = next((c for c in valid if c.backend_class is backend), None)
    # A package the engine image has but this venv lacks would hide a backend of
    # higher priority and change the choice: refuse rather than record a wrong one.
    missing = {b.name: r for b, (priority, r) in rejected.items()
               if chosen is not None and priority < chosen.priority
               and any(x.startswith(("ImportError", "ModuleNotFoundError", "OSError"))
                       for x in r)}
    if missing:
        raise RuntimeError(f"backends of higher priority than {backend.get_name()} could "
                           f"not be imported here: {missing}")
    capability = current_platform.get_device_capability()
    return backend, {
        "name": backend.get_name(),
        "class": f"{backend.__module__}.{backend.__qualname__}",
        "capability": f"{capability.major}.{capability.minor}",
        "kernel_block_sizes": [f"MultipleOf({s.base})" if isinstance(s, MultipleOf)
                               else s for s in sizes],
        "preferred_block_size": preferred,
        "candidates": [c.backend.name for c in sorted(valid, key=lambda c: c.priority)],
        "rejected": {b.name: r for b, (_, r) in rejected.items()},
    }


# ---------------------------------------------------------------- config


def _check_model(args: argparse.Namespace) -> dict:
    from vllm.model_executor.models import ModelRegistry

    config_file = args.model / "config.json"
    if not config_file.is_file():
        raise ProbeInputError(f"{args.model}: no config.json in the model folder")
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


def _check_tp(config: dict, tp: int) -> None:
    """Head counts TP must divide, named the way config.json names them; checked
    before vLLM sees the config so the message names the key."""
    text = config.get("text_config") or config
    keys = ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads",
            "mamba_num_heads", "mamba_n_heads")
    for key in keys:
        value = text.get(key)
        if isinstance(value, int) and value % tp:
            raise ProbeInputError(f"tensor parallel size {tp} does not divide {key}="
                                  f"{value} in config.json")


def build_config(job: Job, model: Path) -> tuple[Any, Any, dict]:
    """A VllmConfig as a CUDA boot on the target has it before the KV cache is
    planned, with the attention backend that boot selects."""
    from vllm.config import set_current_vllm_config
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    type(current_platform).num_gpus = job.tp
    engine_args = EngineArgs(
        model=str(model), skip_tokenizer_init=True, load_format="dummy",
        tensor_parallel_size=job.tp, max_num_seqs=job.max_num_seqs,
        max_model_len=job.max_model_len,
        max_num_batched_tokens=job.max_num_batched_tokens,
        kv_cache_dtype=job.kv_dtype,
        enable_prefix_caching=job.mamba_cache_mode == "align",
        mamba_cache_mode=job.mamba_cache_mode,
        # Text requests only: the vision tower holds no KV cache, and its
        # processor would need a tokenizer.
        language_model_only=True)
    vllm_config = engine_args.create_engine_config()
    if not vllm_config.model_config.is_hybrid:
        raise ProbeInputError(f"{vllm_config.model_config.architecture} is not a hybrid "
                              "attention/state-space model; the probe covers hybrids only")
    backend, backend_facts = select_backend(vllm_config)
    # update_block_size_for_backend, phases 1 and 2, with the selected backend
    # (the engine finds it on the model's attention layers).
    cache_config = vllm_config.cache_config
    cache_config.block_size = current_platform._preferred_block_size_for_backends(
        [backend], CacheConfig.DEFAULT_BLOCK_SIZE, vllm_config)
    with set_current_vllm_config(vllm_config):
        current_platform._align_hybrid_block_size(vllm_config, backend)
    backend_facts["hybrid_block_size"] = cache_config.block_size
    return vllm_config, backend, backend_facts


# ---------------------------------------------------------------- specs


def layer_kinds(hf_text: Any) -> list[str]:
    """'attention' / 'state' / 'other' per decoder layer, from the config's own list."""
    kinds = getattr(hf_text, "layers_block_type", None) or getattr(hf_text, "layer_types",
                                                                   None)
    if kinds is None:
        raise ProbeInputError("the model config has neither layers_block_type nor "
                              "layer_types; cannot tell attention from state layers")
    mapping = {"attention": "attention", "full_attention": "attention",
               "mamba": "state", "linear_attention": "state"}
    return [mapping.get(kind, "other") for kind in kinds]


def build_specs(vllm_config: Any, backend: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-layer specs exactly as Attention/MambaBase.get_kv_cache_spec return them
    (then the backend's customize_spec), plus the per-request facts behind them."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, get_kv_quant_mode

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    hf_text = model_config.hf_text_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                                   model_config=model_config)
    shapes = tuple(tuple(s) for s in model_cls.get_mamba_state_shape_from_config(vllm_config))
    dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config))
    # GDN layers (Qwen3.5, Qwen3-Next) name linear heads; Mamba2 layers do not.
    mamba_type = (MambaAttentionBackendEnum.GDN_ATTN
                  if hasattr(hf_text, "linear_num_value_heads")
                  else MambaAttentionBackendEnum.MAMBA2)
    attention = backend.customize_spec(FullAttentionSpec(
        block_size=cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config),
        kv_quant_mode=get_kv_quant_mode(cache_config.cache_dtype)))
    state = MambaSpec(
        shapes=shapes, dtypes=dtypes, block_size=cache_config.mamba_block_size,
        page_size_padded=cache_config.mamba_page_size_padded, mamba_type=mamba_type,
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_speculative_blocks=vllm_config.num_speculative_tokens)
    specs: dict[str, Any] = {}
    kinds = layer_kinds(hf_text)
    for index, kind in enumerate(kinds):
        if kind == "attention":
            specs[f"model.layers.{index}.self_attn.attn"] = attention
        elif kind == "state":
            specs[f"model.layers.{index}.mixer"] = state
    n_attn, n_state = kinds.count("attention"), kinds.count("state")
    if len(kinds) != hf_text.num_hidden_layers or not n_attn or not n_state:
        raise ProbeInputError(f"the layer list names {n_attn} attention and {n_state} state "
                              f"layers of {len(kinds)}, num_hidden_layers is "
                              f"{hf_text.num_hidden_layers}")
    states_per_request = ((2 if cache_config.mamba_cache_mode == "align" else 1)
                          + vllm_config.num_speculative_tokens)
    facts = {
        "architecture": model_config.architecture,
        "model_dtype": str(model_config.dtype).removeprefix("torch."),
        "attention_layers": n_attn, "state_layers": n_state,
        "kv_heads_per_rank": attention.num_kv_heads, "head_size": attention.head_size,
        "kv_dtype": str(attention.dtype).removeprefix("torch."),
        "state_shapes": [list(s) for s in shapes],
        "state_dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "mamba_type": mamba_type.name,
        "attention_page_bytes": attention.page_size_bytes,
        "state_bytes_per_layer": state.real_page_size_bytes,
        "state_page_bytes_padded": state.page_size_bytes,
        "kv_bytes_per_token": n_attn * attention.page_size_bytes // attention.block_size,
        "states_per_request": states_per_request,
        "state_bytes_per_request": n_state * state.real_page_size_bytes * states_per_request,
    }
    return specs, facts


# ---------------------------------------------------------------- planner


def plan(vllm_config: Any, backend: Any, specs: dict[str, Any],
         budget_bytes: int) -> tuple[Any, dict]:
    """The engine core's _initialize_kv_caches steps from the specs to the boot line."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import (
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_kv_cache_groups,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import MambaSpec

    register_all_kvcache_specs(vllm_config)
    tp = vllm_config.parallel_config.tensor_parallel_size
    # The layout every rank's backends accept (the attention backend + the state
    # layers' backend), resolved as the engine core does before planning.
    backends = [backend]
    backends += list({spec.mamba_type.get_class() for spec in specs.values()
                      if isinstance(spec, MambaSpec)})
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [names] * tp, specs.values())
    try:
        configs = get_kv_cache_configs(vllm_config, [dict(specs) for _ in range(tp)],
                                       [budget_bytes] * tp)
    except ValueError as exc:
        if "To serve at least one request" not in str(exc):
            raise
        groups = get_kv_cache_groups(vllm_config, dict(specs))
        needed = (_max_memory_usage_bytes_from_groups(vllm_config, groups)
                  + _pool_bytes_per_block(groups))  # plus the pool's null block
        raise ProbeInputError(
            f"a budget of {budget_bytes / GIB:g} GiB per rank is too small for one "
            f"request of max_model_len {vllm_config.model_config.max_model_len}: it "
            f"needs at least {needed / GIB:.4f} GiB", min_budget_gib=needed / GIB) from None
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    groups = scheduler_config.kv_cache_groups
    # The engine core sets the global block size to the smallest cacheable group's.
    vllm_config.cache_config.block_size = min(
        [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        or [g.kv_cache_spec.block_size for g in groups])
    tokens, concurrency = get_kv_cache_capacity(vllm_config, scheduler_config)
    pool_block_bytes = _pool_bytes_per_block(groups)
    result = {
        "budget_bytes": budget_bytes,
        "kv_cache_layout": layout.name,
        "block_size": vllm_config.cache_config.block_size,
        "mamba_block_size": vllm_config.cache_config.mamba_block_size,
        "mamba_page_size_padded": vllm_config.cache_config.mamba_page_size_padded,
        "num_groups": len(groups),
        # E2 records the backend's natural block here (None on stock vLLM).
        "e2_attention_block_size": getattr(vllm_config.cache_config,
                                           "e2_attention_block_size", None),
        "groups": [{"kind": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
                    "block_size": g.kv_cache_spec.block_size,
                    "blocks_per_page": getattr(g, "blocks_per_page", 1),
                    "page_bytes": g.kv_cache_spec.page_size_bytes} for g in groups],
        "pool_block_bytes": pool_block_bytes,
        "num_blocks": scheduler_config.num_blocks,
        "kv_cache_tokens": tokens,
        "max_concurrency": concurrency,
    }
    return scheduler_config, result


# ---------------------------------------------------------------- workload


def ideal_concurrency(facts: dict, budget_bytes: int, length: int, max_num_seqs: int) -> int:
    per_request = facts["state_bytes_per_request"] + length * facts["kv_bytes_per_token"]
    return min(max_num_seqs, budget_bytes // per_request)


def run_workload(vllm_config: Any, kv_cache_config: Any, length: int, count: int,
                 shared_prefix: bool, ideal: int) -> dict:
    """Submit ``count`` requests of total length ``length`` and step to completion.

    Preemptions below the ideal are those of a step that began, or was admitting,
    with fewer requests than the ideal holds: memory that should have sufficed."""
    import copy

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    config = copy.deepcopy(vllm_config)
    # Lift the per-step token budget to the whole workload: admission is then
    # bounded only by the KV pool (full prompt reserved up front) and
    # max_num_seqs, which is what saturation measures.
    config.scheduler_config.max_num_batched_tokens = count * length
    config.scheduler_config.max_num_scheduled_tokens = count * length
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    scheduler = Scheduler(vllm_config=config, kv_cache_config=copy.deepcopy(kv_cache_config),
                          structured_output_manager=StructuredOutputManager(config),
                          log_stats=False, block_size=block_size,
                          hash_block_size=hash_block_size)
    hasher = None
    if config.cache_config.enable_prefix_caching:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(hash_block_size, sha256)
    decode = min(MAX_DECODE, max(1, length // 8))
    prompt_len = length - decode
    prefix_len = prompt_len // 2 if shared_prefix else 0
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    requests = []
    for i in range(count):
        # Distinct per request after the prefix; token 0 is the shared prefix.
        tokens = [0] * prefix_len + [1000 + i] * (prompt_len - prefix_len)
        requests.append(Request(request_id=f"r{i}", prompt_token_ids=tokens,
                                sampling_params=params, pooling_params=None,
                                block_hasher=hasher))
    for request in requests:
        scheduler.add_request(request)
    pool = scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    peak = peak_before_preemption = preemptions = below_ideal = steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        if steps > 200_000:
            raise RuntimeError("workload did not finish in 200000 steps")
        running_before = len(scheduler.running)
        output = scheduler.schedule()
        preempted = len(output.preempted_req_ids or ())
        preemptions += preempted
        running = len(scheduler.running)
        if preempted and max(running_before, running + preempted) < ideal:
            below_ideal += preempted
        peak = max(peak, running)
        if preemptions == 0:
            peak_before_preemption = max(peak_before_preemption, running)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([FAKE_TOKEN] if done_prefill else [])
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))
    leaked = free_at_start - pool.get_num_free_blocks()
    return {"requests": count, "prompt_tokens": prompt_len, "decode_tokens": decode,
            "shared_prefix_tokens": prefix_len, "steps": steps,
            "saturation": peak_before_preemption, "peak_running": peak,
            "preemptions": preemptions, "preemptions_below_ideal": below_ideal,
            "leaked_blocks": leaked,
            "finished": sum(1 for r in requests if r.is_finished())}


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
    _check_tp(config, job.tp)
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
        config = _check_model(args)
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
