# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: what admission keeps for the running requests (their
decode headroom's slab blocks, `align` mode's boundary states), bounded once
a step and counted exactly only where the bound would refuse a request."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import MambaSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.request import Request


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
        0,
        min(request.max_tokens - request.num_output_tokens - 1, DECODE_HEADROOM_TOKENS),
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
        1 + tokens_per_step // manager.block_size
        for manager in _slab_managers(coordinator)
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


def pages_kept_for_running(coordinator: KVCacheCoordinator, beyond: int = 0) -> int:
    """Pool pages the running requests' reserve may still take (the slab's
    by pages_needed, states by page or by the state slab's pages), from the
    step's bound, counted exactly where the bound and ``beyond`` more pages
    would claim every free page."""

    def pages() -> int:
        slab, state_slab = coordinator.slab_pool, coordinator.state_slab
        states = coordinator.reserved_states
        return slab.pages_needed(coordinator.slab_reserved_blocks, ()) + (
            states if state_slab is None else state_slab.pages_needed(states, ())
        )

    kept = pages()
    if coordinator.reserve_exact or (
        kept + beyond < coordinator.block_pool.get_num_free_blocks()
    ):
        return kept
    # The bound's list is the scheduler's of the last step, which replaces
    # it as requests finish: those take nothing more.
    running, lookahead_tokens = coordinator.reserve_running
    coordinator.reserve_running = (
        [request for request in running if not request.is_finished()],
        lookahead_tokens,
    )
    count_reserve_exactly(coordinator)
    return pages()


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
        num_tokens = request.num_tokens
        num_output_tokens = request.num_output_tokens
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
    # Upstream's coordinator (no slab) keeps no slab blocks in reserve.
    slab = getattr(coordinator, "slab_pool", None)
    if slab is None:
        return []
    return [m for m in coordinator.single_type_managers if m.block_pool is slab]


def _align_block_sizes(coordinator: KVCacheCoordinator) -> list[int]:
    return [
        m.kv_cache_spec.block_size
        for m in coordinator.single_type_managers
        if isinstance(m.kv_cache_spec, MambaSpec)
        and m.kv_cache_spec.mamba_cache_mode == "align"
    ]
