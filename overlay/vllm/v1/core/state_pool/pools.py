# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the coordinator's block pools. The page pool keeps
upstream's state-sized pages; a slab cuts the pages it takes into attention
blocks (or packed state slots) and evicts in upstream's LRU order."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from vllm.distributed.kv_events import KVCacheEvent
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.state_pool.free_queue import PagedFreeQueue
from vllm.v1.metrics.stats import KVCacheEvictionEvent

logger = init_logger(__name__)


class SlabPool(BlockPool):
    """Natural-size attention blocks cut from pages of a PagePool.

    Block ``b`` lies in page ``b // k``. The slab holds a page while any of its
    blocks is in use or still cached; an idle page (all ``k`` blocks free)
    without cached blocks goes straight back, an idle page with cached blocks
    stays until the page pool or the slab itself takes it. New blocks come
    from the busy pages' never-cached free blocks (the fullest page first, so
    pages empty out whole), then, for the attention slab, from pool pages that
    hold nothing cached while the pool has some to spare (as upstream reuses
    every never-cached block before it evicts a cached one;
    _uncached_page_goes_first), then from the busy pages' cached blocks (least
    recently freed first), then from new pages. The ``tail_blocks`` past the
    last page (fewer than ``k``: that page never comes idle) are the slab's
    for good, and so are the blocks of page 0 from ``head_start`` on (see
    planner.slab_head_start).
    """

    def __init__(
        self,
        pages: PagePool,
        blocks_per_page: int,
        tail_blocks: int = 0,
        head_start: int | None = None,
    ) -> None:
        # Block ids as the worker sees them: past the pages and any slab
        # attached before (copy-on-write copies and metrics use them).
        self.id_shift = pages.num_gpu_blocks + sum(
            slab.num_gpu_blocks for slab in getattr(pages, "slabs", ())
        )
        collector = pages.metrics_collector
        super().__init__(
            num_gpu_blocks=pages.num_gpu_blocks * blocks_per_page + tail_blocks,
            enable_caching=pages.enable_caching,
            hash_block_size=pages.hash_block_size,
            enable_kv_cache_events=pages.enable_kv_cache_events,
            metrics_collector=None
            if collector is None
            else _ShiftedMetricsCollector(collector, self.id_shift),
            medium=pages.medium,
        )
        # One event queue for the pool and its slabs: events keep their order.
        self.kv_event_queue = pages.kv_event_queue
        self.pages = pages
        self.blocks_per_page = blocks_per_page
        # Upstream's queue held every block; the slab starts with no page.
        # Block 0 (in the page pool's null page 0) stays the null block, and
        # page 0 up to ``head_start`` is never handed out. Page 0 is every
        # group's null block, as block 0 is upstream's, where the groups'
        # layers share each page's bytes and the runners already send the
        # states of dummy runs there (get_dummy_block_tables zeroes their
        # rows), and of padded rows (gather_block_tables, NULL_BLOCK_ID); a
        # request's table points at page 0's null blocks only where nothing is
        # read. The V2 warmup numbers every group's blocks from 1, so its KV
        # and states land in page 0 before any request: harmless.
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = PagedFreeQueue(
            self.blocks,
            blocks_per_page,
            pages.num_gpu_blocks + (1 if tail_blocks else 0),
            clock=lambda: pages.clock,
        )
        self.page_blocks: dict[int, KVCacheBlock] = {}  # held page id -> its block
        # The pool pages the running requests' admission reserve may still
        # take, counted exactly where that and the pages given as argument
        # would leave none (set by the coordinator on the attention slab).
        # None: the slab evicts its own cached blocks before it takes a page.
        self.pages_kept_for_running: Callable[[int], int] | None = None
        self.tail_blocks = tail_blocks
        self.head_blocks = blocks_per_page - (head_start or blocks_per_page)
        # Page 0 past its null blocks and the tail: never a whole free page,
        # so never handed back (their pages never come idle).
        self.free_block_queue.append_n(
            self.blocks[blocks_per_page - self.head_blocks : blocks_per_page]
            + self.blocks[pages.num_gpu_blocks * blocks_per_page :]
        )

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
            self._take_pool_page()

    def _take_pool_page(self) -> None:
        (page,) = self.pages.get_new_blocks(1, for_slab=self)
        if self.pages.metrics_collector:
            # A page cut into blocks is not a block a request holds; the
            # slab's blocks are sampled as they are handed out.
            self.pages.metrics_collector.block_metrics.pop(page.block_id, None)
        self.page_blocks[page.block_id] = page
        self.free_block_queue.append_n(self._page_of(page.block_id))
        self.free_block_queue.activate(page.block_id)

    def _uncached_page_goes_first(self) -> bool:
        """Whether to take a pool page that holds nothing cached rather than
        evict one of the busy pages' cached blocks: upstream would, and the
        busy pages are a small part of the cache (Qwen3.5-0.8B at 4 GiB lost
        a shared prefix with 453 of 641 pages free). Only while the pool has
        pages to spare: beyond what the running requests' reserve counts on
        (a request would be preempted for a page the slab's cached blocks
        could have spared), and beyond the pages' worth of cached blocks the
        busy pages already keep, which states cannot use until their pages
        come idle (at 1 GiB, without that bound, nearly a quarter of the pool
        ended up as such holes and states were evicted for them)."""
        kept = self.pages_kept_for_running
        cached = len(self.free_block_queue.cached_free)
        if kept is None or not cached or not self.pages.has_uncached_free_page():
            return False
        in_holes = cached // self.blocks_per_page
        return self.pages.get_num_free_blocks() > kept(in_holes) + in_holes

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
    def num_blocks_outside_pages(self) -> int:
        """Blocks the slab holds for good: page 0's past its null blocks and
        the tail."""
        return self.head_blocks + self.tail_blocks

    @property
    def num_blocks_outside_pages_in_use(self) -> int:
        """Of those, the blocks held: the page pool's free count never sees
        them, so a leak audit adds them."""
        queue = self.free_block_queue
        in_use = self.head_blocks - queue.free_in_page[0] if self.head_blocks else 0
        if self.tail_blocks:
            in_use += self.tail_blocks - queue.free_in_page[-1]
        return in_use

    @property
    def num_free_blocks_in_busy_pages(self) -> int:
        idle = self.num_idle_pages * self.blocks_per_page
        return self.free_block_queue.num_free_blocks - idle

    # -- BlockPool

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        queue = self.free_block_queue
        k = self.blocks_per_page
        while (
            num_blocks > queue.num_uncached_free_blocks
            and self._uncached_page_goes_first()
        ):
            self._take_pool_page()
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

    def pages_needed(self, num_new_blocks: int, touched: Sequence[KVCacheBlock]) -> int:
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


