"""User-facing operations: the batch decode and prefill wrappers, attention(), merging attention states."""

from .decode import BatchDecodeWrapper
from .merge import merge_state, merge_state_in_place, merge_states
from .prefill import BatchPrefillWrapper, attention

__all__ = ["BatchDecodeWrapper", "BatchPrefillWrapper", "attention", "merge_state", "merge_state_in_place", "merge_states"]
