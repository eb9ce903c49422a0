# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: what a plan with attention slabs adds to upstream's.

A slab plan is a ``SlabKVCacheConfig`` whose groups and tensors are the Slab*
subclasses of upstream's: the fields are the state pool's, so upstream's
classes stay as they are, and a plan without a slab is upstream's own. The
workers address a tensor's blocks through ``num_blocks_of``, which the slab
config answers for its finer blocks and packed states.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypeVar

from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)


@dataclass
class SlabKVCacheTensor(KVCacheTensor):
    # Blocks of these layers per pool page (>1: attention viewed as the
    # pages' natural-size blocks).
    blocks_per_page: int = 1


@dataclass
class SlabKVCacheGroupSpec(KVCacheGroupSpec):
    # This group's blocks per pool page (>1: an attention slab).
    blocks_per_page: int = 1


@dataclass
class SlabKVCacheConfig(KVCacheConfig):
    slab_tail_blocks: int = 0
    """Attention slab blocks past the last pool page, cut from the planner's
    leftover memory; never a state."""

    states_per_page: int = 1
    """Request states packed in one pool page (>1: a state slab, whose state
    tensors address ``num_blocks * states_per_page`` states)."""

    slab_block_table_bytes: int = 0
    """The bytes the slab's finer blocks add to the workers' block tables on
    each rank, taken from the KV cache budget."""

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        if tensor.host_resident:
            return super().num_blocks_of(tensor)
        if isinstance(tensor, SlabKVCacheTensor) and tensor.blocks_per_page > 1:
            return self.num_blocks * tensor.blocks_per_page + self.slab_tail_blocks
        # Every other tensor of a slab plan is a state tensor.
        return self.num_blocks * self.states_per_page


_Planned = TypeVar("_Planned", KVCacheConfig, KVCacheGroupSpec, KVCacheTensor)


def as_slab(
    planned: KVCacheConfig | KVCacheGroupSpec | KVCacheTensor,
    cls: type[_Planned],
    **changes,
) -> _Planned:
    """``planned`` (upstream's config, group or tensor) as the Slab* ``cls``,
    with ``changes``."""
    values = {f.name: getattr(planned, f.name) for f in fields(planned) if f.init}
    return cls(**{**values, **changes})


def slab_blocks_per_page(kv_cache_config: KVCacheConfig) -> int:
    """Attention blocks per pool page (1: upstream's shared pool)."""
    if not isinstance(kv_cache_config, SlabKVCacheConfig):
        return 1
    sizes = {g.blocks_per_page for g in slab_groups(kv_cache_config)}
    sizes.discard(1)
    assert len(sizes) <= 1, "attention groups cut pages differently"
    return sizes.pop() if sizes else 1


def slab_groups(kv_cache_config: SlabKVCacheConfig) -> list[SlabKVCacheGroupSpec]:
    groups = kv_cache_config.kv_cache_groups
    assert all(isinstance(g, SlabKVCacheGroupSpec) for g in groups)
    return groups  # type: ignore[return-value]


def slab_tensors(kv_cache_config: SlabKVCacheConfig) -> list[SlabKVCacheTensor]:
    tensors = kv_cache_config.kv_cache_tensors
    assert all(isinstance(t, SlabKVCacheTensor) for t in tensors)
    return tensors  # type: ignore[return-value]


def group_blocks_per_page(group: KVCacheGroupSpec) -> int:
    """An attention slab group's blocks per pool page (1: any other group)."""
    return group.blocks_per_page if isinstance(group, SlabKVCacheGroupSpec) else 1


def blocks_per_pool_page(
    kv_cache_config: KVCacheConfig, group: KVCacheGroupSpec
) -> int:
    """How many of ``group``'s blocks one pool page holds: an attention slab's
    blocks, or packed states; 1 in upstream's pool."""
    if not isinstance(kv_cache_config, SlabKVCacheConfig):
        return 1
    if group_blocks_per_page(group) > 1:
        return group_blocks_per_page(group)
    if isinstance(group.kv_cache_spec, MambaSpec):
        return kv_cache_config.states_per_page
    return 1


def slab_num_blocks(kv_cache_config: KVCacheConfig) -> int:
    """The attention slab's blocks, tail included (0: upstream's pool)."""
    k = slab_blocks_per_page(kv_cache_config)
    if k == 1:
        return 0
    assert isinstance(kv_cache_config, SlabKVCacheConfig)
    return kv_cache_config.num_blocks * k + kv_cache_config.slab_tail_blocks


def state_num_blocks(kv_cache_config: KVCacheConfig) -> int:
    """The packed states (0: a state takes a page, or upstream's pool)."""
    m = states_per_page_of(kv_cache_config)
    return kv_cache_config.num_blocks * m if m > 1 else 0


def states_per_page_of(kv_cache_config: KVCacheConfig) -> int:
    """Request states per pool page (1: one a page, as upstream)."""
    if isinstance(kv_cache_config, SlabKVCacheConfig):
        return kv_cache_config.states_per_page
    return 1
