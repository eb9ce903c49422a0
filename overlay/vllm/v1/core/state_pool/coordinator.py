# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the coordinator of a plan with attention slabs.

Upstream's coordinators, their pool replaced by the state pool's block pools
once constructed, with three steps of their own: the groups a request's step visits
(a request's constant state groups are skipped once it holds them), slab
blocks counted as the pages they take, and the admission reserve
(admission.py) counted in at admission.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
)
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.core.state_pool.admission import (
    align_boundary_states,
    bound_running_reserve,
    count_reserve_exactly,
    decode_headroom,
    pages_kept_for_running,
    reserve_running_requests,
)
from vllm.v1.core.state_pool.layout import slab_head_start
from vllm.v1.core.state_pool.plan import (
    SlabKVCacheConfig,
    group_blocks_per_page,
    slab_blocks_per_page,
)
from vllm.v1.core.state_pool.pools import PagePool, SlabPool
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request


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


class StatePoolCoordinator(KVCacheCoordinator):
    """Put before an upstream coordinator class (see make_state_pool_coordinator):
    the pool is a PagePool, the attention groups draw from its slab and, with
    packed states, the state groups from its state slab."""

    slab_pool: SlabPool
    state_slab: SlabPool | None

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(kv_cache_config, max_model_len, *args, **kwargs)
        self._use_state_pools()
        self.max_model_len = max_model_len
        # What the running requests may still take: slab blocks for their
        # decode headroom, align-mode boundary states (pages, or slots when
        # states are packed). Set by the scheduler before admitting, counted
        # by admission only; a bound until counted exactly (reserve_exact),
        # over the requests and lookahead in reserve_running. The states'
        # bound starts from the last count (counted_states) and adds the
        # align groups whose gap to a boundary (boundary_gaps, sorted) the
        # horizons' advance since (reserve_advance) has passed.
        self.slab_reserved_blocks = 0
        self.reserved_states = 0
        self.reserve_exact = True
        self.reserve_running: tuple[list, int] = ([], 0)
        self.counted_states = 0
        self.boundary_gaps: list[int] = []
        self.reserve_advance = 0
        # The groups as (index, manager), those that are not request-constant,
        # and one request-constant group's blocks by request (None if there is
        # no such group: every group is visited). The attention slab's groups
        # come last: a step's pages go to the state groups before the slab may
        # take a free page in place of evicting a cached block.
        self.all_groups = tuple(
            sorted(
                enumerate(self.single_type_managers),
                key=lambda group: group[1].block_pool is self.slab_pool,
            )
        )
        constant = [
            manager
            for _, manager in self.all_groups
            if request_constant(manager, max_model_len)
        ]
        self.varying_groups = tuple(
            (i, manager) for i, manager in self.all_groups if manager not in constant
        )
        self.constant_state_blocks = constant[0].req_to_blocks if constant else None

    def _use_state_pools(self) -> None:
        """Upstream's constructor gave every group one BlockPool; in its place a
        PagePool of the same pages, whose attention slab serves the attention
        groups and, with packed states, whose state slab serves the state
        groups. Nothing has been allocated yet, so only the references to the
        pool (and its null block) change hands."""
        config = self.kv_cache_config
        assert isinstance(config, SlabKVCacheConfig)
        shared = self.block_pool
        pool = PagePool(
            num_gpu_blocks=shared.num_gpu_blocks,
            enable_caching=shared.enable_caching,
            hash_block_size=shared.hash_block_size,
            enable_kv_cache_events=shared.enable_kv_cache_events,
            metrics_collector=shared.metrics_collector,
        )
        self.block_pool = pool
        self.slab_pool = pool.attach_slab(
            slab_blocks_per_page(config),
            config.slab_tail_blocks,
            slab_head_start(config),
        )
        self.state_slab = (
            pool.attach_state_slab(config.states_per_page)
            if config.states_per_page > 1
            else None
        )
        self.slab_pool.pages_kept_for_running = partial(pages_kept_for_running, self)
        for group, manager in zip(config.kv_cache_groups, self.single_type_managers):
            manager.block_pool = self._group_pool(group)
            manager._null_block = manager.block_pool.null_block
        if isinstance(self, HybridKVCacheCoordinator):
            # Upstream groups its managers for hit lookup by pool.
            self.verify_and_split_kv_cache_groups()

    def _group_pool(self, group: KVCacheGroupSpec) -> BlockPool:
        if group_blocks_per_page(group) > 1:
            return self.slab_pool
        if self.state_slab is not None and isinstance(group.kv_cache_spec, MambaSpec):
            return self.state_slab
        return self.block_pool

    def admission_tokens(
        self, request: Request, num_tokens: int, num_lookahead_tokens: int
    ) -> tuple[int, int]:
        num_tokens = min(num_tokens + decode_headroom(request), self.max_model_len)
        return num_tokens, min(num_tokens + num_lookahead_tokens, self.max_model_len)

    def recount_admission_reserve(self) -> bool:
        return count_reserve_exactly(self)

    def bound_admission_reserve(
        self, running: list[Request], lookahead_tokens: int, tokens_per_step: int
    ) -> None:
        bound_running_reserve(self, running, lookahead_tokens, tokens_per_step)

    def reserve_for_admitted(self, request: Request, lookahead_tokens: int) -> None:
        reserve_running_requests(
            self, [request], add=True, lookahead_tokens=lookahead_tokens
        )

    def reset_prefix_cache(self) -> bool:
        # The page pool resets its slabs: once, and one AllBlocksCleared.
        return self.block_pool.reset_prefix_cache()

    def copy_id_shift(self, pool: BlockPool) -> int:
        """What a copy's block ids of ``pool`` travel to the worker shifted by:
        pool pages as they are, attention slab blocks past the pages, packed
        states past the slab (copy_kv_cache_blocks_inplace splits them apart)."""
        return pool.id_shift if isinstance(pool, SlabPool) else 0

    def groups_of(
        self, request_id: str
    ) -> tuple[tuple[int, SingleTypeKVCacheManager], ...]:
        """The groups a step of this request visits. Upstream visits every group
        for every running request each step; the request-constant state groups
        only answer "nothing" once the request holds its states (allocated
        together at admission, freed together), and were the most of a
        saturated decode step's allocation time (Qwen3.5-0.8B: three of its
        four groups)."""
        held = self.constant_state_blocks
        if held is not None and held.get(request_id):
            return self.varying_groups
        return self.all_groups

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Upstream's over ``groups_of``: a skipped group gets no new block, as
        its manager would answer (a slab model has no cross-attention group,
        slab_ineligibility)."""
        new_blocks: list[list[KVCacheBlock]] = [[] for _ in self.all_groups]
        for i, manager in self.groups_of(request_id):
            new_blocks[i] = manager.allocate_new_blocks(
                request_id, num_tokens, num_tokens_main_model
            )
        return tuple(new_blocks)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        for _, manager in self.groups_of(request_id):
            manager.remove_skipped_blocks(
                request_id, processed_computed_tokens, num_prompt_tokens
            )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Upstream's count with attention slabs: state groups count pages, slab
        groups count blocks that are then turned into the pages they take
        (pages_needed), and admission (``apply_admission_cap``) adds what the
        running requests may still take. Every call of a saturated step comes
        here, so the groups are told apart by pool, once each: a slab model has
        only full attention and state groups (slab_ineligibility)."""
        if self.retention_interval != 0:
            prefill_end = 0
        slab, state_slab = self.slab_pool, self.state_slab
        pages = slab_new = state_new = 0
        # Free cached blocks a prefix hit touches spend their pages, not new ones.
        slab_touched: list[KVCacheBlock] = []
        state_touched: list[KVCacheBlock] = []
        for i, manager in self.groups_of(request_id):
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
                hit = [
                    b
                    for b in new_computed_blocks[i]
                    if b.ref_cnt == 0 and not b.is_null
                ]
                (slab_touched if pool is slab else state_touched).extend(hit)
                needed -= len(hit)
            if needed > 0:
                if pool is slab:
                    slab_new += needed
                else:
                    state_new += needed
        if apply_admission_cap:
            slab_new += self.slab_reserved_blocks
            states = self.reserved_states + align_boundary_states(self)
            if state_slab is None:
                pages += states
            else:
                state_new += states
        if slab_new or slab_touched:
            pages += slab.pages_needed(slab_new, slab_touched)
        if state_slab is not None and (state_new or state_touched):
            pages += state_slab.pages_needed(state_new, state_touched)
        return pages


class StatePoolHybridCoordinator(StatePoolCoordinator, HybridKVCacheCoordinator):
    """Prefix caching on (and so mamba `align` mode for hybrids)."""


class StatePoolCoordinatorNoPrefixCache(
    StatePoolCoordinator, KVCacheCoordinatorNoPrefixCache
):
    """Prefix caching off."""


def make_state_pool_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    **kwargs: Any,
) -> StatePoolCoordinator | None:
    """The coordinator get_kv_cache_coordinator makes for a plan with attention
    slabs (None: upstream's): upstream's class for the caching setting, with
    this one's steps. A slab plan has a state group and an attention group."""
    if slab_blocks_per_page(kv_cache_config) == 1:
        return None
    if not enable_caching:
        kwargs.pop("allow_partial_hash_hits", None)
        return StatePoolCoordinatorNoPrefixCache(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_kv_cache_events,
            **kwargs,
        )
    return StatePoolHybridCoordinator(
        kv_cache_config,
        max_model_len,
        max_in_flight_tokens,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        **kwargs,
    )
