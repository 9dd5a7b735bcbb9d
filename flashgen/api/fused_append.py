"""Fused append + decode (``BatchDecodeWrapper(..., kernel_options={"append": True})``) and the RoPE scaling params
of the attention kernels: the checks of ``run()``'s ``k_new`` / ``v_new`` (O(1): attributes only, no sync) and the
params fields filled at ``plan()``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..spec import AttentionSpec, RoPE

_SCALING_NAMES = ("rope_rcp_factor", "rope_smooth_a", "rope_smooth_b", "rope_smooth_c", "rope_mscale")


def wants_append(options: dict | None) -> bool:
    """Whether kernel ``options`` turn fused append on (the family checks the value)."""
    return bool(options) and options.get("append", False) is True


@lru_cache(maxsize=64)
def _scaling_fields(rope: RoPE, theta: float, head_dim: int) -> dict:
    return dict(zip(_SCALING_NAMES, rope.rope_terms(head_dim, theta)))


def rope_scaling_params(spec: AttentionSpec, runtime) -> dict:
    """The params fields of the spec's RoPE scaling (``family.ROPE_SCALING_FIELDS``) at the plan's theta, or {}
    without a scaling (the kernel then has no such fields)."""
    rope = spec.pos_encoding
    if not isinstance(rope, RoPE) or rope.scaling is None:
        return {}
    return _scaling_fields(rope, 2.0 ** runtime.rope_log2_theta, spec.head_dim)


def append_fields(k_scale: float, v_scale: float) -> dict:
    """The reciprocal scales the new rows are quantised with (1 for a 16-bit cache; plan() checked both)."""
    return {"k_rcp_scale": 1.0 / k_scale, "v_rcp_scale": 1.0 / v_scale}


def check_new_rows(enabled: bool, k_new, v_new, q: torch.Tensor, num_kv_heads: int, spec: AttentionSpec) -> None:
    """``run()``'s ``k_new [batch, num_kv_heads, head_dim]`` and ``v_new [batch, num_kv_heads, head_dim_vo]``:
    given exactly when the wrapper fuses the append; q's dtype and device, one row a request of q, rows
    contiguous and 16-byte aligned. Raises naming the argument."""
    if not enabled:
        name = "k_new" if k_new is not None else "v_new"
        raise ValueError(f"{name}: fused append + decode needs a wrapper built with kernel_options={{'append': "
                         "True}}; or write the rows with flashgen.append_kv first")
    rows = q.shape[0]
    for name, t, dim in (("k_new", k_new, spec.head_dim), ("v_new", v_new, spec.head_dim_vo)):
        if t is None:
            raise ValueError(f"{name}: a wrapper built with kernel_options={{'append': True}} takes k_new and v_new "
                             f"[batch, num_kv_heads, head_dim] at every run()")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got one on {t.device}")
        if t.dim() != 3 or t.shape[0] != rows or t.shape[1] != num_kv_heads or t.shape[2] != dim:
            raise ValueError(f"{name}: expected shape ({rows}, {num_kv_heads}, {dim}) (one row a request of q: "
                             f"[batch, num_kv_heads, head_dim]), got {tuple(t.shape)}")
        item = t.element_size()
        if t.stride(2) != 1 or (t.stride(0) * item) % 16 or (t.stride(1) * item) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name}: rows must be contiguous and 16-byte aligned, got strides {t.stride()} "
                             f"(elements of {item} bytes) at address {t.data_ptr():#x}")
