# SPDX-License-Identifier: Apache-2.0
"""vLLM E2: exact-size request state for hybrid models (VLLM_E2_STATE_POOL).

Upstream plans a hybrid model with one pool of equal pages: the attention block
is raised until one attention page holds one Mamba/GDN state (Qwen3.5-0.8B:
544 tokens instead of the backend's 16), so every request rounds its attention
up to that coarse block. Here the pool keeps upstream's state-sized pages, and
a page handed to attention is cut into ``blocks_per_page`` blocks of the
backend's natural size (a slab):

* a request's state takes one page per state group, as upstream, or, where a
  state padded to whole blocks wastes more than 1% (Qwen3.5-0.8B: 2.6%), a
  slot of a page that packs a few states (a state slab, ``pack_states``);
* attention takes natural-size blocks; a slab page returns to the pool once
  all its blocks are free, so memory still flows between state and attention
  as the workload changes, which a fixed split sized for max_num_seqs cannot.

Three pieces, each used at one place of upstream's code:

* ``cut_attention_slabs``: the planner's last step (``get_kv_cache_configs``);
  it rewrites the attention groups and their tensors within the layer regions
  upstream placed (packed states and the slab tail included).
* ``PagePool`` / ``SlabPool``: the coordinator's block pools; admission is
  counted in pages (``pages_needed``).
* ``KVCacheTensor.blocks_per_page`` / ``KVCacheGroupSpec.blocks_per_page``:
  what the workers read to view each attention layer as natural blocks.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.request import Request

logger = init_logger(__name__)


# ---------------------------------------------------------------- planning


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
    natural = natural_block_size(vllm_config, attention)
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


def natural_block_size(
    vllm_config: VllmConfig, attention: list[KVCacheGroupSpec]
) -> int | None:
    """The backend's smallest kernel block: from the specs the workers sent
    (set where _align_hybrid_block_size ran), else from this process's cache
    config (planning in-process, as the capacity probe does)."""
    sizes = {g.kv_cache_spec.e2_natural_block_size for g in attention}
    sizes.discard(None)
    if len(sizes) > 1:
        return None
    return sizes.pop() if sizes else vllm_config.cache_config.e2_attention_block_size


# In mamba `align` mode a request's state is kept at every state block
# boundary, and prefix-cache hits land only there.
ALIGN_STATE_BLOCK_TOKENS = 256


def align_state_block_size(vllm_config: VllmConfig, attention_block: int) -> int:
    """The state block of mamba `align` mode: upstream's is the raised
    attention block (Qwen3.5-0.8B: 544 tokens); with attention slabs it can be
    ALIGN_STATE_BLOCK_TOKENS, a multiple of the natural attention block, so
    prefix hits come at least that often. Settings that keep upstream's pool
    whatever the layout keep upstream's state block too."""
    natural = vllm_config.cache_config.e2_attention_block_size
    if natural is None or config_ineligibility(vllm_config) is not None:
        return attention_block
    block = ALIGN_STATE_BLOCK_TOKENS // natural * natural
    return block if natural <= block < attention_block else attention_block


def set_align_state_block(vllm_config: VllmConfig) -> None:
    """Mamba `align` mode's state block (align_state_block_size) on the cache
    config, for the worker. Where it is finer than the attention block, the
    prefix-cache keys are taken every natural attention block, and that is
    said (prefix_match_unit) rather than left to the groups' GCD: the worker's
    prefill checkpoints (MambaPrefillCheckpointBuilder) read the unit from the
    config, the scheduler from the planned groups, and both must agree."""
    cache_config = vllm_config.cache_config
    attention_block = cache_config.block_size
    cache_config.mamba_block_size = align_state_block_size(vllm_config, attention_block)
    if (
        cache_config.mamba_block_size != attention_block
        and cache_config.prefix_match_unit is None
    ):
        cache_config.prefix_match_unit = cache_config.e2_attention_block_size


