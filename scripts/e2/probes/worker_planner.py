"""The capacity worker's KV cache plan: the VllmConfig a CUDA boot on the target
has, the per-layer KV cache specs it builds, and the engine core's planning from
those specs to the boot line's ``KV cache size: N tokens``.

Runs inside the vLLM venv beside capacity_worker.py, which imports it as a
top-level module (the script's folder is on sys.path; the venv has no e2
package): stdlib and vllm imports only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_target import ProbeInputError, select_backend

GIB = 1 << 30


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


def check_tp(config: dict, tp: int) -> None:
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
        **e2_attention_fields(vllm_config, backend),
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
    specs, n_attn, n_state = _layer_specs(hf_text, attention, state)
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


def e2_attention_fields(vllm_config: Any, backend: Any) -> dict[str, Any]:
    """What E2's Attention.get_kv_cache_spec adds to the spec for the planner (the
    backend's natural block and the like); nothing on stock vLLM."""
    try:
        from vllm.v1.core.state_pool.planner import attention_kernel_fields
    except ImportError:  # stock vLLM
        return {}
    return attention_kernel_fields(vllm_config, backend)


def _layer_specs(hf_text: Any, attention: Any, state: Any) -> tuple[dict[str, Any], int, int]:
    """Each decoder layer's spec under the name the model gives the layer, and the
    counts of attention and state layers (both must be there)."""
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
    return specs, n_attn, n_state


def plan(vllm_config: Any, backend: Any, specs: dict[str, Any],
         budget_bytes: int) -> tuple[Any, dict]:
    """The engine core's _initialize_kv_caches steps from the specs to the boot line."""
    from vllm.v1.core.kv_cache_utils import (
        _pool_bytes_per_block,
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    register_all_kvcache_specs(vllm_config)
    tp = vllm_config.parallel_config.tensor_parallel_size
    layout = _kv_cache_layout(vllm_config, backend, specs)
    try:
        configs = get_kv_cache_configs(vllm_config, [dict(specs) for _ in range(tp)],
                                       [budget_bytes] * tp)
    except ValueError as exc:
        if "To serve at least one request" not in str(exc):
            raise
        raise _budget_too_small(vllm_config, specs, budget_bytes) from None
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
        # The backend's natural block E2's attention spec carries (None on stock vLLM).
        "e2_attention_block_size": next(
            (getattr(spec, "e2_natural_block_size", None) for spec in specs.values()
             if isinstance(spec, FullAttentionSpec)), None),
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


def _kv_cache_layout(vllm_config: Any, backend: Any, specs: dict[str, Any]) -> Any:
    """The layout every rank's backends accept (the attention backend + the state
    layers' backend), resolved as the engine core does before planning."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    tp = vllm_config.parallel_config.tensor_parallel_size
    backends = [backend]
    backends += list({spec.mamba_type.get_class() for spec in specs.values()
                      if isinstance(spec, MambaSpec)})
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vllm_config, [names] * tp, specs.values())


def _budget_too_small(vllm_config: Any, specs: dict[str, Any],
                      budget_bytes: int) -> ProbeInputError:
    """The input error for a budget below one request of max_model_len, naming the
    least budget that holds one."""
    from vllm.v1.core.kv_cache_utils import (
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
        get_kv_cache_groups,
    )

    groups = get_kv_cache_groups(vllm_config, dict(specs))
    needed = (_max_memory_usage_bytes_from_groups(vllm_config, groups)
              + _pool_bytes_per_block(groups))  # plus the pool's null block
    return ProbeInputError(
        f"a budget of {budget_bytes / GIB:g} GiB per rank is too small for one "
        f"request of max_model_len {vllm_config.model_config.max_model_len}: it "
        f"needs at least {needed / GIB:.4f} GiB", min_budget_gib=needed / GIB)
