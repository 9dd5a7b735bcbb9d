"""Writing new tokens' K and V into a paged KV cache: ``append_kv``, one launch, no host sync, CUDA-graph safe.

Every check here reads shapes, dtypes, devices and strides only; index arrays stay on the device and are never
read on the host. Tokens whose indices point nowhere valid (a negative slot or batch index, a position beyond its
request's pages, a page id outside the pool) are skipped by the kernel, so a captured graph may pad its batch.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..kernels import ROPE_SCALING_FIELDS, rows_per_block
from ..spec import AppendSpec, Paged, RoPE
from ..spec.parts import NO_SCALING, ROPE_SCALINGS
from .checks import check_shape, check_tensor
from .device import current_stream

IN_DTYPES = (torch.float16, torch.bfloat16)
CACHE_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        CACHE_DTYPES[getattr(torch, _name)] = _name
INDEX_DTYPES = (torch.int32, torch.int64)
_I32 = (torch.int32,)
_kernels: dict[tuple, tuple] = {}


def append_kv(k: torch.Tensor, v: torch.Tensor, kv_cache, *, kv_indptr=None, kv_indices=None, kv_last_page_len=None,
              batch_indices=None, positions=None, slot_mapping=None, kv_layout: str = "NHD", rope: RoPE | None = None,
              rope_scaling: Llama31Scaling | None = None, cos_sin_cache=None, k_scale=None, v_scale=None) -> None:
    """Write ``k`` and ``v`` (one row a token) into their slots of the paged cache ``kv_cache``, in place.

    k, v: ``[tokens, num_kv_heads, head_dim]`` fp16/bf16 (rows contiguous, 16-byte aligned; token and head strides
    free, so slices of a fused QKV projection work). kv_cache: one tensor ``[pages, 2, page_size, num_kv_heads,
    head_dim]`` (``kv_layout="NHD"``; HND: ``[pages, 2, num_kv_heads, page_size, head_dim]``) or a pair ``(k_cache,
    v_cache)`` of ``[pages, page_size, num_kv_heads, head_dim]`` (HND: ``[pages, num_kv_heads, page_size,
    head_dim]``), in k's dtype or fp8 (e4m3fn / e5m2: quantised, ``cache = fp8(x / scale)``, saturated); any
    page size.

    Where each token goes, one of:
      - CSR (FlashInfer's ``append_paged_kv_cache``): ``kv_indptr [batch + 1]`` and ``kv_indices`` int32 (the
        requests' pages), ``batch_indices [tokens]`` and ``positions [tokens]`` (int32 or int64): token t lands at
        position ``positions[t]`` of request ``batch_indices[t]``. ``kv_last_page_len`` is accepted for
        FlashInfer's signature and not read; a negative batch index skips the token.
      - ``slot_mapping [tokens]`` (vLLM; int32 or int64): ``page * page_size + offset``, -1 skips the token.
    All index arrays on k's device.

    RoPE on K (v is never rotated), at ``positions[t]`` (with slot_mapping, pass ``positions`` too):
    ``rope=flashgen.RoPE(theta, scale)`` (Llama halves), optionally ``rope_scaling=Llama31Scaling(...)`` or
    ``YaRNScaling(...)`` (or ``RoPE(..., scaling=...)``; YaRN's attention factor multiplies the rotated K); or
    ``cos_sin_cache``: float32 ``[max_position, head_dim]``, cos in the first half, sin in the second (FlashInfer's
    and vLLM's neox table, full head_dim rotary only); a position outside its rows skips the token.

    Scales (fp8 caches only, dequantisation scales: ``x ~ cache * scale``): ``k_scale`` / ``v_scale`` floats
    (per tensor, default 1.0) or float32 device tensors of ``[num_kv_heads]`` (per head) or ``[1]``.

    Example::

        flashgen.append_kv(k_new, v_new, kv_cache, slot_mapping=slots, positions=pos,
                           rope=flashgen.RoPE(500000.0), rope_scaling=flashgen.Llama31Scaling())
    """
    check_tensor("k", k, dtypes=IN_DTYPES, ndim=3, contiguous=False)
    device = k.device
    check_tensor("v", v, dtypes=(k.dtype,), ndim=3, device=device, contiguous=False)
    check_shape("v", v, tuple(k.shape))
    tokens, heads, dim = k.shape
    for name, t in (("k", k), ("v", v)):
        _check_rows(name, t)
    k_cache, v_cache, page_size, strides = _cache(kv_cache, kv_layout, heads, dim, k.dtype, device)
    index_dtype, table = _page_table(tokens, device, kv_indptr, kv_indices, kv_last_page_len, batch_indices,
                                     positions, slot_mapping, rope is not None or cos_sin_cache is not None)
    rope_kind, rope_fields = _rope(rope, rope_scaling, cos_sin_cache, dim, device)
    scales, scale_fields = _scales(k_scale, v_scale, k_cache.dtype, heads, device)
    spec = AppendSpec(dim, CACHE_DTYPES[k.dtype], CACHE_DTYPES[k_cache.dtype], Paged(page_size, kv_layout),
                      rope=rope_kind, scales=scales, page_table="csr" if slot_mapping is None else "slot_mapping",
                      index_dtype=str(index_dtype)[len("torch."):])
    rows = tokens * heads
    if rows == 0:
        return
    if rows >= 2**31:
        raise ValueError(f"k: {tokens} tokens x {heads} heads = {rows} rows, expected fewer than 2^31 a call")
    fn, block, per_block, names = _kernel(spec, device)
    fields = {
        "k": k.data_ptr(), "v": v.data_ptr(), "k_cache": k_cache.data_ptr(), "v_cache": v_cache.data_ptr(),
        **table, **rope_fields, **scale_fields,
        "k_stride_token": k.stride(0), "k_stride_head": k.stride(1),
        "v_stride_token": v.stride(0), "v_stride_head": v.stride(1),
        "stride_page": strides[0], "stride_token": strides[1], "stride_head": strides[2],
        "num_pages": k_cache.shape[0], "num_rows": rows, "num_kv_heads": heads,
    }
    fn.launch(((rows + per_block - 1) // per_block, 1, 1), block, 0, current_stream(device.index),
              *[fields[name] for name in names])


def _kernel(spec: AppendSpec, device: torch.device) -> tuple:
    """(function, block, rows a CTA, params field names) of ``spec``'s kernel on ``device``, loaded once."""
    key = (spec, device.index)
    found = _kernels.get(key)
    if found is None:
        from ..jit import build

        kernel = build(spec, "append", device=device.index)
        found = _kernels[key] = (kernel["append_kv"], kernel.launch_config.block, rows_per_block(spec),
                                 kernel.params["append_kv"].names())
    return found


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Rows contiguous and every row 16-byte aligned (the kernel moves 16-byte vectors)."""
    item = t.element_size()
    if t.stride(-1) != 1 or any(s * item % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{name}: rows must be contiguous and 16-byte aligned, got strides {t.stride()} "
                         f"(elements of {item} bytes) at address {t.data_ptr():#x}")


def _cache(kv_cache, layout: str, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
    """(k_cache, v_cache, page_size, (stride_page, stride_token, stride_head)) of a checked cache."""
    if layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: got {layout!r}, expected 'NHD' or 'HND'")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache: expected a (k_cache, v_cache) pair, got {len(kv_cache)} items")
        pair, names = tuple(kv_cache), ("kv_cache[0] (k)", "kv_cache[1] (v)")
    elif isinstance(kv_cache, torch.Tensor):
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache: expected one [pages, 2, ...] tensor (5 dims) or a (k_cache, v_cache) "
                             f"pair, got shape {tuple(kv_cache.shape)}")
        pair, names = (kv_cache[:, 0], kv_cache[:, 1]), ("kv_cache[:, 0] (k)", "kv_cache[:, 1] (v)")
    else:
        raise TypeError(f"kv_cache: expected a tensor or a (k_cache, v_cache) pair, got {type(kv_cache).__name__}")
    for name, t in zip(names, pair):
        check_tensor(name, t, dtypes=tuple(CACHE_DTYPES), ndim=4, device=device, contiguous=False)
    k_cache, v_cache = pair
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"kv_cache: k and v caches must share dtype, shape and strides, got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} and {v_cache.dtype} {tuple(v_cache.shape)} "
                         f"{v_cache.stride()}")
    if k_cache.dtype in IN_DTYPES and k_cache.dtype != dtype:
        raise TypeError(f"kv_cache: dtype {k_cache.dtype}; a 16-bit cache holds k's dtype ({dtype}), an fp8 one "
                        "(float8_e4m3fn / float8_e5m2) is written quantised")
    token_dim, head_dim_ = (1, 2) if layout == "NHD" else (2, 1)
    shape = tuple(k_cache.shape)
    if shape[head_dim_] != heads or shape[3] != dim or shape[token_dim] < 1:
        expect = "[pages, page_size, num_kv_heads, head_dim]" if layout == "NHD" else \
            "[pages, num_kv_heads, page_size, head_dim]"
        raise ValueError(f"kv_cache: expected {expect} ({layout}) with num_kv_heads = {heads} and head_dim = {dim} "
                         f"(k's), got {shape}")
    for name, t in zip(names, pair):
        _check_rows(name, t)
    return k_cache, v_cache, shape[token_dim], (k_cache.stride(0), k_cache.stride(token_dim),
                                                k_cache.stride(head_dim_))


def _token_array(name: str, t, tokens: int, device: torch.device, dtypes=INDEX_DTYPES) -> torch.Tensor:
    check_tensor(name, t, dtypes=dtypes, ndim=1, device=device)
    if t.shape[0] != tokens:
        raise ValueError(f"{name}: expected shape ({tokens},) (one entry a token of k), got {tuple(t.shape)}")
    return t


def _page_table(tokens, device, kv_indptr, kv_indices, kv_last_page_len, batch_indices, positions, slot_mapping,
                needs_positions: bool) -> tuple[torch.dtype, dict]:
    """(the per-token index dtype, the params fields of the page table)."""
    fields = {"batch_indices": 0, "positions": 0, "slot_mapping": 0, "kv_indptr": 0, "kv_indices": 0,
              "batch_size": 0}
    if slot_mapping is not None:
        if any(x is not None for x in (kv_indptr, kv_indices, kv_last_page_len, batch_indices)):
            raise ValueError("slot_mapping: give slot_mapping (with positions for RoPE) or the CSR arrays "
                             "(kv_indptr, kv_indices, batch_indices, positions), not both")
        dtype = _token_array("slot_mapping", slot_mapping, tokens, device).dtype
        fields["slot_mapping"] = slot_mapping.data_ptr()
        if positions is None and needs_positions:
            raise ValueError("positions: RoPE rotates K at each token's position; with slot_mapping pass "
                             "positions [tokens] too")
    else:
        if kv_indptr is None or kv_indices is None or batch_indices is None or positions is None:
            raise ValueError("kv_indptr: append_kv takes slot_mapping, or kv_indptr, kv_indices, batch_indices and "
                             "positions (FlashInfer's append_paged_kv_cache; kv_last_page_len optional)")
        check_tensor("kv_indptr", kv_indptr, dtypes=_I32, ndim=1, device=device)
        if kv_indptr.shape[0] < 1:
            raise ValueError("kv_indptr: expected shape (batch_size + 1,), got (0,)")
        check_tensor("kv_indices", kv_indices, dtypes=_I32, ndim=1, device=device)
        batch = kv_indptr.shape[0] - 1
        if kv_last_page_len is not None:
            check_tensor("kv_last_page_len", kv_last_page_len, dtypes=_I32, ndim=1, device=device)
            check_shape("kv_last_page_len", kv_last_page_len, (batch,))
        dtype = _token_array("batch_indices", batch_indices, tokens, device).dtype
        fields.update(batch_indices=batch_indices.data_ptr(), kv_indptr=kv_indptr.data_ptr(),
                      kv_indices=kv_indices.data_ptr(), batch_size=batch)
    if positions is not None:
        _token_array("positions", positions, tokens, device, (dtype,))
        fields["positions"] = positions.data_ptr()
    return dtype, fields


def _rope(rope, scaling, cos_sin_cache, dim: int, device: torch.device) -> tuple[str, dict]:
    """(the spec's rope kind, its params fields)."""
    fields = {"cos_sin_cache": 0, "cos_sin_rows": 0, "rope_rcp_scale": 1.0, "rope_log2_theta": 0.0}
    fields.update(rope_scaling_fields(NO_SCALING))
    if scaling is not None and rope is None:
        raise ValueError("rope_scaling: scales RoPE's frequencies; give rope=flashgen.RoPE(theta, scale) too")
    if cos_sin_cache is not None:
        if rope is not None:
            raise ValueError("cos_sin_cache: give rope (theta, scale) or a cos/sin table, not both")
        check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2, device=device, align=16)
        if cos_sin_cache.shape[1] != dim:
            raise ValueError(f"cos_sin_cache: expected [max_position, {dim}] (cos then sin over the whole head_dim; "
                             f"a partial rotary dim is not supported), got {tuple(cos_sin_cache.shape)}")
        fields.update(cos_sin_cache=cos_sin_cache.data_ptr(), cos_sin_rows=cos_sin_cache.shape[0])
        return "cos_sin_cache", fields
    if rope is None:
        return "none", fields
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope: expected None or flashgen.RoPE(theta, scale), got {rope!r}")
    if scaling is None:
        scaling = rope.scaling  # RoPE(scaling=...) as an attention spec holds it
    elif rope.scaling is not None and scaling != rope.scaling:
        raise ValueError(f"rope_scaling: got {scaling!r} and rope.scaling {rope.scaling!r}; give one")
    if scaling is not None:
        if not isinstance(scaling, ROPE_SCALINGS):
            raise TypeError(f"rope_scaling: expected None, flashgen.Llama31Scaling(...) or flashgen.YaRNScaling(...), "
                            f"got {scaling!r}")
        fields.update(rope_scaling_fields(scaling.rope_terms(rope.theta, dim)))
    fields.update(rope_rcp_scale=1.0 / rope.scale, rope_log2_theta=math.log2(rope.theta))
    return "rope", fields


def rope_scaling_fields(terms: tuple[float, float, float, float, float]) -> dict:
    """The params fields (``ROPE_SCALING_FIELDS``) of a scaling's ``rope_terms`` (common/rope.cuh:
    ``rope_rotate_scaled``)."""
    return dict(zip((name for _, name in ROPE_SCALING_FIELDS), terms))


def _scales(k_scale, v_scale, cache_dtype: torch.dtype, heads: int, device: torch.device) -> tuple[str, dict]:
    """(the spec's scales kind, its params fields)."""
    fields = {"k_scales": 0, "v_scales": 0, "scale_stride": 0, "k_rcp_scale": 1.0, "v_rcp_scale": 1.0}
    if cache_dtype in IN_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale: scales quantise to an fp8 cache; this cache is {cache_dtype}")
        return "per_tensor", fields
    tensors = [isinstance(s, torch.Tensor) for s in (k_scale, v_scale)]
    if any(tensors):
        if not all(tensors):
            raise ValueError("k_scale: give k_scale and v_scale both as floats or both as tensors")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, s, dtypes=(torch.float32,), ndim=1, device=device)
            if s.shape[0] not in (1, heads):
                raise ValueError(f"{name}: expected shape ({heads},) (per kv head) or (1,), got {tuple(s.shape)}")
        if k_scale.shape != v_scale.shape:
            raise ValueError(f"v_scale: expected k_scale's shape {tuple(k_scale.shape)}, got {tuple(v_scale.shape)}")
        fields.update(k_scales=k_scale.data_ptr(), v_scales=v_scale.data_ptr(), scale_stride=int(k_scale.shape[0] > 1))
        return "per_head", fields
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real) or not (0 < s < math.inf)):
            raise ValueError(f"{name}: got {s!r}, expected None, a finite float > 0 or a float32 device tensor")
    fields.update(k_rcp_scale=1.0 / (1.0 if k_scale is None else float(k_scale)),
                  v_rcp_scale=1.0 / (1.0 if v_scale is None else float(v_scale)))
    return "per_tensor", fields
