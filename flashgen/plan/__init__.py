"""Planner: host-side work partitions for the attention kernels (imports only ``flashgen.spec``).

- ``page_table``: validate and convert CSR / block-table page tables.
- ``plan``: the ``Plan`` type (int32 arrays in one host buffer, one async copy to the device).
- ``split_kv``: split-KV work items for decode and prefill, CUDA-graph fixed-capacity mode: the entry points,
  their validation and the reference path; ``fast_paths`` (numpy) and ``list_paths`` (a few requests) plan
  the same fields faster, behind one ``PlanRequest`` (``request``); ``native`` runs the list paths as one C++
  call (built on the first plan through the kernel cache: the one place the planner uses ``flashgen.cache``).
- ``heuristics``: the split policy (chunk length, last-wave split) with worked examples; ``SplitPolicy``.
- ``cascade``: shared-prefix levels (given, or derived from per-request page tables), each planned over its own
  pages, merged; ``cascade_cost``: which levels pay (the cost model) and the folding of those that do not;
  ``cascade_split``: a shared level split over its keys into chunks of whole pages (for the Hopper prefill).
- ``block_sparse``: a BSR pattern as a page plan.
"""

from .block_sparse import BlockSparseInfo, bsr_page_table, plan_block_sparse
from .cascade import CascadeInfo, CascadeLevel, LevelTable, check_levels, derive_levels, fold_level, plan_cascade
from .cascade_cost import CascadePolicy, LevelCost, choose_levels, level_cost
from .heuristics import DEFAULT_SPLIT_POLICY, SplitPolicy
from .host import PlanError, host_array
from .page_table import (
    PageTableError,
    block_table_to_csr,
    csr_to_block_table,
    kv_lens_from_csr,
    validate_block_table,
    validate_csr,
    validate_indptr,
)
from .plan import Plan, PlanField
from .split_kv import (
    SPLIT_KV_SCHEMA,
    SplitKVInfo,
    choose_kv_chunk,
    choose_tail_split,
    default_tile_rows,
    plan_decode,
    plan_prefill,
    plan_split_kv,
)

__all__ = [
    "BlockSparseInfo", "bsr_page_table", "plan_block_sparse", "CascadeInfo", "plan_cascade", "CascadeLevel",
    "LevelTable", "check_levels", "derive_levels", "fold_level", "CascadePolicy", "LevelCost", "choose_levels",
    "level_cost",
    "PlanError", "host_array", "PageTableError", "block_table_to_csr", "csr_to_block_table",
    "kv_lens_from_csr", "validate_block_table", "validate_csr", "validate_indptr", "Plan", "PlanField",
    "SPLIT_KV_SCHEMA", "SplitKVInfo", "choose_kv_chunk", "choose_tail_split", "default_tile_rows", "plan_decode",
    "plan_prefill", "plan_split_kv", "SplitPolicy", "DEFAULT_SPLIT_POLICY",
]
