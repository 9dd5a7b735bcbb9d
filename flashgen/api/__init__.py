"""User-facing operations: the batch decode, prefill and cascade wrappers, attention(), merging attention states."""

from .cascade import CascadeWrapper, LevelRecord
from .decode import BatchDecodeWrapper
from .merge import merge_state, merge_state_in_place, merge_states
from .prefill import BatchPrefillWrapper, attention

__all__ = ["CascadeWrapper", "LevelRecord", "BatchDecodeWrapper", "BatchPrefillWrapper", "attention", "merge_state", "merge_state_in_place", "merge_states"]
