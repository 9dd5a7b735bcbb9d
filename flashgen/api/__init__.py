"""User-facing operations: merge states now; decode/prefill wrappers as they arrive."""

from .merge import merge_state, merge_state_in_place, merge_states

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]
