# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the plan (attention slabs, packed states, the slab
tail, `align` mode's state block) and the boot line that reports it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.state_pool.plan import (
    SlabKVCacheConfig,
    SlabKVCacheGroupSpec,
    SlabKVCacheTensor,
    as_slab,
    group_blocks_per_page,
    slab_blocks_per_page,
    slab_groups,
    slab_num_blocks,
    slab_tensors,
    states_per_page_of,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
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


# Int32 block ids.
BLOCK_ID_BYTES = torch.int32.itemsize
# Backends whose metadata builder keeps every request's kernel blocks in one
# more int32 buffer of max_num_seqs * cdiv(max_model_len, kernel block), a
# block table in all but name, allocated with the builders after the KV cache
# (FlashInferMetadataBuilder.paged_kv_indices; TRITON_FLASHINFER wraps it).
PAGE_INDEX_BACKENDS = frozenset({"FLASHINFER", "TRITON_FLASHINFER"})
# Backends the slab does not serve: FlexAttention sizes its block map by the
# pool's page count where slab block ids run past it, and keeps an index of
# batched tokens times blocks. Such a model keeps upstream's pool.
SLABLESS_BACKENDS = frozenset({"FLEX_ATTENTION"})


def block_tables_per_group(vllm_config: VllmConfig) -> int:
    """Device tables a runner keeps per group: Model Runner V2's BlockTables
    two (the staged one and the gathered one the forward reads), the V1
    runner's MultiGroupBlockTable one (its pinned copy is host memory)."""
    return 2 if vllm_config.use_v2_model_runner else 1


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


def page_index_builders(vllm_config: VllmConfig) -> int:
    """Metadata builders an attention group's page index is kept in: one per
    microbatch, and as many again for a drafter's attention (EAGLE, MTP, a
    draft model), counted whether or not its layers share the group: never
    less than the runners allocate."""
    from vllm.v1.worker.ubatch_utils import get_num_ubatches

    spec = vllm_config.speculative_config
    drafter = spec is not None and (spec.use_eagle() or spec.uses_draft_model())
    return get_num_ubatches(vllm_config.parallel_config) * (2 if drafter else 1)


def block_table_bytes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """A rank's device block tables for this plan as the runner sizes them
    (initialize_kv_cache): per group, block_tables_per_group int32 tables of
    max_num_seqs rows, each row the group's blocks in kernel blocks. The rest
    (staging, slot mappings) is sized by rows and tokens, not by blocks. An
    attention group whose backend keeps a page index (PAGE_INDEX_BACKENDS)
    adds it, sized as its builder sizes it (attention_kernel_fields)."""
    from vllm.v1.worker.block_table import get_block_table_width

    max_len = vllm_config.model_config.max_model_len
    rows = vllm_config.scheduler_config.max_num_seqs
    tables = block_tables_per_group(vllm_config)
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kernel_block = _kernel_block_size(vllm_config, group)
        width = get_block_table_width(
            spec.max_num_blocks_per_req(vllm_config, max_len),
            spec.block_size,
            kernel_block,
            token_alignment=spec.block_table_token_alignment,
        )
        total += tables * rows * width * BLOCK_ID_BYTES
        if isinstance(spec, AttentionSpec) and spec.e2_attention_page_index:
            total += (
                page_index_builders(vllm_config)
                * rows
                * cdiv(max_len, kernel_block)
                * BLOCK_ID_BYTES
            )
    return total


def _kernel_block_size(vllm_config: VllmConfig, group: KVCacheGroupSpec) -> int:
    """A slab's natural block is a kernel block, states are never split, and
    upstream's attention block runs at the kernel block the spec names
    (attention_kernel_fields; the block whole where it names none). One
    that no longer divides the block (a platform that rounded the block up
    after it was recorded, as XPU does to 64) counts the block whole: more
    table charged, never a width get_block_table_width refuses."""
    spec = group.kv_cache_spec
    if group_blocks_per_page(group) > 1 or not isinstance(spec, AttentionSpec):
        return spec.block_size
    kernel = spec.e2_upstream_kernel_block_size
    return kernel if kernel and spec.block_size % kernel == 0 else spec.block_size


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


# A state padded to whole attention blocks wastes up to a block per state
# (Qwen3.5-0.8B: 1,085,440 bytes in a 1,114,112-byte page, 2.6%); states packed
# a few to a page share that padding. Pages grow by the same factor, so the
# fewest states per page whose padding is at most STATE_PAGE_SLACK of a page.
STATE_PAGE_SLACK = 0.01
STATES_PER_PAGE = (1, 2, 4, 8)
# Bytes between packed states are a multiple of this: the state views' rows
# stay aligned for the kernels' vector loads, as upstream's padded pages are.
STATE_STRIDE_ALIGNMENT = 256


