# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the workers' block tables a plan makes them allocate,
outside the KV cache budget, counted as the runners size them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.utils.math_utils import cdiv
from vllm.v1.core.state_pool.plan import group_blocks_per_page
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

# Int32 block ids.
BLOCK_ID_BYTES = torch.int32.itemsize
# Backends whose metadata builder keeps every request's kernel blocks in one
# more int32 buffer of max_num_seqs * cdiv(max_model_len, kernel block), a
# block table in all but name, allocated with the builders after the KV cache
# (FlashInferMetadataBuilder.paged_kv_indices; TRITON_FLASHINFER wraps it).
PAGE_INDEX_BACKENDS = frozenset({"FLASHINFER", "TRITON_FLASHINFER"})


def block_tables_per_group(vllm_config: VllmConfig) -> int:
    """Device tables a runner keeps per group: Model Runner V2's BlockTables
    two (the staged one and the gathered one the forward reads), the V1
    runner's MultiGroupBlockTable one (its pinned copy is host memory)."""
    return 2 if vllm_config.use_v2_model_runner else 1


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
