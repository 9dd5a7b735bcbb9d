"""Dtype-aware closeness for attention outputs (the FA3 / PyTorch-flex rule).

A kernel's output passes when ``err(out vs fp64) <= 2 * err(same-dtype math vs fp64) + noise_floor``:
the bound scales with what the input dtype can express instead of a bare 1e-3. NaN never passes.
"""

from __future__ import annotations

import torch

from flashgen.spec import AttentionSpec

from .reference import reference_attention

# unit roundoff of the output dtype; a kernel's rounding of the final output alone costs this much
_EPS = {
    torch.float16: 2.0 ** -11,
    torch.bfloat16: 2.0 ** -8,
    torch.float32: 2.0 ** -24,
    torch.float64: 2.0 ** -53,
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def noise_floor(dtype: torch.dtype, ref: torch.Tensor, kv_dtype: torch.dtype | None = None) -> float:
    """Absolute error allowed on top of the same-dtype bound: 4 roundoffs of ``dtype`` at ``max|ref|``.

    fp8 KV (dequantised in different orders by different kernels) doubles it. Example:
    ``noise_floor(torch.bfloat16, ref)`` is about ``0.016 * max|ref|`` (at least ``0.016 * 1e-3``).
    """
    finite = ref[torch.isfinite(ref)]
    scale = max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-3)
    factor = 2.0 if kv_dtype in _FP8 else 1.0
    return 4.0 * _EPS.get(dtype, 2.0 ** -8) * scale * factor


def same_dtype_reference(spec: AttentionSpec, q: torch.Tensor, kv: object, **kwargs
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference math in the inputs' dtype (matrix products in q's dtype, softmax in fp32).

    Same arguments as ``reference_attention``; fp8 K/V are converted to q's dtype first. Returns
    ``(out, lse)`` as fp64 tensors holding the low-precision result: the error yardstick for a kernel.
    """
    return reference_attention(spec, q, kv, low_precision=True, **kwargs)


def _max_error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    both_neginf = torch.isneginf(a) & torch.isneginf(b)
    diff = torch.where(both_neginf, torch.zeros_like(b), (a.double() - b.double()).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    if diff.numel() == 0:
        return 0.0, ()
    flat = int(torch.argmax(diff))
    return float(diff.reshape(-1)[flat]), tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


def assert_attention_close(out: torch.Tensor, ref_fp64: torch.Tensor, same_dtype_ref: torch.Tensor, *,
                           dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                           name: str = "out") -> None:
    """Assert ``max|out - ref_fp64| <= 2 * max|same_dtype_ref - ref_fp64| + noise_floor``.

    ``out``: the kernel's output (any float dtype, e.g. ``[total_q, num_qo_heads, head_dim_vo]`` bf16, or
    an lse ``[total_q, num_qo_heads]``); ``ref_fp64``: ``reference_attention``'s; ``same_dtype_ref``:
    ``same_dtype_reference``'s. ``dtype`` (defaults to ``out.dtype``; pass q's dtype when checking an
    fp32 lse) sets the floor. ``-inf`` must match ``-inf`` exactly (fully masked rows); NaN always fails.
    The message gives both errors, the bound and the index of the worst element.

    Example::

        ref, ref_lse = reference_attention(spec, q, kv, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        low, low_lse = same_dtype_reference(spec, q, kv, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        assert_attention_close(out, ref, low)
        assert_attention_close(lse, ref_lse, low_lse, dtype=q.dtype, name="lse")
    """
    if out.shape != ref_fp64.shape or same_dtype_ref.shape != ref_fp64.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} vs reference {tuple(ref_fp64.shape)} "
                             f"vs same-dtype reference {tuple(same_dtype_ref.shape)}")
    dtype = out.dtype if dtype is None else dtype
    if torch.isnan(out).any():
        where = tuple(int(i) for i in torch.nonzero(torch.isnan(out))[0])
        raise AssertionError(f"{name}: NaN at {where} ({int(torch.isnan(out).sum())} NaNs)")
    err, where = _max_error(out, ref_fp64)
    base, base_where = _max_error(same_dtype_ref, ref_fp64)
    floor = noise_floor(dtype, ref_fp64, kv_dtype)
    bound = 2.0 * base + floor
    if not err <= bound:
        got = float(out[where]) if where else float("nan")
        raise AssertionError(
            f"{name}: max |{name} - fp64| = {err:.3e} at {where} ({name} {got:.6g} vs fp64 "
            f"{float(ref_fp64[where]):.6g}) exceeds the bound {bound:.3e} = 2 * {base:.3e} (same-dtype "
            f"error, worst at {base_where}) + {floor:.3e} (noise floor, {dtype})")
