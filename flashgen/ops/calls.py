"""The functions a model calls: eager calls go straight to the eager API, traced ones through ``torch.ops.flashgen``.

Each function takes the eager API's arguments (a wrapper, or the spec and the runtime values) and returns what it
returns. ``torch.compiler.is_compiling()`` (0.2 us) picks the path: under ``torch.compile`` / ``torch.export``,
or with a tensor that is not a plain ``torch.Tensor`` (fake and functional tensors of other tracers), the call is
the custom op, which the compiler sees as one opaque node with a known output shape; otherwise it is the eager
call itself, so an eager model keeps the eager host cost (``wrapper.run``: 8-14 us) and pays no dispatcher
(tens of us a call). The ops without a wrapper also take the op for tensors off the GPU, whose CPU kernel, where
one is registered, runs them (the eager kernels are CUDA-only).
"""

from __future__ import annotations

import json

import torch

from . import library


def _traced(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def _op_path(t: torch.Tensor) -> bool:
    """``_traced``, or a tensor off the GPU: the eager kernels are CUDA-only, and a CPU kernel registered for the op
    (flashgen's tests register reference ones) runs it."""
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor or not t.is_cuda


def _kv(kv_cache) -> tuple:
    """``(kv_cache, v_cache)`` of the ops from a cache tensor (``(t, None)``) or a ``(k, v)`` pair."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache: expected a tensor or a (k, v) pair, got {len(kv_cache)} items")
        return kv_cache[0], kv_cache[1]
    return kv_cache, None


def _run(name: str, wrapper, q: torch.Tensor, kv_cache, v_cache, out, return_lse: bool):
    functional, in_place = library.RUNS[name]
    if out is None:
        out, lse = functional(wrapper.op_handle, q, kv_cache, v_cache, wrapper.spec.head_dim_vo, return_lse)
    else:
        lse = in_place(wrapper.op_handle, q, kv_cache, v_cache, out, return_lse)
    return (out, lse) if return_lse else out


def decode_run(wrapper, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
    """``wrapper.run(q, kv_cache, out, return_lse)`` of a planned ``BatchDecodeWrapper``, traceable by
    ``torch.compile`` (op ``flashgen::decode_run``, or ``flashgen::decode_run_out`` with ``out``).

    >>> out = flashgen.ops.decode_run(wrapper, q, kv_cache)   # q [batch, Hq, D] -> out [batch, Hq, Dv]
    """
    if not _traced(q):
        return wrapper.run(q, kv_cache, out=out, return_lse=return_lse)
    return _run("decode_run", wrapper, q, *_kv(kv_cache), out, return_lse)


def prefill_run(wrapper, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
    """``wrapper.run(...)`` of a planned ``BatchPrefillWrapper`` (op ``flashgen::prefill_run[_out]``); as
    ``decode_run``. ``q [total_q, Hq, D]`` -> ``out [total_q, Hq, Dv]``."""
    if not _traced(q):
        return wrapper.run(q, kv_cache, out=out, return_lse=return_lse)
    return _run("prefill_run", wrapper, q, *_kv(kv_cache), out, return_lse)


def cascade_run(wrapper, q: torch.Tensor, kv_cache, out: torch.Tensor | None = None, return_lse: bool = False):
    """``wrapper.run(...)`` of a planned ``CascadeWrapper`` (op ``flashgen::cascade_run[_out]``); as
    ``decode_run``."""
    if not _traced(q):
        return wrapper.run(q, kv_cache, out=out, return_lse=return_lse)
    return _run("cascade_run", wrapper, q, *_kv(kv_cache), out, return_lse)


def block_sparse_run(wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                     return_lse: bool = False):
    """``wrapper.run(q, k, v, ...)`` of a planned ``BlockSparseWrapper`` (op ``flashgen::block_sparse_run[_out]``).
    ``q [M, Hq, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` -> ``out [M, Hq, Dv]``."""
    if not _traced(q):
        return wrapper.run(q, k, v, out=out, return_lse=return_lse)
    return _run("block_sparse_run", wrapper, q, k, v, out, return_lse)


def variable_block_sparse_run(wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor | None = None, return_lse: bool = False):
    """``wrapper.run(q, k, v, ...)`` of a planned ``VariableBlockSparseWrapper`` (op
    ``flashgen::variable_block_sparse_run[_out]``); as ``block_sparse_run``."""
    if not _traced(q):
        return wrapper.run(q, k, v, out=out, return_lse=return_lse)
    return _run("variable_block_sparse_run", wrapper, q, k, v, out, return_lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: str | None = None, *, causal: bool = False,
              sm_scale: float | None = None, window_left: int | None = None, soft_cap: float | None = None,
              rope_theta: float | None = None, rope_scale: float | None = None, custom_mask=None,
              return_lse: bool = False):
    """``flashgen.attention`` (op ``flashgen::attention``). ``spec``: None (from the shapes and ``causal``) or, to
    trace, the spec as ``spec_json(spec)`` text (an ``AttentionSpec`` works eagerly). ``custom_mask``: packed
    uint8 bits, or None. It plans on every call, so a CUDA graph should not capture it: use a wrapper there.

    >>> out = flashgen.ops.attention(q, k, v, causal=True)   # [sq, Hq, Dv], q's dtype
    """
    if not _op_path(q):
        from ..api import attention as eager

        spec = library.spec_from_json(spec) if isinstance(spec, str) else spec
        return eager(q, k, v, spec, causal=causal, sm_scale=sm_scale, window_left=window_left, soft_cap=soft_cap,
                     rope_theta=rope_theta, rope_scale=rope_scale, custom_mask=custom_mask, return_lse=return_lse)
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"spec: under torch.compile pass flashgen.ops.spec_json(spec) (text), got "
                        f"{type(spec).__name__}")
    out, lse = library.attention(q, k, v, spec, causal, sm_scale, window_left, soft_cap, rope_theta, rope_scale,
                                 custom_mask, return_lse)
    return (out, lse) if return_lse else out


def spec_json(spec) -> str:
    """An ``AttentionSpec`` as the text ``attention`` takes under ``torch.compile`` (make it outside)."""
    from ..spec.serialize import spec_to_dict

    return json.dumps(spec_to_dict(spec), sort_keys=True)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """``flashgen.merge_state`` (op ``flashgen::merge_state``): ``(v [tokens, heads, dim], s [tokens, heads])``."""
    if not _op_path(v_a):
        from ..api import merge_state as eager

        return eager(v_a, s_a, v_b, s_b)
    return library.merge_state(v_a, s_a, v_b, s_b)


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """``flashgen.merge_state_in_place`` (op ``flashgen::merge_state_in_place``, which writes ``v`` and ``s``)."""
    if not _op_path(v):
        from ..api import merge_state_in_place as eager

        return eager(v, s, v_other, s_other, mask)
    library.merge_state_in_place(v, s, v_other, s_other, mask)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """``flashgen.merge_states`` (op ``flashgen::merge_states``): ``v [tokens, states, heads, dim]``, ``s [tokens,
    states, heads]`` -> ``(v [tokens, heads, dim], s [tokens, heads])``."""
    if not _op_path(v):
        from ..api import merge_states as eager

        return eager(v, s)
    return library.merge_states(v, s)


def append_kv(k: torch.Tensor, v: torch.Tensor, kv_cache, *, kv_indptr=None, kv_indices=None, kv_last_page_len=None,
              batch_indices=None, positions=None, slot_mapping=None, kv_layout: str = "NHD", rope=None,
              rope_scaling=None, cos_sin_cache=None, k_scale=None, v_scale=None) -> None:
    """``flashgen.append_kv`` (op ``flashgen::append_kv``, which writes the cache: one ``[pages, 2, ...]`` tensor or
    both of a ``(k_cache, v_cache)`` pair). Arguments as ``flashgen.append_kv``'s.

    >>> flashgen.ops.append_kv(k_new, v_new, kv_cache, slot_mapping=slots)
    """
    if not _op_path(k):
        from ..api import append_kv as eager

        return eager(k, v, kv_cache, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                     batch_indices=batch_indices, positions=positions, slot_mapping=slot_mapping, kv_layout=kv_layout,
                     rope=rope, rope_scaling=rope_scaling, cos_sin_cache=cos_sin_cache, k_scale=k_scale,
                     v_scale=v_scale)
    k_tensor, v_tensor = isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor)
    scaling = None if rope_scaling is None else [
        float(rope_scaling.factor), float(rope_scaling.low_freq_factor), float(rope_scaling.high_freq_factor),
        float(rope_scaling.original_max_position)]
    library.append_kv(k, v, *_kv(kv_cache), kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions,
                      slot_mapping, kv_layout, None if rope is None else [float(rope.theta), float(rope.scale)],
                      scaling, cos_sin_cache, k_scale if k_tensor else None, v_scale if v_tensor else None,
                      None if k_tensor or k_scale is None else float(k_scale),
                      None if v_tensor or v_scale is None else float(v_scale))
