# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM E2: exact-size request state for hybrid models (VLLM_E2_STATE_POOL).

Upstream plans a hybrid model with one pool of equal pages: the attention block
is raised until one attention page holds one Mamba/GDN state (Qwen3.5-0.8B:
544 tokens instead of the backend's 16), so every request rounds its attention
up to that coarse block. Here the pool keeps upstream's state-sized pages, and
a page handed to attention is cut into ``blocks_per_page`` blocks of the
backend's natural size (a slab):

* a request's state takes one page per state group, as upstream, or, where a
  state padded to whole blocks wastes more than 1% (Qwen3.5-0.8B: 2.6%), a
  slot of a page that packs a few states (a state slab, ``pack_states``);
* attention takes natural-size blocks; a slab page returns to the pool once
  all its blocks are free, so memory still flows between state and attention
  as the workload changes, which a fixed split sized for max_num_seqs cannot.

Its modules, each used from a few named places of upstream's code:

* ``plan``: what a plan with slabs adds to upstream's (``SlabKVCacheConfig``
  and its groups and tensors, subclasses of upstream's); the workers read
  ``SlabKVCacheTensor.blocks_per_page`` to view attention as natural blocks.
* ``planner``: the plan's last step (``cut_attention_slabs``, called by
  ``get_kv_cache_configs``) rewrites the attention groups and their tensors
  within the layer regions upstream placed, what the attention spec tells it
  (``attention_kernel_fields``), and `align` mode's state block;
  ``layout`` places packed states, the slab tail and page 0's blocks,
  ``tables`` counts the block tables the plan makes the workers allocate,
  ``report`` writes the boot line.
* ``pools``: the coordinator's block pools (``PagePool``, ``SlabPool``), a
  slab's free blocks kept by page in ``free_queue``.
* ``coordinator``: what the coordinator does differently with slabs (a step's
  groups, blocks counted as the pages they take).
* ``admission``: what admission keeps for the running requests.
"""
