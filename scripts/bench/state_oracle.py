"""What the Mamba/GDN state blocks hold, step by step, for a fake-model scheduler
run: the worker's side of mamba `align` mode replayed on the scheduler's outputs.

A fake model produces no states, so the scheduler alone cannot show that a
prefix-cached state block holds the state its hash promises. This replays what
vLLM's V1 GPU runner does with each SchedulerOutput (gpu_model_runner's
_update_states and mamba_utils.preprocess_mamba): the queued copy-on-write
copies first, then, per scheduled request, the copy of its last state to the
block of this chunk's end, then the forward, which leaves there the state after
exactly ``num_computed_tokens + num_scheduled_tokens`` tokens. A state is named
by its token count and a digest of those tokens.

Two checks can fail:
* a chunk that starts from a block not holding the state of exactly the tokens
  computed so far (the request resumes the recurrence from a wrong state);
* after a step, a prefix-cached state block (every hash key the pool holds for
  a state group) whose content is not the state of the tokens its key covers.

Runs inside the vLLM venv, stock or E2 (E2's slab pools are read by name, so
the same code serves both sides). Speculative decoding is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

State = tuple[int, int]  # (token count, digest of those tokens)
EMPTY: State = (0, hash(()))


def _state_of(tokens: Sequence[int], count: int) -> State:
    return count, hash(tuple(tokens[:count]))


@dataclass
class OracleCounts:
    steps: int = 0
    chunks: int = 0
    wrong_resumes: int = 0          # chunks that started from a wrong state
    cached_checked: int = 0         # checks of cached state entries (new or rewritten)
    cached_wrong: int = 0           # of those, holding another state
    distinct_wrong: set = field(default_factory=set)  # (space, block id, key) found wrong
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "chunks": self.chunks,
                "wrong_resumes": self.wrong_resumes,
                "cached_checked": self.cached_checked, "cached_wrong": self.cached_wrong,
                "distinct_wrong": len(self.distinct_wrong), "examples": self.examples[:10]}


class StateOracle:
    """The state blocks' contents beside a real Scheduler in mamba `align` mode."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        manager = scheduler.kv_cache_manager
        coordinator = manager.coordinator
        self.scheduler = scheduler
        self.config = manager.kv_cache_config if hasattr(manager, "kv_cache_config") \
            else scheduler.kv_cache_config
        self.hash_block_size = coordinator.block_pool.hash_block_size
        self.state_groups = [
            i for i, m in enumerate(coordinator.single_type_managers)
            if isinstance(m.kv_cache_spec, MambaSpec)]
        managers = coordinator.single_type_managers
        self.block_size = managers[self.state_groups[0]].kv_cache_spec.block_size
        # Which id space each state group's blocks live in: the page pool's, or
        # (E2, states packed several to a page) the state slab's.
        state_slab = getattr(coordinator, "state_slab", None)
        self.space = {g: ("state" if state_slab is not None
                          and managers[g].block_pool is state_slab else "page")
                      for g in self.state_groups}
        self.pools = {g: managers[g].block_pool for g in self.state_groups}
        # Copy-on-write copies travel as ids: pages first, then the attention
        # slab's blocks, then the packed states' (VLLM_E2_STATE_POOL).
        slab = getattr(coordinator, "slab_pool", None)
        self.num_pages = coordinator.block_pool.num_gpu_blocks
        self.state_shift = self.num_pages + (slab.num_gpu_blocks if slab is not None else 0)
        self.contents: dict[tuple[str, int], State] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.state_index: dict[str, int] = {}
        # Every prefix hash seen, by the token count and tokens it covers.
        self.hash_states: dict[bytes, State] = {}
        self.hashed_units: dict[str, int] = {}
        self.counts = OracleCounts()
        # The cached state entries (key, block id) by pool, the keys by block, and the blocks
        # written since the last check.
        self.known_entries: dict[int, set] = {}
        self.block_keys: dict[tuple[str, int], set] = {}
        self.written: set[tuple[str, int]] = set()

    # -- the worker's side of one step

    def _copy_space(self, block_id: int) -> tuple[str, int] | None:
        if block_id < self.num_pages:
            return "page", block_id
        if block_id >= self.state_shift:
            return "state", block_id - self.state_shift
        return None  # an attention slab block: no state

    def before_forward(self, output: Any) -> None:
        """The worker's step up to the forward, then the forward's state writes."""
        for req_id in output.finished_req_ids:
            self.tables.pop(req_id, None)
            self.state_index.pop(req_id, None)
        for req_id in output.preempted_req_ids or ():
            self.state_index.pop(req_id, None)
        copies = [(self._copy_space(c.src_block_id), self._copy_space(c.dst_block_id))
                  for c in output.kv_cache_block_copies or ()]
        snapshot = {src: self.contents.get(src, EMPTY) for src, _ in copies if src}
        for src, dst in copies:
            if src and dst:
                self.contents[dst] = snapshot[src]
                self.written.add(dst)
        computed: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.state_index.pop(new.req_id, None)
            computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
                self.state_index.pop(req_id, None)
            elif new_ids is not None:
                for ids, more in zip(self.tables[req_id], new_ids):
                    ids.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        # A request can finish within this step: learn its hashes while it is here.
        self._learn_hashes()
        writes = self._precopy_states(output, computed)
        self.contents.update(writes)
        self.written.update(writes)

    def _precopy_states(self, output: Any, computed: dict[str, int]
                        ) -> dict[tuple[str, int], State]:
        """preprocess_mamba's copies (all before any forward), the chunk's
        starting state checked, and the states the forward leaves."""
        size = self.block_size
        moves, writes = [], {}
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            start = computed[req_id]
            tokens = self.scheduler.requests[req_id].all_token_ids
            prev = self.state_index.get(req_id, (start - 1) // size)
            curr = (start + num_scheduled - 1) // size
            self.state_index[req_id] = curr
            self.counts.chunks += 1
            for g in self.state_groups:
                table = self.tables[req_id][g]
                dst = (self.space[g], table[curr])
                src = (self.space[g], table[prev]) if prev >= 0 else None
                moves.append((req_id, start, tokens, src, dst, prev != curr))
                writes[dst] = _state_of(tokens, start + num_scheduled)
        before = dict(self.contents)
        for _, _, _, src, dst, moved in moves:
            if src is not None and moved:
                self.contents[dst] = before.get(src, EMPTY)
                self.written.add(dst)
        for req_id, start, tokens, _, dst, _ in moves:
            have = self.contents.get(dst, EMPTY) if start else EMPTY
            if have != _state_of(tokens, start):
                self.counts.wrong_resumes += 1
                self._example(f"{req_id} resumed at {start} tokens from the state "
                              f"after {have[0]}")
        return writes

    # -- what the cache holds

    def _learn_hashes(self) -> None:
        size = self.hash_block_size
        for req_id, request in self.scheduler.requests.items():
            hashes = request.block_hashes
            done = self.hashed_units.get(req_id, 0)
            if len(hashes) == done:
                continue
            tokens = request.all_token_ids
            for unit in range(done, len(hashes)):
                self.hash_states[bytes(hashes[unit])] = _state_of(tokens, (unit + 1) * size)
            self.hashed_units[req_id] = len(hashes)

    def after_step(self) -> None:
        """Every cached state entry must hold the state of its key's tokens:
        each entry is checked when it is cached and whenever its block is
        written again while it stays cached."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        self._learn_hashes()
        self.counts.steps += 1
        groups = set(self.state_groups)
        to_check: set[tuple[Any, Any]] = set()
        for pool in {id(p): p for p in self.pools.values()}.values():
            cache = pool.cached_block_hash_to_block
            entries = getattr(cache, "_cache", cache)
            known = self.known_entries.setdefault(id(pool), set())
            # An entry is a key and one block it maps to: a key cached again on
            # another block, or a second block under a key, is a new entry.
            now: set[tuple[Any, int]] = set()
            for key, value in entries.items():
                if get_group_id(key) not in groups:
                    continue
                if isinstance(value, dict):
                    now.update((key, block.block_id) for block in value.values())
                else:
                    now.add((key, value.block_id))
            for key, block_id in known - now:
                where = (self.space[get_group_id(key)], block_id)
                self.block_keys[where].discard(key)
            for key, block_id in now - known:
                where = (self.space[get_group_id(key)], block_id)
                self.block_keys.setdefault(where, set()).add(key)
                to_check.add((key, where))
            self.known_entries[id(pool)] = now
        for where in self.written:
            for key in self.block_keys.get(where, ()):
                to_check.add((key, where))
        self.written = set()
        for key, where in to_check:
            expected = self.hash_states.get(bytes(get_block_hash(key)))
            have = self.contents.get(where, EMPTY)
            self.counts.cached_checked += 1
            if expected is None or have != expected:
                self.counts.cached_wrong += 1
                self.counts.distinct_wrong.add((*where, bytes(key)))
                self._example(f"{where} cached for {expected and expected[0]} "
                              f"tokens holds the state after {have[0]}")

    def _example(self, text: str) -> None:
        if len(self.counts.examples) < 10:
            self.counts.examples.append(text)

    def forget(self, req_id: str) -> None:
        """A request the engine finished outside a step (an abort)."""
        self.hashed_units.pop(req_id, None)


