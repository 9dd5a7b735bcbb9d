"""The ``flashgen::`` custom ops: each public op's schema, its implementation (the eager API) and its fake.

Every op takes and returns tensors and plain values only (schemas below). The wrappers' runs take the wrapper's
``op_handle`` (``flashgen.api.handles``) and look the wrapper up when they run; their fakes need no wrapper: the
output's last dimension (``head_dim_vo``) is an argument, the rest follows q. A run op without ``lse`` returns an
empty ``[0]`` fp32 tensor in its place (a schema cannot return an optional tensor). Ops that write their
arguments say so in their schemas (``Tensor(a!)``): ``*_run_out`` writes ``out``, ``merge_state_in_place``
writes ``v`` and ``s``, ``append_kv`` writes the cache.
"""

from __future__ import annotations

import torch

from ..api import handles

# torch.library.Library + register_fake (public since torch 2.4) rather than torch.library.custom_op: the same schemas
# and fakes, with no Python autograd wrapper around each call, so an eager op call costs ~4x less (bench_ops.py).
# The ops have no autograd formula: they are for inference (call them under torch.no_grad / inference_mode).
_lib = torch.library.Library("flashgen", "FRAGMENT")  # other modules may add ops to the namespace


def define(name: str, schema: str, impl, fake) -> torch._ops.OpOverload:
    """Op ``flashgen::name`` of ``schema`` (arguments and result), ``impl`` on every device, ``fake`` for tracing."""
    _lib.define(name + schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flashgen::{name}", fake, lib=_lib)
    return getattr(torch.ops.flashgen, name).default


# name -> whether its wrapper's run takes K and V as two arguments (run(q, k, v)) rather than one cache
RUN_OPS = {"decode_run": False, "prefill_run": False, "cascade_run": False, "block_sparse_run": True,
           "variable_block_sparse_run": True}
_RUN_SCHEMA = "(int handle, Tensor q, Tensor kv_cache, Tensor? v_cache, int head_dim_vo, bool return_lse) -> " \
              "(Tensor, Tensor)"
_RUN_OUT_SCHEMA = "(int handle, Tensor q, Tensor kv_cache, Tensor? v_cache, Tensor(a!) out, bool return_lse) -> Tensor"


def no_lse(q: torch.Tensor) -> torch.Tensor:
    """What a run op returns for ``lse`` when it was not asked for."""
    return q.new_empty((0,), dtype=torch.float32)


def _lse_like(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if return_lse else no_lse(q)


def _run_call(name: str, pair: bool):
    """``call(handle, q, kv_cache, v_cache, out, return_lse) -> (out, lse)`` through the wrapper's own run()."""

    def call(handle, q, kv_cache, v_cache, out, return_lse):
        wrapper = handles.lookup(handle)
        if pair:
            if v_cache is None:
                raise ValueError(f"v_cache: {name} takes K and V as two tensors (kv_cache is K), got None")
            result = wrapper.run(q, kv_cache, v_cache, out=out, return_lse=return_lse)
        else:
            kv = kv_cache if v_cache is None else (kv_cache, v_cache)
            result = wrapper.run(q, kv, out=out, return_lse=return_lse)
        return result if return_lse else (result, no_lse(q))

    return call


def _define_run(name: str, pair: bool) -> tuple:
    call = _run_call(name, pair)

    def run(handle: int, q, kv_cache, v_cache, head_dim_vo: int, return_lse: bool):
        return call(handle, q, kv_cache, v_cache, None, return_lse)

    def run_fake(handle, q, kv_cache, v_cache, head_dim_vo, return_lse):
        return q.new_empty((q.shape[0], q.shape[1], head_dim_vo)), _lse_like(q, return_lse)

    def run_out(handle: int, q, kv_cache, v_cache, out, return_lse: bool):
        return call(handle, q, kv_cache, v_cache, out, return_lse)[1]

    def run_out_fake(handle, q, kv_cache, v_cache, out, return_lse):
        return _lse_like(q, return_lse)

    return define(name, _RUN_SCHEMA, run, run_fake), define(f"{name}_out", _RUN_OUT_SCHEMA, run_out, run_out_fake)


RUNS = {name: _define_run(name, pair) for name, pair in RUN_OPS.items()}


# ---------------------------------------------------------------------------------------------- attention()


def _attention(q, k, v, spec, causal, sm_scale, window_left, soft_cap, rope_theta, rope_scale, custom_mask,
              return_lse):
    from ..api import attention as eager

    result = eager(q, k, v, spec_from_json(spec), causal=causal, sm_scale=sm_scale, window_left=window_left,
                   soft_cap=soft_cap, rope_theta=rope_theta, rope_scale=rope_scale, custom_mask=custom_mask,
                   return_lse=return_lse)
    return result if return_lse else (result, no_lse(q))


def _attention_fake(q, k, v, spec, causal, sm_scale, window_left, soft_cap, rope_theta, rope_scale, custom_mask,
                    return_lse):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), _lse_like(q, return_lse)


attention = define("attention", "(Tensor q, Tensor k, Tensor v, str? spec, bool causal, float? sm_scale, "
                   "int? window_left, float? soft_cap, float? rope_theta, float? rope_scale, Tensor? custom_mask, "
                   "bool return_lse) -> (Tensor, Tensor)", _attention, _attention_fake)


_SPECS: dict[str, object] = {}


def spec_from_json(text: str | None):
    """The ``AttentionSpec`` of ``spec_json``'s text (parsed once), or None."""
    if text is None:
        return None
    spec = _SPECS.get(text)
    if spec is None:
        import json

        from ..spec.serialize import spec_from_dict

        spec = _SPECS[text] = spec_from_dict(json.loads(text))
    return spec


# ---------------------------------------------------------------------------------------------- merges


def _merge_state(v_a, s_a, v_b, s_b):
    from ..api import merge_state as eager

    return eager(v_a, s_a, v_b, s_b)


def _merge_state_fake(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a), torch.empty_like(s_a)


merge_state = define("merge_state", "(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)",
                     _merge_state, _merge_state_fake)


def _merge_state_in_place(v, s, v_other, s_other, mask):
    from ..api import merge_state_in_place as eager

    eager(v, s, v_other, s_other, mask)


def _merge_state_in_place_fake(v, s, v_other, s_other, mask):
    return None


merge_state_in_place = define("merge_state_in_place", "(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, "
                              "Tensor? mask) -> ()", _merge_state_in_place, _merge_state_in_place_fake)


def _merge_states(v, s):
    from ..api import merge_states as eager

    return eager(v, s)


def _merge_states_fake(v, s):
    tokens, _, heads, head_dim = v.shape
    return v.new_empty((tokens, heads, head_dim)), s.new_empty((tokens, heads))


merge_states = define("merge_states", "(Tensor v, Tensor s) -> (Tensor, Tensor)", _merge_states, _merge_states_fake)


# ---------------------------------------------------------------------------------------------- append_kv


def _append_kv(k, v, kv_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions,
              slot_mapping, kv_layout, rope, rope_scaling, cos_sin_cache, k_scale, v_scale, k_scale_value,
              v_scale_value):
    from ..api import append_kv as eager

    eager(k, v, kv_cache if v_cache is None else (kv_cache, v_cache), kv_indptr=kv_indptr, kv_indices=kv_indices,
          kv_last_page_len=kv_last_page_len, batch_indices=batch_indices, positions=positions,
          slot_mapping=slot_mapping, kv_layout=kv_layout, **append_rope(rope, rope_scaling),
          cos_sin_cache=cos_sin_cache, k_scale=k_scale if k_scale is not None else k_scale_value,
          v_scale=v_scale if v_scale is not None else v_scale_value)


def _append_kv_fake(k, v, kv_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions,
                    slot_mapping, kv_layout, rope, rope_scaling, cos_sin_cache, k_scale, v_scale, k_scale_value,
                    v_scale_value):
    return None


append_kv = define("append_kv", "(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor(b!)? v_cache, Tensor? kv_indptr, "
                   "Tensor? kv_indices, Tensor? kv_last_page_len, Tensor? batch_indices, Tensor? positions, "
                   "Tensor? slot_mapping, str kv_layout, float[]? rope, float[]? rope_scaling, Tensor? cos_sin_cache, "
                   "Tensor? k_scale, Tensor? v_scale, float? k_scale_value, float? v_scale_value) -> ()",
                   _append_kv, _append_kv_fake)


def append_rope(rope: list | None, rope_scaling: list | None) -> dict:
    """append_kv's ``rope`` and ``rope_scaling`` objects from the op's float lists (``[theta, scale]``,
    ``[factor, low_freq_factor, high_freq_factor, original_max_position]``)."""
    from ..spec import Llama31Scaling, RoPE

    found = {"rope": None if rope is None else RoPE(*rope)}
    if rope_scaling is not None:
        factor, low, high, original = rope_scaling
        found["rope_scaling"] = Llama31Scaling(factor, low, high, int(original))
    return found
