"""Check a kernel's attention against the fp64 reference: poison the outputs, run, compare with a dtype-aware bound.

``check_attention(run, spec, q, kv, **reference_kwargs)`` is the whole recipe of a kernel test: it hands
``run`` a NaN-filled ``out``, poisons the block the next ``lse`` allocation of that size is likely to get,
calls ``run(out)``, computes the fp64 reference and the same-dtype reference once, and asserts ``out`` and
``lse`` with ``tolerance.assert_attention_close``. ``assert_matches_reference`` is the comparing half alone,
for outputs a test already holds (a captured CUDA graph's, poisoned before each replay, or a wrapper's own
allocation); ``assert_merge_close`` checks merged states against ``merge_states_ref``. Imports torch and
``flashgen.testing`` only: never the wrappers or a compiled kernel.
"""

from __future__ import annotations

from typing import Callable

import torch

from flashgen.spec import AttentionSpec

from .reference import reference_attention
from .tolerance import assert_attention_close, same_dtype_reference


def nan_out(spec: AttentionSpec, q: torch.Tensor, *, rows: int | None = None, device="cuda") -> torch.Tensor:
    """A NaN-filled ``out [rows, num_qo_heads, head_dim_vo]`` in q's dtype (``rows`` defaults to ``q.shape[0]``).

    A row the kernel never writes stays NaN, which no check lets pass.

    >>> nan_out(AttentionSpec(64, head_dim_vo=32), torch.zeros(3, 2, 64), device="cpu").shape
    torch.Size([3, 2, 32])
    """
    rows = q.shape[0] if rows is None else rows
    return torch.full((rows, q.shape[1], spec.head_dim_vo), float("nan"), dtype=q.dtype, device=device)


def poison_allocator(shape, dtype: torch.dtype, device="cuda") -> None:
    """Free a NaN-filled block of this shape so the caching allocator's next allocation of it starts poisoned.

    For outputs a kernel entry point allocates itself (``lse``, ``merge_states``'s out): best effort, as the
    allocator may hand that block to another tensor of the same size first. A no-op on the CPU.
    """
    if torch.device(device).type == "cpu":
        return
    junk = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    del junk