def cut_attention_slabs(
    vllm_config: VllmConfig,
    kv_cache_configs: list[KVCacheConfig],
    spare_bytes: list[int],
) -> list[KVCacheConfig]:
    """Every rank's plan with attention slabs (cut_attention_slab), and the
    slab tail the budget's remainder holds on every rank (``spare_bytes``:
    each rank's memory left below one more page; see slab_tail_blocks)."""
    packed = [
        pack_states(vllm_config, cut_attention_slab(vllm_config, c))
        for c in kv_cache_configs
    ]
    configs = [c for c, _ in packed]
    spare_bytes = [spare + freed for spare, (_, freed) in zip(spare_bytes, packed)]
    tail = min(
        (slab_tail_blocks(c, spare) for c, spare in zip(configs, spare_bytes)), default=0
    )
    return [add_slab_tail(c, tail) for c in configs] if tail else configs


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
        vllm_config,
        [g for g in kv_cache_config.kv_cache_groups if type(g.kv_cache_spec) is FullAttentionSpec],
    )
    assert natural is not None
    groups: list[KVCacheGroupSpec] = []
    slab_layers: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            groups.append(group)
            continue
        k = spec.block_size // natural
        groups.append(
            replace(
                group,
                kv_cache_spec=replace(spec, block_size=natural),
                blocks_per_page=k,
            )
        )
        slab_layers.update((name, k) for name in group.layer_names)
    tensors = []
    for tensor in kv_cache_config.kv_cache_tensors:
        k = {slab_layers.get(name, 1) for name in tensor.layers}
        assert len(k) == 1, "a tensor mixes attention and state layers"
        k = k.pop()
        if k == 1:
            tensors.append(tensor)
            continue
        assert tensor.block_stride % k == 0
        tensors.append(
            replace(tensor, block_stride=tensor.block_stride // k, blocks_per_page=k)
        )
    return replace(kv_cache_config, kv_cache_groups=groups, kv_cache_tensors=tensors)


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
    logger.info_once("E2 state pool off: `align` states back at the %d-token block.", block)
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
    groups = kv_cache_config.kv_cache_groups
    state_bytes = {
        g.kv_cache_spec.real_page_size_bytes
        for g in groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    }
    if (
        regions is None
        or len(state_bytes) != 1
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
        for t in kv_cache_config.kv_cache_tensors
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
    assert regions is not None
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


def slab_num_blocks(kv_cache_config: KVCacheConfig) -> int:
    """The attention slab's blocks, tail included (0: upstream's pool)."""
    k = slab_blocks_per_page(kv_cache_config)
    if k == 1:
        return 0
    return kv_cache_config.num_blocks * k + kv_cache_config.slab_tail_blocks


def state_num_blocks(kv_cache_config: KVCacheConfig) -> int:
    """The packed states (0: a state takes a page, or upstream's pool)."""
    m = kv_cache_config.states_per_page
    return kv_cache_config.num_blocks * m if m > 1 else 0


def slab_copy_id_shift(coordinator: KVCacheCoordinator, pool: BlockPool) -> int:
    """What a copy's block ids of ``pool`` travel to the worker shifted by:
    pool pages as they are, attention slab blocks past the pages, packed
    states past the slab (copy_kv_cache_blocks_inplace splits them apart)."""
    config = coordinator.kv_cache_config
    if pool is coordinator.slab_pool:
        return config.num_blocks
    if pool is coordinator.state_slab:
        return config.num_blocks + slab_num_blocks(config)
    return 0


def log_slab_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, max_concurrency: float
) -> None:
    """The boot line's E2 companion: attention tokens and request states, each
    true on its own, and the concurrency that counts both."""
    k = slab_blocks_per_page(kv_cache_config)
    if k == 1:
        return
    usable = kv_cache_config.num_blocks - 1  # page 0 is the null page
    held_pages, peak_pages = request_state_pages(vllm_config, kv_cache_config)
    natural = page_bytes = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        page_bytes = max(
            page_bytes, len(group.layer_names) * spec.page_size_bytes * group.blocks_per_page
        )
        if group.blocks_per_page > 1:
            natural = spec.block_size
    # Every slab block but those of page 0, the null page.
    attention_tokens = (slab_num_blocks(kv_cache_config) - k) * natural
    peak = f" ({peak_pages} while it crosses an align boundary)" if peak_pages > held_pages else ""
    m = kv_cache_config.states_per_page
    logger.info_once(
        "vLLM E2 state pool: %s pages of %.2f MiB; attention up to %s tokens "
        "(%d-token blocks, %d per page); request state %d %s%s, at most %s "
        "requests; maximum concurrency for %s tokens per request: %.2fx "
        "(state and attention counted)",
        f"{usable:,}",
        page_bytes / (1 << 20),
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


def slab_blocks_per_page(kv_cache_config: KVCacheConfig) -> int:
    """Attention blocks per pool page (1: upstream's shared pool)."""
    sizes = {g.blocks_per_page for g in kv_cache_config.kv_cache_groups}
    sizes.discard(1)
    assert len(sizes) <= 1, "attention groups cut pages differently"
    return sizes.pop() if sizes else 1


# ---------------------------------------------------------------- admission

# Decode tokens a request's admission keeps room for, beyond its prompt: all of
# a short max_tokens, at most this much of a long one. Upstream's coarse
# attention block hid some decode growth in its slack; natural blocks do not,
# so without this a full pool preempts as soon as decodes cross a block.
DECODE_HEADROOM_TOKENS = 128


def decode_headroom(request: Request) -> int:
    """Cache slots ``request`` may still take beyond its ``num_tokens``, up to
    DECODE_HEADROOM_TOKENS: one per output token still to come except the
    last, which is sampled and never fed (a request of P prompt tokens and
    ``max_tokens`` M ends holding P + M - 1)."""
    return max(
        0, min(request.max_tokens - request.num_output_tokens - 1, DECODE_HEADROOM_TOKENS)
    )


def align_boundary_states(coordinator: KVCacheCoordinator) -> int:
    """States a request may hold beyond one per group: in mamba `align`
    mode a state group takes a second block when a request crosses a block
    boundary (its first decode after the prefill checkpoint included) before
    the old one is freed. Upstream's admission does not count it and
    over-admits, then preempts."""
    return sum(
        1
        for manager in coordinator.single_type_managers
        if isinstance(manager.kv_cache_spec, MambaSpec)
        and manager.kv_cache_spec.mamba_cache_mode == "align"
    )


def boundary_states(coordinator: KVCacheCoordinator, request: Request) -> int:
    """States ``request`` may take at align-mode block boundaries within its
    decode headroom: one per align group before its first decode (the state
    leaves the prefill's checkpoint block) or when the headroom crosses a state
    block boundary, and none otherwise."""
    return _reserve(coordinator, [request])[1]


def decode_growth_blocks(coordinator: KVCacheCoordinator, request: Request) -> int:
    """Slab blocks a running request may still take for its decode headroom."""
    return _reserve(coordinator, [request])[0]


def reserve_running_requests(
    coordinator: KVCacheCoordinator,
    running: Iterable[Request],
    add: bool = False,
    lookahead_tokens: int = 0,
) -> None:
    """Set (or, with ``add``, raise) what admission keeps for ``running``: the
    slab blocks of their decode headroom (and the speculative lookahead slots
    each step allocates past it) and their align-mode boundary states. What is
    counted here is also what bound_running_reserve bounds the states from."""
    gaps: list[int] = []
    blocks, states = _reserve(coordinator, running, lookahead_tokens, gaps)
    if add:
        blocks += coordinator.slab_reserved_blocks
        coordinator.counted_states += states
        states += coordinator.reserved_states
        # Gaps are kept as the advance at which their state is taken.
        for gap in gaps:
            bisect.insort(coordinator.boundary_gaps, gap + coordinator.reserve_advance)
    else:
        coordinator.counted_states = states
        gaps.sort()
        coordinator.boundary_gaps = gaps
        coordinator.reserve_advance = 0
    coordinator.slab_reserved_blocks = blocks
    coordinator.reserved_states = states


def bound_running_reserve(
    coordinator: KVCacheCoordinator,
    running: list[Request],
    lookahead_tokens: int = 0,
    tokens_per_step: int = 1,
) -> None:
    """A step's bound on what ``running`` may still take, without a pass over
    the batch: the reserve last set, plus what one step's scheduling can add.
    A request's horizon (its tokens and decode headroom) moves on by at most
    the ``tokens_per_step`` a step appends while its held blocks grow to cover
    what was scheduled, so its slab blocks still to take grow by at most
    ``1 + tokens_per_step // block_size`` a group. Its boundary states are the
    ones last counted plus one for each align group whose horizon has since
    moved past the gap it had left to its next state block boundary, and at
    most one per align group. Admission counts the reserve exactly only where
    the bound would refuse a request (count_reserve_exactly), so what is
    admitted is what an exact count admits."""
    coordinator.slab_reserved_blocks += len(running) * sum(
        1 + tokens_per_step // manager.block_size for manager in _slab_managers(coordinator)
    )
    coordinator.reserve_advance += tokens_per_step
    coordinator.reserved_states = min(
        len(running) * len(_align_block_sizes(coordinator)),
        coordinator.counted_states
        + bisect.bisect_left(coordinator.boundary_gaps, coordinator.reserve_advance),
    )
    coordinator.reserve_exact = False
    coordinator.reserve_running = (running, lookahead_tokens)


def count_reserve_exactly(coordinator: KVCacheCoordinator) -> bool:
    """Replace a bound on the running requests' reserve by its exact count;
    False where it was exact already (upstream's pool too): a refusal stands."""
    if coordinator.reserve_exact:
        return False
    running, lookahead_tokens = coordinator.reserve_running
    reserve_running_requests(coordinator, running, lookahead_tokens=lookahead_tokens)
    coordinator.reserve_exact = True
    return True


def _reserve(
    coordinator: KVCacheCoordinator,
    running: Iterable[Request],
    lookahead_tokens: int = 0,
    gaps: list[int] | None = None,
) -> tuple[int, int]:
    """Slab blocks and boundary states ``running`` may still take, and into
    ``gaps``, for each align group of a decoding request that takes no boundary
    state, the tokens its horizon may still move before it does. The
    scheduler runs it over the whole batch where the bound would refuse, so
    the groups are sorted out once and decode_headroom and the boundary test
    are inlined: this loop is the reserve's whole cost in a saturated step."""
    slab_blocks = [(m.req_to_blocks, m.block_size) for m in _slab_managers(coordinator)]
    align_blocks = _align_block_sizes(coordinator)
    max_model_len = coordinator.max_model_len
    blocks = states = 0
    for request in running:
        # Request.num_tokens and num_output_tokens, read without their property
        # calls: they were 40% of this loop.
        num_tokens = len(request._all_token_ids)
        num_output_tokens = len(request._output_token_ids)
        headroom = request.max_tokens - num_output_tokens - 1
        if headroom > DECODE_HEADROOM_TOKENS:
            headroom = DECODE_HEADROOM_TOKENS
        elif headroom < 0:
            headroom = 0
        horizon = num_tokens + headroom + lookahead_tokens
        if horizon > max_model_len:
            horizon = max_model_len
        request_id = request.request_id
        for req_to_blocks, block_size in slab_blocks:
            held = req_to_blocks.get(request_id)
            need = -(-horizon // block_size) - (len(held) if held else 0)
            if need > 0:
                blocks += need
        if not align_blocks:
            continue
        if num_output_tokens == 0:
            # Its first decode leaves the prefill's checkpoint block.
            states += len(align_blocks)
            continue
        # A state block holds the state of up to ``size`` tokens (the manager
        # keeps cdiv(tokens, size) blocks' worth): the state moves on only
        # when the tokens ahead pass the end of the block the request is in.
        end = num_tokens + headroom
        for size in align_blocks:
            gap = -(-num_tokens // size) * size - end
            if gap < 0:
                states += 1
            elif gaps is not None:
                gaps.append(gap)
    return blocks, states


def _slab_managers(coordinator: KVCacheCoordinator) -> list:
    return [
        m for m in coordinator.single_type_managers if m.block_pool is coordinator.slab_pool
    ]


def _align_block_sizes(coordinator: KVCacheCoordinator) -> list[int]:
    return [
        m.kv_cache_spec.block_size
        for m in coordinator.single_type_managers
        if isinstance(m.kv_cache_spec, MambaSpec) and m.kv_cache_spec.mamba_cache_mode == "align"
    ]


def request_constant(manager: SingleTypeKVCacheManager, max_model_len: int) -> bool:
    """A state group whose request holds one state block from admission to its
    end: mamba cache mode ``none`` with one block covering max_model_len and no
    speculative blocks. Once the request holds it, a step has nothing to free,
    count or allocate there."""
    spec = manager.kv_cache_spec
    return (
        isinstance(spec, MambaSpec)
        and spec.mamba_cache_mode == "none"
        and manager.num_speculative_blocks == 0
        and manager.block_size >= max_model_len
    )


def step_groups(coordinator: KVCacheCoordinator) -> None:
    """Set what ``groups_of`` reads: every group as (index, manager), the groups
    that are not request-constant, and one request-constant group's blocks by
    request (None if there is no such group: every group is visited)."""
    groups = tuple(enumerate(coordinator.single_type_managers))
    constant = [
        manager
        for _, manager in groups
        if request_constant(manager, coordinator.max_model_len)
    ]
    coordinator.all_groups = groups
    coordinator.varying_groups = tuple(
        (i, manager) for i, manager in groups if manager not in constant
    )
    coordinator.constant_state_blocks = constant[0].req_to_blocks if constant else None


def groups_of(
    coordinator: KVCacheCoordinator, request_id: str
) -> tuple[tuple[int, SingleTypeKVCacheManager], ...]:
    """The groups a step of this request visits. Upstream visits every group
    for every running request each step; the request-constant state groups
    only answer "nothing" once the request holds its states (allocated
    together at admission, freed together), and were the most of a saturated
    decode step's allocation time (Qwen3.5-0.8B: three of its four groups)."""
    held = coordinator.constant_state_blocks
    if held is not None and held.get(request_id):
        return coordinator.varying_groups
    return coordinator.all_groups


def allocate_step_blocks(
    coordinator: KVCacheCoordinator,
    request_id: str,
    num_tokens: int,
    num_tokens_main_model: int,
) -> tuple[list[KVCacheBlock], ...]:
    """The coordinator's allocate_new_blocks over ``groups_of``: a skipped
    group gets no new block, as its manager would answer (a slab model has no
    cross-attention group, slab_ineligibility)."""
    new_blocks: list[list[KVCacheBlock]] = [[] for _ in coordinator.all_groups]
    for i, manager in groups_of(coordinator, request_id):
        new_blocks[i] = manager.allocate_new_blocks(
            request_id, num_tokens, num_tokens_main_model
        )
    return tuple(new_blocks)


def slab_blocks_to_allocate(
    coordinator: KVCacheCoordinator,
    request_id: str,
    num_tokens: int,
    new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
    total_computed_tokens: int,
    num_local_computed_tokens: int,
    num_tokens_main_model: int,
    apply_admission_cap: bool,
    prefill_end: int,
) -> int:
    """The coordinator's get_num_blocks_to_allocate with attention slabs: state
    groups count pages, slab groups count blocks that are then turned into the
    pages they take (pages_needed), and admission (``apply_admission_cap``)
    adds what the running requests may still take. Every call of a saturated
    step comes here, so the groups are told apart by pool, once each: a slab
    model has only full attention and state groups (slab_ineligibility)."""
    slab, state_slab = coordinator.slab_pool, coordinator.state_slab
    assert slab is not None
    pages = slab_new = state_new = 0
    # Free cached blocks a prefix hit touches spend their pages, not new ones.
    slab_touched: list[KVCacheBlock] = []
    state_touched: list[KVCacheBlock] = []
    for i, manager in groups_of(coordinator, request_id):
        needed = manager.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks[i],
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        pool = manager.block_pool
        if pool is not slab and pool is not state_slab:
            pages += needed
            continue
        if new_computed_blocks[i]:
            hit = [b for b in new_computed_blocks[i] if b.ref_cnt == 0 and not b.is_null]
            (slab_touched if pool is slab else state_touched).extend(hit)
            needed -= len(hit)
        if needed > 0:
            if pool is slab:
                slab_new += needed
            else:
                state_new += needed
    if apply_admission_cap:
        slab_new += coordinator.slab_reserved_blocks
        states = coordinator.reserved_states + align_boundary_states(coordinator)
        if state_slab is None:
            pages += states
        else:
            state_new += states
    if slab_new or slab_touched:
        pages += slab.pages_needed(slab_new, slab_touched)
    if state_slab is not None and (state_new or state_touched):
        pages += state_slab.pages_needed(state_new, state_touched)
    return pages


# ---------------------------------------------------------------- pools


class _PagedFreeQueue(FreeKVCacheBlockQueue):
    """The slab's free blocks, kept as bits per page instead of a linked list.

    BlockPool reaches its queue only through popleft(_n), remove, append(_n)
    and prepend_n, so overriding those keeps the per-page view exact without
    touching BlockPool's logic.

    An idle page (all k blocks free) counts as a free page of the page pool,
    so it is taken whole (activate) and never picked from block by block: the
    slab's admission count (pages_needed) depends on it. In the other pages
    (busy) an allocation takes the never-cached free blocks first, from the
    page with the fewest of them (pages empty out whole), and only then
    evicts cached ones, least recently freed first, as upstream's LRU queue.
    """

    def __init__(
        self,
        blocks: list[KVCacheBlock],
        blocks_per_page: int,
        num_pages: int,
        clock: Callable[[], int],
    ) -> None:
        super().__init__([])  # upstream's list sentinels, left empty
        self.clock = clock
        self.blocks = blocks  # the slab's, by id
        self.blocks_per_page = blocks_per_page
        self.free_in_page = [0] * num_pages
        # Each page's free blocks as bits (bit i: the page's block i), and the
        # cached ones among them: an allocation takes the lowest ids without
        # walking the page's k blocks (133 for Qwen3.5-0.8B's packed pages).
        self.free_bits = [0] * num_pages
        self.cached_bits = [0] * num_pages
        # Idle pages, the longest idle first, and when each came idle (the
        # page pool's clock): reclaim hands the longest idle back first.
        self.idle_pages: dict[int, int] = {}
        # Pages whose last block came free since the slab last looked: what a
        # free may hand back, without walking the freed blocks again.
        self.newly_idle: set[int] = set()
        # Busy pages' cached free blocks, least recently freed first.
        self.cached_free: dict[int, KVCacheBlock] = {}
        # Busy pages by their never-cached free blocks, 1..k; bit c of
        # _buckets_in_use set: some page has c. The page with the fewest is
        # then one lowest-bit lookup away.
        self.uncached_in_page = [0] * num_pages
        self.pages_with_uncached: list[set[int]] = [
            set() for _ in range(blocks_per_page + 1)
        ]
        self._buckets_in_use = 0
        self.num_uncached_free_blocks = 0  # in busy pages

    def _rebucket(self, page: int, uncached: int) -> None:
        """File busy ``page`` under its never-cached free count (0: nowhere)."""
        before = self.uncached_in_page[page]
        if before == uncached:
            return
        self.uncached_in_page[page] = uncached
        self.num_uncached_free_blocks += uncached - before
        if before:
            bucket = self.pages_with_uncached[before]
            bucket.discard(page)
            if not bucket:
                self._buckets_in_use ^= 1 << before
        if uncached:
            bucket = self.pages_with_uncached[uncached]
            if not bucket:
                self._buckets_in_use |= 1 << uncached
            bucket.add(page)

    def _cached_blocks(self, page: int, bits: int) -> Iterator[KVCacheBlock]:
        first = page * self.blocks_per_page - 1  # bit_length() counts from 1
        while bits:
            lowest = bits & -bits
            bits ^= lowest
            yield self.blocks[first + lowest.bit_length()]

    def activate(self, page: int) -> None:
        """Idle ``page`` becomes busy: its blocks can be picked."""
        del self.idle_pages[page]
        self.newly_idle.discard(page)
        cached = self.cached_bits[page]
        for block in self._cached_blocks(page, cached):
            self.cached_free[block.block_id] = block
        self._rebucket(page, self.blocks_per_page - cached.bit_count())

    def _retire(self, page: int, cached_before: int) -> None:
        """Busy ``page`` came idle: out of the picks, a free page again."""
        for block in self._cached_blocks(page, cached_before):
            del self.cached_free[block.block_id]
        self._rebucket(page, 0)
        self.idle_pages[page] = self.clock()
        self.newly_idle.add(page)

    def take_from_fullest_page(self, n: int) -> list[KVCacheBlock]:
        """Up to ``n`` never-cached free blocks of the busy page with the
        fewest such blocks but one (there must be one): pages empty out whole."""
        in_use = self._buckets_in_use
        fewest = (in_use & -in_use).bit_length() - 1
        page = next(iter(self.pages_with_uncached[fewest]))
        bits = self.free_bits[page] & ~self.cached_bits[page]
        return self._take(page, bits, min(n, fewest))

    def take_least_recently_freed_cached(self, n: int) -> list[KVCacheBlock]:
        """``n`` cached free blocks of busy pages, the least recently freed first."""
        taken = list(itertools.islice(self.cached_free.values(), n))
        for block in taken:
            self._count(block, -1)
        return taken

    def _take(self, page: int, bits: int, n: int) -> list[KVCacheBlock]:
        first = page * self.blocks_per_page - 1
        taken = []
        for _ in range(n):
            lowest = bits & -bits
            bits ^= lowest
            taken.append(self.blocks[first + lowest.bit_length()])
        self._count_n(taken, -1)
        return taken

    def remove_idle_page(self, page: int) -> list[KVCacheBlock]:
        """Take every block of idle ``page`` (all k free) and return them."""
        k = self.blocks_per_page
        assert self.free_in_page[page] == k
        del self.idle_pages[page]
        self.newly_idle.discard(page)
        self.free_bits[page] = self.cached_bits[page] = self.free_in_page[page] = 0
        self.num_free_blocks -= k
        return self.blocks[page * k : (page + 1) * k]

    def _count(self, block: KVCacheBlock, delta: int) -> None:
        self._count_n([block], delta)

    def _count_n(self, blocks: list[KVCacheBlock], delta: int) -> None:
        """Blocks come free (delta 1) or are taken (-1). A request's blocks
        come and go a page at a time: each page is moved once."""
        k = self.blocks_per_page
        cached_bits = self.cached_bits
        changed: dict[int, list[int]] = {}  # page: [bits, cached bits among them]
        for block in blocks:
            page, index = divmod(block.block_id, k)
            bit = 1 << index
            entry = changed.get(page)
            if entry is None:
                entry = changed[page] = [0, 0]
            entry[0] |= bit
            if (block.block_hash is not None) if delta > 0 else cached_bits[page] & bit:
                entry[1] |= bit
        for page, (bits, cached) in changed.items():
            if delta > 0:
                self._free(page, bits, cached)
            else:
                self._taken(page, bits, cached)
        self.num_free_blocks += len(blocks) * delta

    def _free(self, page: int, bits: int, cached: int) -> None:
        cached_before = self.cached_bits[page]
        self.free_bits[page] |= bits
        self.cached_bits[page] = cached_before | cached
        free = self.free_in_page[page] = self.free_in_page[page] + bits.bit_count()
        if free == self.blocks_per_page:
            self._retire(page, cached_before)
            return
        for block in self._cached_blocks(page, cached):
            self.cached_free[block.block_id] = block
        self._rebucket(
            page, self.uncached_in_page[page] + (bits & ~cached).bit_count()
        )

    def _taken(self, page: int, bits: int, cached: int) -> None:
        if page in self.idle_pages:
            self.activate(page)  # a prefix hit on an idle page's block
        self.free_bits[page] ^= bits
        self.cached_bits[page] ^= cached
        self.free_in_page[page] -= bits.bit_count()
        for block in self._cached_blocks(page, cached):
            del self.cached_free[block.block_id]
        self._rebucket(
            page, self.uncached_in_page[page] - (bits & ~cached).bit_count()
        )

    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """``n`` free blocks of busy pages: never-cached ones first."""
        assert self.num_uncached_free_blocks + len(self.cached_free) >= n
        taken: list[KVCacheBlock] = []
        while len(taken) < n and self.num_uncached_free_blocks:
            taken += self.take_from_fullest_page(n - len(taken))
        if len(taken) < n:
            taken += self.take_least_recently_freed_cached(n - len(taken))
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        self._count(block, -1)

    def append(self, block: KVCacheBlock) -> None:
        self._count(block, 1)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        self._count_n(blocks, 1)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        self._count_n(blocks, 1)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks by id (the slab keeps no eviction order)."""
        k = self.blocks_per_page
        return [
            self.blocks[page * k + index]
            for page, bits in enumerate(self.free_bits)
            for index in range(k)
            if bits >> index & 1
        ]

    def iter_blocks_after(
        self, cursor: KVCacheBlock | None
    ) -> Iterator[KVCacheBlock]:
        """Free blocks after ``cursor`` (by id; from the first if it is gone)."""
        free = self.get_all_free_blocks()
        yield from free[next((i + 1 for i, b in enumerate(free) if b is cursor), 0) :]


class SlabPool(BlockPool):
    """Natural-size attention blocks cut from pages of a PagePool.

    Block ``b`` lies in page ``b // k``. The slab holds a page while any of its
    blocks is in use or still cached; an idle page (all ``k`` blocks free)
    without cached blocks goes straight back, an idle page with cached blocks
    stays until the page pool or the slab itself takes it. New blocks come
    from the busy pages' never-cached free blocks (the fullest page first, so
    pages empty out whole), then their cached ones (least recently freed
    first), then new pages. The ``tail_blocks`` past the
    last page (fewer than ``k``: that page never comes idle) are the slab's
    for good.
    """

    def __init__(self, pages: PagePool, blocks_per_page: int, tail_blocks: int = 0) -> None:
        super().__init__(
            num_gpu_blocks=pages.num_gpu_blocks * blocks_per_page + tail_blocks,
            enable_caching=pages.enable_caching,
            hash_block_size=pages.hash_block_size,
            enable_kv_cache_events=pages.enable_kv_cache_events,
            metrics_collector=pages.metrics_collector,
            medium=pages.medium,
        )
        self.pages = pages
        self.blocks_per_page = blocks_per_page
        # Upstream's queue held every block; the slab starts with no page.
        # Block 0 (in the page pool's null page 0) stays the null block.
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = _PagedFreeQueue(
            self.blocks,
            blocks_per_page,
            pages.num_gpu_blocks + (1 if tail_blocks else 0),
            clock=lambda: pages.clock,
        )
        self.page_blocks: dict[int, KVCacheBlock] = {}  # held page id -> its block
        self.tail_blocks = tail_blocks
        self.free_block_queue.append_n(self.blocks[pages.num_gpu_blocks * blocks_per_page :])

    # -- pages in and out

    def _page_of(self, page_id: int) -> list[KVCacheBlock]:
        k = self.blocks_per_page
        return self.blocks[page_id * k : (page_id + 1) * k]

    def _take_pages(self, num_pages: int) -> None:
        """``num_pages`` more pages to cut blocks from. An idle page of the
        slab's and a free page of the pool count alike as free pages, so the
        choice is only what a page evicts: nothing first (a pool page that
        holds no cached state), else the least recently freed of the slab's
        longest idle page and the pool's first free page (page_to_evict)."""
        queue = self.free_block_queue
        for _ in range(num_pages):
            idle = next(iter(queue.idle_pages.items()), None)
            if idle is not None and self.pages.page_to_evict(idle[1]):
                queue.activate(idle[0])
                continue
            (page,) = self.pages.get_new_blocks(1, for_slab=self)
            self.page_blocks[page.block_id] = page
            queue.append_n(self._page_of(page.block_id))
            queue.activate(page.block_id)

    def _give_back(self, page_ids: Iterable[int]) -> None:
        pages = []
        for page_id in list(page_ids):
            for block in self.free_block_queue.remove_idle_page(page_id):
                self._maybe_evict_cached_block(block)
            pages.append(self.page_blocks.pop(page_id))
        if pages:
            BlockPool.free_blocks(self.pages, pages)

    def _give_back_uncached_idle_pages(self) -> None:
        """Hand back the pages that came idle since the last look, unless they
        hold prefix-cached blocks (those wait for reclaim)."""
        queue = self.free_block_queue
        if not queue.newly_idle:
            return
        candidates = [page for page in queue.newly_idle if page in queue.idle_pages]
        queue.newly_idle.clear()
        self._give_back(page for page in candidates if not queue.cached_bits[page])

    def reclaim(self, num_pages: int) -> int:
        """Hand up to ``num_pages`` idle pages to the page pool (evicting their
        cached blocks); returns how many were handed."""
        idle = list(itertools.islice(self.free_block_queue.idle_pages, num_pages))
        self._give_back(idle)
        return len(idle)

    @property
    def num_idle_pages(self) -> int:
        return len(self.free_block_queue.idle_pages)

    @property
    def num_tail_blocks_in_use(self) -> int:
        """Tail blocks held: the page pool's free count never sees them, so a
        leak audit adds them."""
        if not self.tail_blocks:
            return 0
        return self.tail_blocks - self.free_block_queue.free_in_page[-1]

    @property
    def num_free_blocks_in_busy_pages(self) -> int:
        idle = self.num_idle_pages * self.blocks_per_page
        return self.free_block_queue.num_free_blocks - idle

    # -- BlockPool

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        queue = self.free_block_queue
        k = self.blocks_per_page
        short = num_blocks - queue.num_uncached_free_blocks - len(queue.cached_free)
        if short > 0:
            self._take_pages(cdiv(short, k))
        # Never-cached blocks of the fullest busy pages first (pages empty out
        # whole), then cached ones, least recently freed first.
        picked = queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(picked)
        for block in picked:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return picked

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        self.pages.clock += 1
        super().free_blocks(ordered_blocks)
        self._give_back_uncached_idle_pages()

    def get_num_free_blocks(self) -> int:
        return (
            self.free_block_queue.num_free_blocks
            + self.pages.num_free_pages(for_slab=self) * self.blocks_per_page
        )

    def reset_prefix_cache(self) -> bool:
        # The page pool resets both: the slab's blocks, then the pages.
        return self.pages.reset_prefix_cache()

    def pages_needed(
        self, num_new_blocks: int, touched: Sequence[KVCacheBlock]
    ) -> int:
        """Pool pages an allocation of ``num_new_blocks`` fresh blocks after
        touching the free cached blocks ``touched`` consumes, exactly as
        ``touch`` then ``get_new_blocks`` will spend them."""
        if not num_new_blocks and not touched:
            return 0  # a decode step inside its last block: the common case
        queue = self.free_block_queue
        k = self.blocks_per_page
        pages = 0
        available = self.num_free_blocks_in_busy_pages
        if touched:
            per_page: dict[int, int] = {}
            for block in touched:
                page_id = block.block_id // k
                per_page[page_id] = per_page.get(page_id, 0) + 1
            for page_id, count in per_page.items():
                if queue.free_in_page[page_id] == k:
                    pages += 1  # an idle page, counted free by the page pool
                    available += k - count
                else:
                    available -= count
        short = num_new_blocks - available
        return pages + (-(-short // k) if short > 0 else 0)


def super_reset(pool: BlockPool) -> bool:
    """Upstream's reset, which counts used blocks against the whole id space."""
    pool.cached_block_hash_to_block = type(pool.cached_block_hash_to_block)()
    pool.cached_block_hashes_by_block.clear()
    for block in pool.blocks:
        block.reset_hash()
    if pool.metrics_collector:
        pool.metrics_collector.reset()
    if pool.enable_kv_cache_events:
        from vllm.distributed.kv_events import AllBlocksCleared

        pool.kv_event_queue.append(AllBlocksCleared())
    return True


class PagePool(BlockPool):
    """The pool of state-sized pages: states take pages (or, packed, slots of
    a state slab's pages), the attention slab takes pages for attention.
    Pages a slab holds idle count as free and are reclaimed when another
    side needs them."""

    slab: SlabPool
    state_slab: SlabPool | None = None
    # Counts frees, pool's and slabs' alike: when a free page or an idle slab
    # page came free, so the least recently freed of them is evicted first.
    clock = 0

    def attach_slab(self, blocks_per_page: int, tail_blocks: int = 0) -> SlabPool:
        self.freed_at = [0] * self.num_gpu_blocks
        self.slab = SlabPool(self, blocks_per_page, tail_blocks)
        self.slabs = [self.slab]
        self._slab_idle_pages = self.slab.free_block_queue.idle_pages
        self._state_idle_pages: set[int] = set()
        return self.slab

    def attach_state_slab(self, states_per_page: int) -> SlabPool:
        """Request states packed ``states_per_page`` to a page (pack_states)."""
        self.state_slab = SlabPool(self, states_per_page)
        self.slabs.append(self.state_slab)
        self._state_idle_pages = self.state_slab.free_block_queue.idle_pages
        return self.state_slab

    def get_num_free_blocks(self) -> int:
        # Read once per request per step by the scheduler: no property chain.
        return (
            self.free_block_queue.num_free_blocks
            + len(self._slab_idle_pages)
            + len(self._state_idle_pages)
        )

    def num_free_pages(self, for_slab: SlabPool) -> int:
        """Pages ``for_slab`` can take: free ones and the other slabs' idle ones."""
        return self.free_block_queue.num_free_blocks + sum(
            slab.num_idle_pages for slab in self.slabs if slab is not for_slab
        )

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        self.clock += 1
        blocks = list(ordered_blocks)
        for block in blocks:
            if block.pool is None or block.pool is self:  # the others route to theirs
                self.freed_at[block.block_id] = self.clock
        super().free_blocks(blocks)

    def page_to_evict(self, idle_since: int) -> bool:
        """Whether a slab's idle page, idle since ``idle_since``, is the page to
        take rather than the first of the pool's free queue: the
        queue holds its never-cached pages first, then cached ones least
        recently freed first, as upstream's."""
        queue = self.free_block_queue
        if not queue.num_free_blocks:
            return True
        head = queue.fake_free_list_head.next_free_block
        assert head is not None
        return head.block_hash is not None and idle_since <= self.freed_at[head.block_id]

    def get_new_blocks(
        self, num_blocks: int, for_slab: SlabPool | None = None
    ) -> list[KVCacheBlock]:
        """Pages off the free queue, one at a time, each time first handing
        back another slab's idle page where that is the page to evict."""
        others = [slab for slab in self.slabs if slab is not for_slab]
        pages = []
        for _ in range(num_blocks):
            idle = min(
                (
                    (since, slab)
                    for slab in others
                    for since in itertools.islice(
                        slab.free_block_queue.idle_pages.values(), 1
                    )
                ),
                default=None,
                key=lambda pair: pair[0],
            )
            if idle is not None and self.page_to_evict(idle[0]):
                idle[1].reclaim(1)
            pages += super().get_new_blocks(1)
        return pages

    def get_usage(self) -> float:
        """Pages in use, a slab page counting by its used blocks."""
        k = self.slab.blocks_per_page
        total = self.num_gpu_blocks - 1 + self.slab.tail_blocks / k
        if not total:
            return 0
        slab_free = sum(
            slab.free_block_queue.num_free_blocks / slab.blocks_per_page
            for slab in self.slabs
        )
        return 1.0 - (self.free_block_queue.num_free_blocks + slab_free) / total

    def take_events(self):  # type: ignore[no-untyped-def]
        events = super().take_events()
        for slab in self.slabs:
            events += slab.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        if any(
            slab.free_block_queue.num_free_blocks
            != len(slab.page_blocks) * slab.blocks_per_page + slab.tail_blocks
            for slab in self.slabs
        ):
            logger.warning("Failed to reset prefix cache: blocks in use")
            return False
        for slab in self.slabs:
            super_reset(slab)
            slab.reclaim(len(slab.page_blocks))
        return super().reset_prefix_cache()
