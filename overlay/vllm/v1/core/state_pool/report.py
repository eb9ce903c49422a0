# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the boot line that reports a slab plan beside
upstream's (attention tokens and request states, each true on its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.state_pool.layout import slab_head_start
from vllm.v1.core.state_pool.plan import (
    SlabKVCacheConfig,
    slab_blocks_per_page,
    slab_groups,
    slab_num_blocks,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


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
