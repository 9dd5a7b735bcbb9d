"""Fused append + decode (``BatchDecodeWrapper(..., kernel_options={"append": True})``): the checks of ``run()``'s
``k_new`` / ``v_new`` (O(1): attributes only, no sync) and the params fields filled at ``plan()``.
"""

from __future__ import annotations

import torch

from ..spec import AttentionSpec


def wants_append(options: dict | None) -> bool:
    """Whether kernel ``options`` turn fused append on (the family checks the value)."""
    return bool(options) and options.get("append", False) is True


def append_fields(k_scale: float, v_scale: float) -> dict:
    """The reciprocal scales the new rows are quantised with (1 for a 16-bit cache; plan() checked both)."""
    return {"k_rcp_scale": 1.0 / k_scale, "v_rcp_scale": 1.0 / v_scale}


def check_new_rows(enabled: bool, k_new, v_new, q: torch.Tensor, num_kv_heads: int, spec: AttentionSpec) -> tuple:
    """``run()``'s ``k_new [batch, num_kv_heads, head_dim]`` and ``v_new [batch, num_kv_heads, head_dim_vo]``:
    given exactly when the wrapper fuses the append; q's dtype and device, one row a request of q, rows
    contiguous and 16-byte aligned. Returns the kernel's run-time values (``APPEND_RUNTIME_FIELDS``: the two
    addresses, then the token and head strides of each); raises naming the argument. A few attribute reads a
    tensor (the error path, which says what is wrong, runs only on a mismatch)."""
    if not enabled:
        name = "k_new" if k_new is not None else "v_new"
        raise ValueError(f"{name}: fused append + decode needs a wrapper built with kernel_options={{'append': "
                         "True}}; or write the rows with flashgen.append_kv first")
    rows, dtype, index = q.shape[0], q.dtype, q.get_device()
    try:  # 16-bit elements: 16-byte rows are strides of multiples of 8
        k0, k1, k2 = k_new.stride()
        v0, v1, v2 = v_new.stride()
        k_ptr, v_ptr = k_new.data_ptr(), v_new.data_ptr()
        if (k_new.dtype is dtype and v_new.dtype is dtype and k_new.shape == (rows, num_kv_heads, spec.head_dim)
                and v_new.shape == (rows, num_kv_heads, spec.head_dim_vo) and k2 == 1 and v2 == 1
                and not (k0 | k1 | v0 | v1) % 8 and not (k_ptr | v_ptr) % 16 and k_new.get_device() == index
                and v_new.get_device() == index):
            return k_ptr, v_ptr, k0, k1, v0, v1
    except (AttributeError, TypeError, ValueError):
        pass
    for name, t, dim in (("k_new", k_new, spec.head_dim), ("v_new", v_new, spec.head_dim_vo)):
        _explain(name, t, q, (rows, num_kv_heads, dim))
    raise AssertionError("unreachable: _explain raises for a bad k_new / v_new")


def _explain(name: str, t, q: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """Raise naming ``name`` and what is wrong with it, if anything."""
    if t is None:
        raise ValueError(f"{name}: a wrapper built with kernel_options={{'append': True}} takes k_new and v_new "
                         f"[batch, num_kv_heads, head_dim] at every run()")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
    if t.get_device() != q.get_device():
        raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got one on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (one row a request of q: [batch, num_kv_heads, "
                         f"head_dim]), got {tuple(t.shape)}")
    item = t.element_size()
    if t.stride(2) != 1 or (t.stride(0) * item) % 16 or (t.stride(1) * item) % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name}: rows must be contiguous and 16-byte aligned, got strides {t.stride()} "
                         f"(elements of {item} bytes) at address {t.data_ptr():#x}")
