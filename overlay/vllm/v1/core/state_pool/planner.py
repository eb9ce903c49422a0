# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the plan's last step (attention cut into slabs, with
packed states, the slab tail and the block tables' share of the budget),
whether a model can have one, and `align` mode's state block."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.state_pool.layout import add_slab_tail, pack_states, slab_tail_blocks
from vllm.v1.core.state_pool.plan import (
    SlabKVCacheConfig,
    SlabKVCacheGroupSpec,
    SlabKVCacheTensor,
    as_slab,
    slab_blocks_per_page,
)
from vllm.v1.core.state_pool.report import log_slab_capacity
from vllm.v1.core.state_pool.tables import PAGE_INDEX_BACKENDS, block_table_bytes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

logger = init_logger(__name__)


def config_ineligibility(vllm_config: VllmConfig) -> str | None:
    """Why this configuration keeps upstream's shared pool whatever the
    model's groups, or None. Read where the `align` state block is chosen
    (align_state_block_size) and again when the pool is planned, so both
    decide alike: features that address every group's blocks by one id
    space (KV connectors, HiSparse, decode/prefill context parallel) and MLA
    attention, which the slab does not cut."""
    from vllm import envs

    if not envs.VLLM_E2_STATE_POOL:
        return "VLLM_E2_STATE_POOL=0"
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector addresses all groups by one block id space"
    if vllm_config.attention_config.hisparse_config is not None:
        return "HiSparse"
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1:
        return "decode context parallel"
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        return "prefill context parallel"
    model_config = vllm_config.model_config
    if model_config is not None and model_config.use_mla:
        return "MLA attention"
    if not vllm_config.scheduler_config.scheduler_reserve_full_isl:
        # Admission counts the decode ahead only where the whole prompt must
        # fit; chunk by chunk, upstream's coarse block's slack would be lost.
        return "admission chunk by chunk (scheduler_reserve_full_isl off)"
    return None


