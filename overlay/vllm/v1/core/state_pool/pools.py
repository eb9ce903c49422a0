# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: the coordinator's block pools. The page pool keeps
upstream's state-sized pages; a slab cuts the pages it takes into attention
blocks (or packed state slots) and evicts in upstream's LRU order."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from vllm.distributed.kv_events import KVCacheEvent
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.metrics.stats import KVCacheEvictionEvent

logger = init_logger(__name__)


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

    def forget_cached(self) -> None:
        """A prefix-cache reset: the busy pages' cached free blocks become
        never-cached ones. Page 0 and the tail page never come idle, so no
        reclaim clears them; idle pages are cleared as they are handed back."""
        for page, cached in enumerate(self.cached_bits):
            if cached and page not in self.idle_pages:
                self.cached_bits[page] = 0
                self._rebucket(page, self.uncached_in_page[page] + cached.bit_count())
        self.cached_free.clear()

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
        self._rebucket(page, self.uncached_in_page[page] + (bits & ~cached).bit_count())

    def _taken(self, page: int, bits: int, cached: int) -> None:
        if page in self.idle_pages:
            self.activate(page)  # a prefix hit on an idle page's block
        self.free_bits[page] ^= bits
        self.cached_bits[page] ^= cached
        self.free_in_page[page] -= bits.bit_count()
        for block in self._cached_blocks(page, cached):
            del self.cached_free[block.block_id]
        self._rebucket(page, self.uncached_in_page[page] - (bits & ~cached).bit_count())

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

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
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
        self.free_block_queue = _PagedFreeQueue(
            self.blocks,
            blocks_per_page,
            pages.num_gpu_blocks + (1 if tail_blocks else 0),
            clock=lambda: pages.clock,
        )
        self.page_blocks: dict[int, KVCacheBlock] = {}  # held page id -> its block
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
            (page,) = self.pages.get_new_blocks(1, for_slab=self)
            if self.pages.metrics_collector:
                # A page cut into blocks is not a block a request holds; the
                # slab's blocks are sampled as they are handed out.
                self.pages.metrics_collector.block_metrics.pop(page.block_id, None)
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
