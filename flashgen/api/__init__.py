"""User-facing operations: the batch decode, prefill and cascade wrappers, attention(), block-sparse
attention, sparse page tables, merging attention states, writing new K/V into a paged cache (append_kv)."""

from .append import append_kv
from .block_sparse import BlockSparseWrapper
from .cascade import CascadeWrapper, LevelRecord
from .decode import BatchDecodeWrapper
from .merge import merge_state, merge_state_in_place, merge_states
from .prefill import BatchPrefillWrapper, attention
from .sparse_pages import select_pages
from .variable_block_sparse import VariableBlockSparseWrapper

__all__ = ["append_kv", "BlockSparseWrapper", "CascadeWrapper", "LevelRecord", "BatchDecodeWrapper", "BatchPrefillWrapper",
           "attention", "merge_state", "merge_state_in_place", "merge_states", "select_pages",
           "VariableBlockSparseWrapper"]