def slab_ineligibility(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> str | None:
    """Why this model keeps upstream's shared pool, or None when it can slab:
    config_ineligibility, then what only the planned groups tell (hidden-state
    layers, Mamba mode ``all``, layouts whose blocks hold several layers).
    """
    reason = config_ineligibility(vllm_config)
    if reason is not None:
        return reason
    groups = kv_cache_config.kv_cache_groups
    state = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    attention = [g for g in groups if type(g.kv_cache_spec) is FullAttentionSpec]
    if not state or not attention:
        return "not a hybrid attention/state model"
    if len(state) + len(attention) != len(groups):
        return "a KV cache group is neither full attention nor Mamba state"
    modes = {g.kv_cache_spec.mamba_cache_mode for g in state}
    if not modes <= {"none", "align"}:
        return f"mamba_cache_mode {'/'.join(sorted(modes))}"
    if kv_cache_config.kv_cache_groups and any(
        t.host_resident for t in kv_cache_config.kv_cache_tensors
    ):
        return "host-resident KV cache tensors"
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if layout.is_block_outermost:
        return f"KV cache layout {layout.name} packs several layers per block"
    if len({g.kv_cache_spec.block_size for g in attention}) > 1:
        return "attention groups of different block sizes"
    natural = natural_block_size(attention)
    if natural is None:
        return "the attention backend's natural block size is unknown"
    for group in attention:
        spec = group.kv_cache_spec
        if spec.page_size_padded is not None:
            return "padded attention pages"
        if spec.block_size % natural or spec.block_size == natural:
            return (
                f"attention block {spec.block_size} is not a multiple of "
                f"{natural} above it"
            )
    return None


def natural_block_size(attention: list[KVCacheGroupSpec]) -> int | None:
    """The backend's smallest kernel block, from the specs the workers sent
    (attention_kernel_fields); None where they name none, or several."""
    sizes = {g.kv_cache_spec.e2_natural_block_size for g in attention}
    return sizes.pop() if len(sizes) == 1 else None


def backend_natural_block(backend_cls: type[AttentionBackend]) -> int | None:
    """The block attention slabs are cut at: the backend's smallest kernel
    block (16 for FlashAttention, 32 on the CPU backend); None for a backend
    the slab does not serve (SLABLESS_BACKENDS)."""
    from vllm.v1.attention.backend import MultipleOf

    if backend_cls.get_name() in SLABLESS_BACKENDS:
        return None
    return min(
        s.base if isinstance(s, MultipleOf) else s
        for s in backend_cls.get_supported_kernel_block_sizes()
    )


def attention_kernel_fields(
    vllm_config: VllmConfig, backend_cls: type[AttentionBackend]
) -> dict[str, Any]:
    """The E2 fields of a full attention spec (backend_kernel_fields), for a
    hybrid model where the slab is not off by configuration; none otherwise."""
    model_config = vllm_config.model_config
    if (
        model_config is None
        or not model_config.is_hybrid
        or config_ineligibility(vllm_config) is not None
    ):
        return {}
    return backend_kernel_fields(vllm_config, backend_cls)


def backend_kernel_fields(
    vllm_config: VllmConfig, backend_cls: type[AttentionBackend]
) -> dict[str, Any]:
    """What a full attention spec tells the planner, which runs where the
    backend is never chosen (the engine core): the backend's natural block
    (backend_natural_block), the kernel block it runs upstream's attention
    block at, chosen as the worker chooses it (select_common_block_size;
    FlashAttention runs Qwen3.5-0.8B's 544 tokens as they are, FlashInfer as
    17 blocks of 32), which sets how wide upstream's block tables are
    (block_table_growth), and whether the backend keeps a page index beside
    them (PAGE_INDEX_BACKENDS). None for a backend the slab does not serve."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import select_common_block_size

    natural = backend_natural_block(backend_cls)
    if natural is None:
        return {}
    with set_current_vllm_config(vllm_config):
        upstream_kernel = select_common_block_size(
            vllm_config.cache_config.block_size, [backend_cls]
        )
    return {
        "e2_natural_block_size": natural,
        "e2_upstream_kernel_block_size": upstream_kernel,
        "e2_attention_page_index": backend_cls.get_name() in PAGE_INDEX_BACKENDS,
    }


# In mamba `align` mode a request's state is kept at every state block
# boundary, and prefix-cache hits land only there.
ALIGN_STATE_BLOCK_TOKENS = 256


def align_state_block_size(
    vllm_config: VllmConfig, attention_block: int, natural: int | None
) -> int:
    """The state block of mamba `align` mode: upstream's is the raised
    attention block (Qwen3.5-0.8B: 544 tokens); with attention slabs it can be
    ALIGN_STATE_BLOCK_TOKENS, a multiple of the natural attention block, so
    prefix hits come at least that often (``natural``: the backend's natural
    block). Settings that keep upstream's pool whatever the layout keep
    upstream's state block too."""
    if natural is None or config_ineligibility(vllm_config) is not None:
        return attention_block
    block = ALIGN_STATE_BLOCK_TOKENS // natural * natural
    return block if natural <= block < attention_block else attention_block


def set_align_state_block(
    vllm_config: VllmConfig, backend_cls: type[AttentionBackend]
) -> None:
    """Mamba `align` mode's state block (align_state_block_size) on the cache
    config, for the worker. Where it is finer than the attention block, the
    prefix-cache keys are taken every natural attention block, and that is
    said (prefix_match_unit) rather than left to the groups' GCD: the worker's
    prefill checkpoints (MambaPrefillCheckpointBuilder) read the unit from the
    config, the scheduler from the planned groups, and both must agree."""
    cache_config = vllm_config.cache_config
    attention_block = cache_config.block_size
    natural = backend_natural_block(backend_cls)
    cache_config.mamba_block_size = align_state_block_size(
        vllm_config, attention_block, natural
    )
    if (
        cache_config.mamba_block_size != attention_block
        and cache_config.prefix_match_unit is None
    ):
        cache_config.prefix_match_unit = natural


def cut_attention_slabs(
    vllm_config: VllmConfig,
    kv_cache_configs: list[KVCacheConfig],
    spare_bytes: list[int],
) -> list[KVCacheConfig]:
    """Every rank's plan with attention slabs (cut_attention_slab), and the
    slab tail the budget's remainder holds on every rank (``spare_bytes``:
    each rank's memory left below one more page; see slab_tail_blocks).

    The workers allocate their block tables after the KV cache, outside its
    budget, and the slab's finer blocks make them wider than upstream's
    (block_table_growth: Qwen3.5-0.8B on FlashAttention at 262,144 tokens and
    1,024 sequences, 124 MiB more, 137 MiB in `align` mode). That growth comes
    out of the budget, so the engine stays within what upstream's would use:
    from the remainder first, then from pages, the same number on every rank.
    Under num_gpu_blocks_override the pages are the user's: nothing is taken."""
    configs = _cut_attention_slabs(vllm_config, kv_cache_configs, spare_bytes)
    keep_upstream_state_block(vllm_config, configs)
    if configs and vllm_config.model_config is not None:
        # Every rank plans alike; the scheduler runs on the first's plan.
        log_slab_capacity(vllm_config, configs[0])
    return configs


def _cut_attention_slabs(
    vllm_config: VllmConfig,
    kv_cache_configs: list[KVCacheConfig],
    spare_bytes: list[int],
) -> list[KVCacheConfig]:
    original = kv_cache_configs
    growth = [0] * len(kv_cache_configs)
    if vllm_config.cache_config.num_gpu_blocks_override is None:
        growth = [block_table_growth(vllm_config, c) for c in kv_cache_configs]
    spare_bytes = [spare - g for spare, g in zip(spare_bytes, growth)]
    took_pages = min(spare_bytes, default=0) < 0
    if took_pages:
        fewer = _fewer_pages(vllm_config, kv_cache_configs, spare_bytes)
        if fewer is None:
            logger.info_once(
                "E2 state pool off: its block tables leave no page; "
                "upstream's shared pool."
            )
            return [upstream_state_blocks(c) for c in kv_cache_configs]
        kv_cache_configs, spare_bytes = fewer
    packed = [
        pack_states(vllm_config, cut_attention_slab(vllm_config, c))
        for c in kv_cache_configs
    ]
    configs = [c for c, _ in packed]
    if took_pages and not _one_request_fits(vllm_config, configs):
        # Upstream's plan passed its check; with pages gone to the tables
        # a max_model_len request may no longer fit the slab.
        logger.info_once(
            "E2 state pool off: its block tables leave no room for one "
            "max_model_len request; upstream's shared pool."
        )
        return [upstream_state_blocks(c) for c in original]
    spare_bytes = [spare + freed for spare, (_, freed) in zip(spare_bytes, packed)]
    tail = min(
        (slab_tail_blocks(c, spare) for c, spare in zip(configs, spare_bytes)),
        default=0,
    )
    configs = [add_slab_tail(c, tail) for c in configs] if tail else configs
    return [
        replace(c, slab_block_table_bytes=g) if isinstance(c, SlabKVCacheConfig) else c
        for c, g in zip(configs, growth)
    ]


def keep_upstream_state_block(
    vllm_config: VllmConfig, kv_cache_configs: list[KVCacheConfig]
) -> None:
    """Plans that keep upstream's pool after set_align_state_block chose a
    finer `align` state block (a refusal only the planned groups show, or the
    tables' fallback): this process's cache config goes back to upstream's
    too, as upstream_state_blocks did for the plan, so the block the engine
    reports and the unit the scheduler hashes at are upstream's. A
    prefix_match_unit equal to the natural block is taken for the one
    set_align_state_block set."""
    cache_config = vllm_config.cache_config
    if cache_config.mamba_cache_mode != "align" or any(
        slab_blocks_per_page(c) > 1 for c in kv_cache_configs
    ):
        return
    attention = {
        g.kv_cache_spec.block_size
        for c in kv_cache_configs
        for g in c.kv_cache_groups
        if not isinstance(g.kv_cache_spec, MambaSpec)
    }
    if len(attention) != 1 or cache_config.mamba_block_size in attention:
        return
    (cache_config.mamba_block_size,) = attention
    natural = natural_block_size(
        [
            g
            for g in kv_cache_configs[0].kv_cache_groups
            if type(g.kv_cache_spec) is FullAttentionSpec
        ]
    )
    if natural is not None and cache_config.prefix_match_unit == natural:
        cache_config.prefix_match_unit = None


def _fewer_pages(
    vllm_config: VllmConfig,
    kv_cache_configs: list[KVCacheConfig],
    spare_bytes: list[int],
) -> tuple[list[KVCacheConfig], list[int]] | None:
    """The ranks' plans re-planned with as many fewer pages as the most
    overdrawn rank's ``spare_bytes`` needs, and the bytes each has left; None
    where that leaves no page besides the null page."""
    from vllm.v1.core.kv_cache_utils import (
        _pool_bytes_per_block,
        get_kv_cache_config_from_groups,
    )

    page_bytes = [_pool_bytes_per_block(c.kv_cache_groups) for c in kv_cache_configs]
    fewer = max(
        cdiv(-spare, page) for spare, page in zip(spare_bytes, page_bytes) if page
    )
    num_blocks = (
        max(c.num_blocks for c in kv_cache_configs if c.kv_cache_groups) - fewer
    )
    if num_blocks < 2:
        return None
    configs = [
        get_kv_cache_config_from_groups(
            vllm_config, c.kv_cache_groups, num_blocks * page
        )
        if c.kv_cache_groups
        else c
        for c, page in zip(kv_cache_configs, page_bytes)
    ]
    return configs, [
        spare + fewer * page for spare, page in zip(spare_bytes, page_bytes)
    ]


def _one_request_fits(
    vllm_config: VllmConfig, slab_configs: list[KVCacheConfig]
) -> bool:
    """Whether every rank's slab plan (before its tail) still holds one
    max_model_len request."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    return all(
        get_max_concurrency_for_kv_cache_config(vllm_config, c) >= 1
        for c in slab_configs
        if c.kv_cache_groups
    )


# Backends the slab does not serve: FlexAttention sizes its block map by the
# pool's page count where slab block ids run past it, and keeps an index of
# batched tokens times blocks. Such a model keeps upstream's pool.
SLABLESS_BACKENDS = frozenset({"FLEX_ATTENTION"})


def block_table_growth(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Bytes the slab plan of ``kv_cache_config`` (an upstream plan) adds to a
    rank's block tables over upstream's: attention at the natural block, and
    in `align` mode states at the finer state block, take more entries per
    request than upstream's one block of a state's size (0: upstream's pool)."""
    if vllm_config.model_config is None:
        return 0
    slab = cut_attention_slab(vllm_config, kv_cache_config)
    if slab_blocks_per_page(slab) == 1:
        return 0
    upstream = upstream_state_blocks(kv_cache_config)
    return block_table_bytes(vllm_config, slab) - block_table_bytes(
        vllm_config, upstream
    )


def cut_attention_slab(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> KVCacheConfig:
    """Attention groups and tensors at the backend's natural block size.

    A pool page (one state, or ``k`` attention blocks) keeps its bytes; the
    attention layers' views just see ``k`` times as many blocks of ``1/k`` the
    size, which is exact for layer-outermost layouts where a page is dense.
    """
    reason = slab_ineligibility(vllm_config, kv_cache_config)
    if reason is not None:
        if reason != "VLLM_E2_STATE_POOL=0":
            logger.info_once("E2 state pool off: %s; upstream's shared pool.", reason)
        return upstream_state_blocks(kv_cache_config)
    natural = natural_block_size(
        [
            g
            for g in kv_cache_config.kv_cache_groups
            if type(g.kv_cache_spec) is FullAttentionSpec
        ],
    )
    assert natural is not None
    groups: list[SlabKVCacheGroupSpec] = []
    slab_layers: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            groups.append(as_slab(group, SlabKVCacheGroupSpec))
            continue
        k = spec.block_size // natural
        groups.append(
            as_slab(
                group,
                SlabKVCacheGroupSpec,
                kv_cache_spec=replace(spec, block_size=natural),
                blocks_per_page=k,
            )
        )
        slab_layers.update((name, k) for name in group.layer_names)
    tensors: list[SlabKVCacheTensor] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        k = {slab_layers.get(name, 1) for name in tensor.layers}
        assert len(k) == 1, "a tensor mixes attention and state layers"
        k = k.pop()
        assert tensor.block_stride % k == 0
        tensors.append(
            as_slab(
                tensor,
                SlabKVCacheTensor,
                block_stride=tensor.block_stride // k,
                blocks_per_page=k,
            )
        )
    return as_slab(
        kv_cache_config,
        SlabKVCacheConfig,
        kv_cache_groups=groups,
        kv_cache_tensors=tensors,
    )


def upstream_state_blocks(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """A plan refused the slab after align_state_block_size chose a finer
    state block than the attention block (a refusal only the planned groups
    show): the `align` state groups get upstream's block back, the attention
    block, so the pool is upstream's in full (its scheduler block, hash size
    and prefix-hit points). Both runners read the state block from the plan."""
    groups = kv_cache_config.kv_cache_groups
    attention = {
        g.kv_cache_spec.block_size
        for g in groups
        if not isinstance(g.kv_cache_spec, MambaSpec)
    }
    if len(attention) != 1:
        return kv_cache_config
    (block,) = attention
    if not any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.mamba_cache_mode == "align"
        and g.kv_cache_spec.block_size != block
        for g in groups
    ):
        return kv_cache_config
    logger.info_once(
        "E2 state pool off: `align` states back at the %d-token block.", block
    )
    return replace(
        kv_cache_config,
        kv_cache_groups=[
            replace(g, kv_cache_spec=replace(g.kv_cache_spec, block_size=block))
            if isinstance(g.kv_cache_spec, MambaSpec)
            and g.kv_cache_spec.mamba_cache_mode == "align"
            else g
            for g in groups
        ],
    )
