"""Testing support shipped with flashgen: the fp64 reference, tolerance checks and a CPU plan executor.

Imports ``flashgen.spec`` and ``flashgen.plan`` only, never a compiled kernel: the oracle stays
independent of what it checks.
"""

from .append import append_kv_ref, assert_cache_close, cos_sin_table, rope_inv_freq
from .layouts import paged_kv_cache, request_kv, split_kv
from .reference import (
    RuntimeParams,
    alibi_slopes,
    apply_rope,
    attend,
    bsr_mask,
    merge_state_ref,
    merge_states_ref,
    pack_custom_mask,
    reference_attention,
    request_positions,
    runtime_params,
    unpack_custom_mask,
)

__all__ = [
    "append_kv_ref", "assert_cache_close", "cos_sin_table", "rope_inv_freq",
    "paged_kv_cache", "request_kv", "split_kv", "RuntimeParams", "alibi_slopes", "apply_rope", "attend",
    "bsr_mask", "merge_state_ref", "merge_states_ref", "pack_custom_mask", "reference_attention",
    "request_positions", "runtime_params", "unpack_custom_mask",
]