def forget_cached_blocks(slab: SlabPool) -> None:
    """A slab's part of upstream's reset (which would count used blocks
    against the slab's whole id space): its hashes. The page pool's reset
    then clears the shared metrics and sends the one AllBlocksCleared."""
    slab.cached_block_hash_to_block = type(slab.cached_block_hash_to_block)()
    slab.cached_block_hashes_by_block.clear()
    for block in slab.blocks:
        block.reset_hash()
    slab.free_block_queue.forget_cached()


class _ShiftedMetricsCollector(KVCacheMetricsCollector):
    """The pool's collector as a slab reports to it: the slab's block ids
    shifted past the pages' (SlabPool.id_shift), so one collector keeps pages,
    attention blocks and packed states apart."""

    def __init__(self, collector: KVCacheMetricsCollector, id_shift: int) -> None:
        # No state of its own: all of it is the pool's collector's.
        self.collector = collector
        self.id_shift = id_shift

    def _shifted(self, block: KVCacheBlock) -> KVCacheBlock:
        return KVCacheBlock(block.block_id + self.id_shift)

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.collector.on_block_allocated(self._shifted(block))

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        self.collector.on_block_accessed(self._shifted(block))

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.collector.on_block_evicted(self._shifted(block))

    def reset(self) -> None:
        self.collector.reset()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        return self.collector.drain_events()


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

    def attach_slab(
        self,
        blocks_per_page: int,
        tail_blocks: int = 0,
        head_start: int | None = None,
    ) -> SlabPool:
        self.freed_at = [0] * self.num_gpu_blocks
        self.slab = SlabPool(self, blocks_per_page, tail_blocks, head_start)
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

    def has_uncached_free_page(self) -> bool:
        """Whether the free queue's next page holds nothing cached (the queue
        keeps those first, as upstream's)."""
        queue = self.free_block_queue
        head = queue.fake_free_list_head.next_free_block
        return (
            queue.num_free_blocks > 0 and head is not None and head.block_hash is None
        )

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
        return (
            head.block_hash is not None and idle_since <= self.freed_at[head.block_id]
        )

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
        total = self.num_gpu_blocks - 1 + self.slab.num_blocks_outside_pages / k
        if not total:
            return 0
        slab_free = sum(
            slab.free_block_queue.num_free_blocks / slab.blocks_per_page
            for slab in self.slabs
        )
        return 1.0 - (self.free_block_queue.num_free_blocks + slab_free) / total

    def take_events(self) -> list[KVCacheEvent]:
        # One queue for the pool and its slabs (SlabPool.__init__): its events
        # taken and the queue emptied in place, so the slabs keep appending.
        if not self.enable_kv_cache_events:
            return []
        events = self.kv_event_queue.copy()
        self.kv_event_queue.clear()
        return events

    def reset_prefix_cache(self) -> bool:
        if any(
            slab.free_block_queue.num_free_blocks
            != len(slab.page_blocks) * slab.blocks_per_page
            + slab.num_blocks_outside_pages
            for slab in self.slabs
        ):
            logger.warning("Failed to reset prefix cache: blocks in use")
            return False
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            # States still held: upstream's refusal, before the slabs forget.
            return super().reset_prefix_cache()
        for slab in self.slabs:
            forget_cached_blocks(slab)
            slab.reclaim(len(slab.page_blocks))
        return super().reset_prefix_cache()
