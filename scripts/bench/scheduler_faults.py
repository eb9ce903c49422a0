"""Allocation refusals injected into vLLM's real scheduler (scheduler_worker's
``faults`` mode): the same seeded workload runs once as is and once with the
KV cache refusing allocations at the two moments the state pool adds work to,

* right after a prefix hit: a waiting request's first allocation that adopts
  cached blocks (the scheduler leaves it waiting and retries next step);
* at a state-page boundary: a running request's allocation that crosses a
  mamba ``align`` state block (the scheduler preempts and retries);

and every request must finish with the same tokens as in the run without
faults. A refusal is the manager's own: the pool reports no free page for the
length of that one ``allocate_slots`` call, so its checks run as in a full pool.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_cache_interface import MambaSpec


def history_token(request: Any) -> int:
    """The fake model's next token, a function of everything the request holds
    so far: a resume that lost or repeated a token changes all that follow."""
    tail = request.all_token_ids[-32:]
    digest = zlib.crc32(repr((request.num_tokens, tail)).encode())
    return 10 + digest % 30_000


@dataclass
class AllocationFaults:
    """Refuses each chosen allocation once; counts what it refused."""

    state_block_size: int
    after_prefix_hit: int = 0
    at_state_boundary: int = 0
    _refused: set[tuple[str, int]] = field(default_factory=set)

    @classmethod
    def install(cls, scheduler: Any) -> AllocationFaults:
        manager = scheduler.kv_cache_manager
        sizes = {m.kv_cache_spec.block_size for m in manager.coordinator.single_type_managers
                 if isinstance(m.kv_cache_spec, MambaSpec)
                 and m.kv_cache_spec.mamba_cache_mode == "align"}
        if len(sizes) != 1:
            raise RuntimeError(f"faults need one mamba align state block size, got {sizes}")
        faults = cls(state_block_size=sizes.pop())
        allocate = manager.allocate_slots
        pool = manager.block_pool

        def allocate_slots(request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                           *args: Any, **kwargs: Any) -> Any:
            kind = faults._choose(request, num_new_tokens, num_new_computed_tokens)
            if kind is None:
                return allocate(request, num_new_tokens, num_new_computed_tokens,
                                *args, **kwargs)
            pool.get_num_free_blocks = lambda *a, **k: 0  # this call only
            try:
                blocks = allocate(request, num_new_tokens, num_new_computed_tokens,
                                  *args, **kwargs)
            finally:
                del pool.get_num_free_blocks
            if blocks is None:
                setattr(faults, kind, getattr(faults, kind) + 1)
            return blocks

        manager.allocate_slots = allocate_slots
        return faults

    def _choose(self, request: Any, num_new_tokens: int,
                num_new_computed_tokens: int) -> str | None:
        """Which refusal this call gets, if any: each (request, moment) once."""
        if num_new_computed_tokens > 0 and request.num_computed_tokens == 0:
            key, kind = (request.request_id, -1), "after_prefix_hit"
        else:
            start = request.num_computed_tokens
            block = (start + num_new_tokens) // self.state_block_size
            if start == 0 or block == start // self.state_block_size:
                return None
            key, kind = (request.request_id, block), "at_state_boundary"
        if key in self._refused:
            return None
        self._refused.add(key)
        return kind
