# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2 state pool: a slab's free blocks, kept by page so that a pick takes
the fullest page's lowest ids and an emptied page goes back whole."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


class PagedFreeQueue(FreeKVCacheBlockQueue):
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
