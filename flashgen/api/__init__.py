"""User-facing operations: merge states, batch decode; prefill as it arrives."""

from .decode import BatchDecodeWrapper
from .merge import merge_state, merge_state_in_place, merge_states

__all__ = ["BatchDecodeWrapper", "merge_state", "merge_state_in_place", "merge_states"]