def assert_matches_reference(spec: AttentionSpec, q: torch.Tensor, kv: object, out: torch.Tensor,
                             lse: torch.Tensor | None = None, *, kv_dtype: torch.dtype | None = None,
                             **reference_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Assert ``out`` (and ``lse``) against ``reference_attention(spec, q, kv, **reference_kwargs)``.

    ``q [total_q, num_qo_heads, head_dim]`` and ``kv`` (in ``spec.kv_layout``) are the inputs as the reference
    reads them (CPU, or CUDA to run the reference there; the comparison runs on q's device);
    ``out [total_q, num_qo_heads, head_dim_vo]`` and ``lse [total_q, num_qo_heads]`` fp32 may live on any device. The bound is ``2 * err(same-dtype math vs fp64) + noise_floor`` (the lse's floor in q's
    dtype; ``kv_dtype``: an fp8 cache's dtype, which doubles it); ``-inf`` must match ``-inf``, NaN never
    passes. ``reference_kwargs``: the page table, ``qo_indptr``, ``custom_mask`` and runtime values, as
    ``reference_attention`` takes them. Returns the fp64 ``(out, lse)``.

    Example::

        out, lse = graph_out[:n], graph_lse[:n]
        assert_matches_reference(spec, q, kv, out, lse, qo_indptr=qo_indptr, kv_indptr=kv_indptr)
    """
    ref, ref_lse = reference_attention(spec, q, kv, **reference_kwargs)
    low, low_lse = same_dtype_reference(spec, q, kv, **reference_kwargs)
    assert_attention_close(out.to(ref.device), ref, low, kv_dtype=kv_dtype)
    if lse is not None:
        assert_attention_close(lse.to(ref.device), ref_lse, low_lse, dtype=q.dtype, kv_dtype=kv_dtype, name="lse")
    return ref, ref_lse


def check_attention(run: Callable[[torch.Tensor], object], spec: AttentionSpec, q: torch.Tensor, kv: object, *,
                    lse: bool = True, rows: int | None = None, device="cuda", kv_dtype: torch.dtype | None = None,
                    **reference_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a kernel into poisoned outputs and assert the result against the fp64 reference.

    ``run(out)`` launches the kernel into ``out`` (``nan_out(spec, q, rows=rows)`` on ``device``) and returns
    ``(out, lse)``, or ``out`` alone when ``lse=False``; the returned out must be the buffer it was given.
    Before the call, the block an fp32 ``lse [rows, num_qo_heads]`` allocation would get is filled with NaN.
    ``rows`` (defaults to ``q.shape[0]``): a buffer with capacity past the batch (CUDA-graph wrappers); the
    first ``q.shape[0]`` rows are checked. ``q``, ``kv``, ``kv_dtype`` and ``reference_kwargs`` are as for
    ``assert_matches_reference`` (the reference's inputs: ``run`` may read other copies, e.g. fp8 or on the GPU).
    Returns what ``run`` returned, as ``(out, lse)`` (``lse`` None when ``lse=False``).

    Example::

        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, **table)
        out, lse = check_attention(lambda out: wrapper.run(q.cuda(), kv_gpu, out=out, return_lse=True),
                                   spec, q, kv, qo_indptr=qo_indptr, **table)
    """
    buffer = nan_out(spec, q, rows=rows, device=device)
    poison_allocator(buffer.shape[:2], torch.float32, device)
    result = run(buffer)
    if lse:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise AssertionError(f"run: expected (out, lse), got {type(result).__name__}")
        out, out_lse = result
    else:
        out, out_lse = result, None
    if out is not buffer and (out.data_ptr() != buffer.data_ptr() or out.shape != buffer.shape):
        raise AssertionError("out: run() returned a tensor other than the poisoned buffer it was given")
    n = q.shape[0]
    assert_matches_reference(spec, q, kv, out[:n], None if out_lse is None else out_lse[:n], kv_dtype=kv_dtype,
                             **reference_kwargs)
    return out, out_lse


def assert_merge_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """Assert merged states against ``merge_state_ref`` / ``merge_states_ref`` (fp64).

    ``out [tokens, heads, head_dim]`` (fp16, bf16 or fp32), ``lse [tokens, heads]`` fp32, on any device; the
    references on the same device. No NaN; ``-inf`` exactly where the reference has it (every partial empty),
    and there ``out = 0``; ``|lse - ref| < 1e-5 * (1 + max|ref|)`` elsewhere; ``max|out - ref| <= 2 * max|ref
    rounded to out's dtype - ref| + 1e-5 * max|ref|`` (the fp32 merge rounded once to the output dtype).
    """
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        raise AssertionError(f"out, lse: shapes {tuple(out.shape)}, {tuple(lse.shape)} vs reference "
                             f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}")
    if torch.isnan(out).any() or torch.isnan(lse).any():
        name, t = ("out", out) if torch.isnan(out).any() else ("lse", lse)
        raise AssertionError(f"{name}: NaN at {tuple(int(i) for i in torch.nonzero(torch.isnan(t))[0])} "
                             f"({int(torch.isnan(t).sum())} NaNs)")
    wrong = lse.isneginf() != ref_lse.isneginf()
    if wrong.any():
        where = tuple(int(i) for i in torch.nonzero(wrong)[0])
        raise AssertionError(f"lse: {float(lse[where])} at {where}, reference {float(ref_lse[where])} (-inf marks "
                             f"a row whose partials are all empty; {int(wrong.sum())} rows differ)")
    finite = ref_lse.isfinite()
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        bound = 1e-5 * (1 + ref_lse[finite].abs().max().item())
        if not lse_err < bound:
            raise AssertionError(f"lse: max |lse - fp64| = {lse_err:.3e} exceeds {bound:.3e}")
    err_same = (ref_out.to(out.dtype).double() - ref_out).abs().max().item() if ref_out.numel() else 0.0
    err = (out.double() - ref_out).abs().max().item() if ref_out.numel() else 0.0
    bound = 2 * err_same + 1e-5 * (ref_out.abs().max().item() if ref_out.numel() else 0.0)
    if not err <= bound:
        raise AssertionError(f"out: max |out - fp64| = {err:.3e} exceeds the bound {bound:.3e} = 2 * {err_same:.3e} "
                             f"(rounding the fp64 merge to {out.dtype}) + 1e-5 * max|ref|")
    if not bool(torch.all(out[~finite] == 0)):
        raise AssertionError("out: not 0 in a row whose partials are all empty (lse -inf)")
