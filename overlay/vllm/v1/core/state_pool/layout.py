# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: where a slab plan's blocks lie in the layer regions
upstream placed: states packed a few to a page, the slab tail past the last
page, and page 0's blocks past the null state."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.core.state_pool.plan import (
    SlabKVCacheConfig,
    slab_blocks_per_page,
    slab_groups,
    slab_tensors,
    states_per_page_of,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