def states_per_page(state_bytes: int, block_bytes: int) -> tuple[int, int]:
    """States packed in one pool page of whole ``block_bytes`` attention
    blocks, and that page's bytes: the fewest of STATES_PER_PAGE that pad at
    most STATE_PAGE_SLACK of the page, else the least padding (1 is
    upstream's page)."""
    pages: dict[int, int] = {}
    for m in STATES_PER_PAGE:
        page = cdiv(m * state_bytes, block_bytes) * block_bytes
        if m == 1 or page % (m * STATE_STRIDE_ALIGNMENT) == 0:
            pages[m] = page
    padding = {m: 1 - m * state_bytes / page for m, page in pages.items()}
    m = next(
        (m for m, waste in padding.items() if waste <= STATE_PAGE_SLACK),
        min(padding, key=padding.__getitem__),
    )
    return m, pages[m]


def pack_states(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[KVCacheConfig, int]:
    """A slab plan with request states packed ``states_per_page`` to a page,
    and the bytes that frees below one more page (the slab tail's to take).

    The layer regions keep their bytes: they hold fewer, larger pages, each
    ``m`` states at a stride of ``page / m`` or ``k`` attention blocks. A plan
    keeps its pages where the new ones would hold no more states (a pool of a
    few pages, or a state that fills its blocks) and under
    ``num_gpu_blocks_override``, whose count is of pages as planned.
    """
    k = slab_blocks_per_page(kv_cache_config)
    regions = _layer_regions(kv_cache_config) if k > 1 else None
    if regions is None:
        return kv_cache_config, 0
    assert isinstance(kv_cache_config, SlabKVCacheConfig)
    groups = slab_groups(kv_cache_config)
    state_bytes = {
        g.kv_cache_spec.real_page_size_bytes
        for g in groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    }
    if (
        len(state_bytes) != 1
        or vllm_config.cache_config.num_gpu_blocks_override is not None
    ):
        return kv_cache_config, 0
    pages_bytes, block_bytes, layer_slots = regions
    (state,) = state_bytes
    m, page = states_per_page(state, block_bytes)
    if any(
        g.kv_cache_spec.mamba_cache_mode == "align"
        for g in groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    ):
        # In `align` mode states are prefix-cached: one a page keeps them in
        # the page pool's LRU order, where a state slab would hand out a
        # cached slot before taking a free page (stock's prefix hits at
        # 10 GiB: 17% packed, see the patch message).
        m, page = 1, cdiv(state, block_bytes) * block_bytes
    num_pages = pages_bytes // page
    # m == 1 repacks too where upstream's page is more than whole blocks
    # (the CPU backend aligns hybrid blocks to 128 tokens, not 16).
    if num_pages * m <= kv_cache_config.num_blocks:
        return kv_cache_config, 0
    blocks_per_page, stride = page // block_bytes, page // m
    # The worker tells the two kinds of copy apart by their views' block
    # counts, which differ while a page holds more blocks than states.
    assert blocks_per_page > m
    region = num_pages * page
    packed_groups = [
        replace(g, blocks_per_page=blocks_per_page)
        if g.blocks_per_page > 1
        else replace(g, kv_cache_spec=replace(g.kv_cache_spec, page_size_padded=stride))
        for g in groups
    ]
    tensors = [
        replace(
            t,
            layer_stride=region,
            size=layer_slots * region,
            **(
                {"blocks_per_page": blocks_per_page}
                if t.blocks_per_page > 1
                else {"block_stride": stride}
            ),
        )
        for t in slab_tensors(kv_cache_config)
    ]
    packed = replace(
        kv_cache_config,
        num_blocks=num_pages,
        kv_cache_groups=packed_groups,
        kv_cache_tensors=tensors,
        states_per_page=m,
    )
    return packed, (pages_bytes - region) * layer_slots


def add_slab_tail(kv_cache_config: KVCacheConfig, tail: int) -> KVCacheConfig:
    """``tail`` slab blocks past the last page: every layer's region grows by
    them, so the regions of all groups still overlay page for page, and the
    states, which never reach past the last page, keep their bytes."""
    regions = _layer_regions(kv_cache_config)
    assert regions is not None and isinstance(kv_cache_config, SlabKVCacheConfig)
    pages_bytes, block_bytes, layer_slots = regions
    region = pages_bytes + tail * block_bytes
    return replace(
        kv_cache_config,
        kv_cache_tensors=[
            replace(t, layer_stride=region, size=layer_slots * region)
            for t in kv_cache_config.kv_cache_tensors
        ],
        slab_tail_blocks=tail,
    )


def slab_tail_blocks(kv_cache_config: KVCacheConfig, spare_bytes: int) -> int:
    """Slab blocks the budget's remainder holds past the last page. The
    planner floors the budget to whole pages, which leaves up to a page in
    every layer's region idle (Qwen3.5-27B, fp8 KV, 10 GiB: 96 of a page's 98
    blocks). Tail blocks stay with the slab for good, never a state, so there
    are fewer than a page's ``k``; layouts other than each layer's pages back
    to back from byte 0 keep none."""
    k = slab_blocks_per_page(kv_cache_config)
    regions = _layer_regions(kv_cache_config) if k > 1 and spare_bytes > 0 else None
    if regions is None:
        return 0
    _, block_bytes, layer_slots = regions
    return min(k - 1, spare_bytes // (layer_slots * block_bytes))


def slab_head_start(kv_cache_config: KVCacheConfig) -> int:
    """The first attention block of page 0 a request may hold (``k``: none).

    Page 0 is every group's null page: padded and dummy rows write their
    states to state 0 and read attention block 0. Where states are packed,
    state 0 is only the page's first slot, so the attention blocks past it
    hold what a request writes there (Granite-4.0-H-Tiny, 10 GiB: 74 of a
    page's 99 blocks, the 36th request at 32,768 tokens). Where a state takes
    the whole page, or the layers' regions are not each their pages from byte
    0, none do."""
    k = slab_blocks_per_page(kv_cache_config)
    m = states_per_page_of(kv_cache_config)
    if k == 1 or m == 1 or not kv_cache_config.kv_cache_tensors:
        return k
    assert isinstance(kv_cache_config, SlabKVCacheConfig)
    tensors = slab_tensors(kv_cache_config)
    attention = {t.block_stride for t in tensors if t.blocks_per_page > 1}
    states = {t.block_stride for t in tensors if t.blocks_per_page == 1}
    if (
        len(attention) != 1
        or len(states) != 1
        or any(t.offset or t.layer_stride != tensors[0].layer_stride for t in tensors)
    ):
        return k
    (block_bytes,), (state_stride,) = attention, states
    if block_bytes * k != state_stride * m:
        return k
    return min(k, max(1, cdiv(state_stride, block_bytes)))


def _layer_regions(kv_cache_config: KVCacheConfig) -> tuple[int, int, int] | None:
    """(bytes of a layer region's pages, bytes of a slab block, layer regions) of
    a slab plan whose every layer region is its pages back to back from byte 0;
    None for any other layout."""
    tensors = kv_cache_config.kv_cache_tensors
    k = slab_blocks_per_page(kv_cache_config)
    if not tensors:
        return None
    pages_bytes = tensors[0].layer_stride
    if pages_bytes % (kv_cache_config.num_blocks * k) or any(
        t.offset or t.layer_stride != pages_bytes or t.size % pages_bytes
        for t in tensors
    ):
        return None
    block_bytes = pages_bytes // kv_cache_config.num_blocks // k
    return pages_bytes, block_bytes, tensors[0].size // pages_bytes


def log_slab_capacity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """The boot line's E2 companion: attention tokens and request states, each
    true on its own, and the concurrency that counts both."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    k = slab_blocks_per_page(kv_cache_config)
    if k == 1:
        return
    assert isinstance(kv_cache_config, SlabKVCacheConfig)
    max_concurrency = get_max_concurrency_for_kv_cache_config(
        vllm_config, kv_cache_config
    )
    usable = kv_cache_config.num_blocks - 1  # page 0 is the null page
    held_pages, peak_pages = request_state_pages(vllm_config, kv_cache_config)
    natural = page_bytes = 0
    for group in slab_groups(kv_cache_config):
        spec = group.kv_cache_spec
        page_bytes = max(
            page_bytes,
            len(group.layer_names) * spec.page_size_bytes * group.blocks_per_page,
        )
        if group.blocks_per_page > 1:
            natural = spec.block_size
    # Every slab block but page 0's null blocks.
    attention_tokens = (
        slab_num_blocks(kv_cache_config) - slab_head_start(kv_cache_config)
    ) * natural
    peak = (
        f" ({peak_pages} while it crosses an align boundary)"
        if peak_pages > held_pages
        else ""
    )
    m = kv_cache_config.states_per_page
    logger.info_once(
        "vLLM E2 state pool: %s pages of %.2f MiB (%.1f MiB of the budget left "
        "to the finer block tables); attention up to %s tokens "
        "(%d-token blocks, %d per page); request state %d %s%s, at most %s "
        "requests; maximum concurrency for %s tokens per request: %.2fx "
        "(state and attention counted)",
        f"{usable:,}",
        page_bytes / (1 << 20),
        kv_cache_config.slab_block_table_bytes / (1 << 20),
        f"{attention_tokens:,}",
        natural,
        k,
        held_pages,
        "pages" if m == 1 else f"states ({m} per page)",
        peak,
        f"{usable * m // max(held_pages, 1):,}",
        f"{vllm_config.model_config.max_model_len:,}",
        max_concurrency,
    )


def request_state_pages(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, int]:
    """States one request takes, each a pool page unless packed: while it
    runs (one per state group, and its speculative ones), and at most
    (`align` mode's boundary step holds one more per group for a step, which
    upstream's max_memory_usage_bytes counts)."""
    held = peak = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            held += 1 + spec.num_speculative_blocks
            peak += cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
    return held, peak
