"""CPU implementations of flashgen's torch ops, routed to the fp64 reference (flashgen.testing), so that the ops run,
are checked with ``torch.library.opcheck`` and are traced by ``torch.compile`` on a machine without a GPU.

``ReferenceWrapper`` stands in for a plan/run wrapper: it registers an ``op_handle`` as the wrappers do, ``plan()``
keeps the batch's tables and ``run()`` computes the reference in q's dtype. ``cpu_kernels()`` registers CPU
kernels for the ops that take no wrapper (attention, the merges, append_kv) while it is open."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from flashgen.api import handles
from flashgen.ops import library
from flashgen.spec import AttentionSpec, Causal, NoMask, Ragged
from flashgen.testing.append import append_kv_ref
from flashgen.testing.reference import merge_state_ref, merge_states_ref, reference_attention


class ReferenceWrapper:
    """A plan/run wrapper on the CPU: ``plan(**tables)`` takes ``reference_attention``'s keyword arguments (decode:
    no ``qo_indptr``, one query a request); ``run(q, kv_cache)`` or ``run(q, k, v)`` (block-sparse style)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.op_handle = handles.assign(self)
        self.tables: dict | None = None
        self.runs = 0

    def plan(self, num_qo_heads: int | None = None, num_kv_heads: int | None = None, **tables) -> None:
        self.tables = tables

    def run(self, q, kv_cache, v=None, out=None, return_lse=False):
        tables = dict(self.tables)
        tables.setdefault("qo_indptr", list(range(q.shape[0] + 1)))
        o, lse = reference_attention(self.spec, q, kv_cache if v is None else (kv_cache, v), **tables)
        self.runs += 1
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, lse.float()) if return_lse else o


def _attention(q, k, v, spec, causal, sm_scale, window_left, soft_cap, rope_theta, rope_scale, custom_mask,
               return_lse):
    spec = library.spec_from_json(spec) or AttentionSpec(
        q.shape[-1], head_dim_vo=v.shape[-1], dtype=str(q.dtype).removeprefix("torch."), kv_layout=Ragged(),
        mask=Causal() if causal else NoMask())
    o, lse = reference_attention(spec, q, (k, v), qo_indptr=[0, q.shape[0]], kv_indptr=[0, k.shape[0]],
                                 custom_mask=custom_mask, sm_scale=sm_scale, window_left=window_left,
                                 soft_cap=soft_cap, rope_theta=rope_theta, rope_scale=rope_scale)
    return o.to(q.dtype), lse.float() if return_lse else library.no_lse(q)


def _merge_state(v_a, s_a, v_b, s_b):
    v, s = merge_state_ref(v_a, s_a, v_b, s_b)
    return v.to(v_a.dtype), s.float()


def _merge_state_in_place(v, s, v_other, s_other, mask):
    merged, lse = merge_state_ref(v, s, v_other, s_other)
    keep = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask.bool()
    v[keep] = merged[keep].to(v.dtype)
    s[keep] = lse[keep].float()


def _merge_states(v, s):
    merged, lse = merge_states_ref(v, s)
    return merged.to(v.dtype), lse.float()


def _append_kv(k, v, kv_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions,
               slot_mapping, kv_layout, rope, rope_scaling, cos_sin_cache, k_scale, v_scale, k_scale_value,
               v_scale_value):
    cache = kv_cache if v_cache is None else (kv_cache, v_cache)
    ref = append_kv_ref(k, v, cache, kv_layout=kv_layout, kv_indptr=kv_indptr, kv_indices=kv_indices,
                        batch_indices=batch_indices, positions=positions, slot_mapping=slot_mapping,
                        **library.append_rope(rope, rope_scaling), cos_sin_cache=cos_sin_cache,
                        k_scale=k_scale if k_scale is not None else k_scale_value,
                        v_scale=v_scale if v_scale is not None else v_scale_value)
    if v_cache is None:
        kv_cache.copy_(ref)
    else:
        kv_cache.copy_(ref[0])
        v_cache.copy_(ref[1])


KERNELS = {"attention": _attention, "merge_state": _merge_state, "merge_state_in_place": _merge_state_in_place,
           "merge_states": _merge_states, "append_kv": _append_kv}


@contextmanager
def cpu_kernels():
    """CPU kernels (the reference math) for the ops that take no wrapper, registered while open."""
    lib = torch.library.Library("flashgen", "IMPL")
    try:
        for name, fn in KERNELS.items():
            lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()
