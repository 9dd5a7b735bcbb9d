"""VariableBlockSparseWrapper: block-sparse attention whose blocks vary in size and whose pattern is per kv head.

Every (kv head, block row) is a request of an inner problem with one kv head: its queries are that block row's
rows of the head's GQA group, its pages the kept column blocks of that head, cut into pages of ``P`` tokens (the
gcd of the column sizes, so every block is whole pages). With NHD K ``[N, Hkv, D]``, the rows of head h from
token s on start at element ``(s * Hkv + h) * D``: a page with page id ``s * Hkv + h``, page stride ``D`` and
token stride ``Hkv * D`` (the pages overlap in memory, which a kernel that only reads does not mind). So every
head's own page lists run in one launch of the paged prefill, over K and V in place.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..plan import PlanError
from ..plan.host import check_heads, host_array, host_values
from ..spec import ALiBi, AttentionSpec, Paged, Ragged, SpecError
from . import handles
from .backends import BACKENDS
from .block_sparse import check_prefill_spec, positions_options, sm90_reads_whole_pages
from .kv_inputs import KVView
from .prefill import BatchPrefillWrapper, prefill_kv_view
from .sparse_pages import position_free
from .wrapper import resolve_device


def variable_page_table(block_mask_map, block_row_sz, block_col_sz):
    """The inner problem of a variable-block pattern: ``(M, N, P, qo_indptr, kv_indptr, kv_indices,
    kv_last_page_len)``, numpy int64; request ``h * MB + i`` is kv head h's block row i.

    >>> [np.asarray(a).tolist() for a in variable_page_table([[[1, 0], [1, 1]]], [[1, 2]], [[2, 4]])[3:]]
    [[0, 1, 3], [0, 1, 4], [0, 0, 2, 4], [2, 2]]
    """
    mask = host_values("block_mask_map", block_mask_map)
    if mask.ndim != 3 or mask.dtype.kind not in "bui":
        raise PlanError(f"block_mask_map: expected bool [num_kv_heads, MB, NB], got {mask.dtype} {mask.shape}")
    heads, rows, cols = mask.shape
    row_sz = _sizes("block_row_sz", block_row_sz, (heads, rows))
    col_sz = _sizes("block_col_sz", block_col_sz, (heads, cols))
    m, n = _total("block_row_sz", row_sz, "M"), _total("block_col_sz", col_sz, "N")
    if n * heads >= 2**31:
        raise PlanError(f"block_col_sz: N x num_kv_heads = {n * heads} page ids, more than int32 holds")
    p = int(np.gcd.reduce(col_sz.reshape(-1))) if col_sz.size else 1
    p = max(p, 1)
    hh, ii, jj = np.nonzero(mask)  # row-major: requests (h, i) in order, each request's blocks ascending
    col_start = np.cumsum(col_sz, axis=1) - col_sz
    pages = col_sz[hh, jj] // p
    kv_indptr = np.zeros(heads * rows + 1, np.int64)
    np.cumsum(np.bincount(hh * rows + ii, weights=pages, minlength=heads * rows).astype(np.int64), out=kv_indptr[1:])
    first = np.repeat(col_start[hh, jj] * heads + hh, pages)
    within = np.arange(first.size) - np.repeat(np.cumsum(pages) - pages, pages)
    kv_indices = first + within * (p * heads)
    last = np.where(np.diff(kv_indptr) > 0, p, 0)
    qo_indptr = np.concatenate([[0], np.cumsum(row_sz.reshape(-1))])
    return m, n, p, qo_indptr, kv_indptr, kv_indices, last


def _sizes(name: str, value, shape: tuple[int, int]) -> np.ndarray:
    sizes = host_array(name, value, 2)
    if sizes.shape != shape:
        raise PlanError(f"{name}: has shape {sizes.shape}, expected [num_kv_heads, blocks] = {list(shape)} "
                        "(block_mask_map's)")
    if sizes.size and sizes.min() < 0:
        h, b = (int(x[0]) for x in np.nonzero(sizes < 0))
        raise PlanError(f"{name}[{h}, {b}] = {int(sizes[h, b])}, expected a size >= 0")
    return sizes.astype(np.int64, copy=False)


def _total(name: str, sizes: np.ndarray, what: str) -> int:
    totals = sizes.sum(axis=1)
    if totals.size and (totals != totals[0]).any():
        h = int(np.flatnonzero(totals != totals[0])[0])
        raise PlanError(f"{name}: head {h}'s blocks sum to {int(totals[h])}, head 0's to {int(totals[0])}; every kv "
                        f"head's blocks must cover the same {what}")
    return int(totals[0]) if totals.size else 0


def overlapping_pages_backend(spec: AttentionSpec, backend: str) -> str:
    """The inner wrapper's backend for one head's overlapping pages (``spec``: the inner ``Paged(P)`` spec):
    ``backend``, except that page sizes the sm90 kernel loads whole by TMA (its maps cannot describe pages that
    overlap) run on the portable kernel under ``"auto"`` and raise ``PlanError`` under ``"sm90"``.

    >>> overlapping_pages_backend(AttentionSpec(128, kv_layout=Paged(64)), "auto")
    'portable'
    """
    if backend == "portable" or not sm90_reads_whole_pages(spec):
        return backend
    if backend == "sm90":
        raise PlanError(f"block_col_sz: pages of gcd(block_col_sz) = {spec.kv_layout.page_size} tokens are loaded "
                        "whole by the sm90 kernel's TMA maps, which cannot describe one head's overlapping pages "
                        "(backend='auto' runs them on the portable kernel)")
    return "portable"


def head_pages(page_size: int, num_kv_heads: int):
    """The inner wrapper's view of a dense ``(k [N, Hkv, D], v [N, Hkv, Dv])`` pair as overlapping pages of one
    head: page id ``s * Hkv + h`` is head h's ``page_size`` rows from token s (page stride = head stride, token
    stride = Hkv x head stride, which the page ids assume: each token's heads side by side)."""

    def view(spec: AttentionSpec, kv_cache, _one_head: int) -> KVView:
        if not isinstance(kv_cache, tuple) or len(kv_cache) != 2:
            raise ValueError("kv_cache: expected the pair (k, v)")
        dense = prefill_kv_view(spec.replace(kv_layout=Ragged()), kv_cache, num_kv_heads)
        if dense.stride_token != num_kv_heads * dense.stride_head:
            raise ValueError(f"k, v: strides {tuple(dense.k.stride())}, expected a token's {num_kv_heads} heads side by "
                             f"side (stride(0) == {num_kv_heads} * stride(1))")
        n = dense.k.shape[0]
        return KVView(dense.k, dense.v, dense.stride_head, dense.stride_token, dense.stride_head, n * num_kv_heads)

    return view


class VariableBlockSparseWrapper:
    """Block-sparse attention with blocks of varying sizes and a pattern per kv head (FlashInfer's
    ``VariableBlockSparseAttentionWrapper``, with flashgen's NHD tensors: ``q [M, Hq, D]``, ``k [N, Hkv, D]``).

    Example::

        wrapper = flashgen.VariableBlockSparseWrapper(AttentionSpec(128, kv_layout=Ragged()))
        wrapper.plan(block_mask_map, block_row_sz, block_col_sz, num_qo_heads=32, num_kv_heads=8)
        out = wrapper.run(q, k, v)   # q [M, 32, 128], k / v [N, 8, 128] -> out [M, 32, 128]

    ``block_mask_map [Hkv, MB, NB]`` (bool, host): kv head h's block row i attends its column block j where set;
    ``block_row_sz [Hkv, MB]`` and ``block_col_sz [Hkv, NB]`` (host ints >= 0): the blocks' sizes, each head's
    summing to the same M and N. The q heads of kv head h's GQA group follow its pattern. Rows of a block row with no
    kept block give ``out = 0``, ``lse = -inf``.

    Cost beyond the attention: q is regrouped per kv head into scratch (``[Hkv x M, group, D]``, one copy of q)
    and the output copied back (one copy of out, and of lse with ``return_lse``): each about ``M x Hq x D`` elements
    read and written, ~0.1 ms at M = 16k, 32 heads, d128 on an H200. Pages are ``gcd(block_col_sz)`` tokens (1 where
    sizes share no factor: a page id per token). K and V are read in place; each token's heads must lie side by side
    (``k.stride(0) == Hkv * k.stride(1)``).

    Masks and positions as ``BlockSparseWrapper``: query row ``i`` at position ``i``, key row ``j`` at ``j``, so
    Causal, SlidingWindow and RoPE apply inside the kept blocks (with explicit positions, on either kernel).
    ALiBi raises ``SpecError`` (each head's problem runs with the group's q heads only, so the slopes of the
    global head numbers are not known to it), as does CustomMask.
    Backend: the pages overlap in memory, which the Hopper kernel's TMA maps cannot describe, so ``"auto"`` runs the
    portable kernel, except for page sizes the Hopper kernel gathers row by row (e.g. 1, 24, 48 at head_dim 128),
    which run on it on a compute-capability 9.0 GPU; ``"sm90"`` refuses TMA page sizes (``PlanError``). No
    CUDA-graph mode yet.
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, backend: str = "auto",
                 device: torch.device | int | None = None, num_sms: int | None = None):
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        if spec.variant is not None:  # its inner wrappers would run the hooks without their arguments
            raise SpecError(f"variant: VariableBlockSparseWrapper does not run variants yet (got {spec.variant.uri}); "
                            "BatchPrefillWrapper and BatchDecodeWrapper do")
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")
        if isinstance(spec.pos_encoding, ALiBi):
            raise SpecError("pos_encoding: VariableBlockSparseWrapper runs each kv head's q heads as their own "
                            "problem, so ALiBi's per-head slopes are not supported; use BlockSparseWrapper")
        self._options = positions_options(spec, backend, None, "VariableBlockSparseWrapper")
        self._positions = not position_free(spec)
        check_prefill_spec(spec, backend, self._options)
        self.spec, self._backend, self.num_sms = spec, backend, num_sms
        self.device = resolve_device(device)
        self._inner: dict[tuple[int, int], BatchPrefillWrapper] = {}  # by page size and kv heads
        self._planned = None
        self._scratch: dict[str, torch.Tensor] = {}  # the regrouped q and the inner out, reused while big enough
        self.op_handle = handles.assign(self)  # how flashgen.ops names this wrapper

    @property
    def backend(self) -> str | None:
        """``"sm90"`` or ``"portable"``: the kernel of the last plan (None before the first)."""
        return None if self._planned is None else self._planned[0].backend

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads: int, num_kv_heads: int, *,
             sm_scale: float | None = None, soft_cap: float | None = None, window_left: int | None = None,
             rope_theta: float | None = None, rope_scale: float | None = None, enable_split: bool = True) -> None:
        """Plan a pattern (host arrays; see the class). ``num_kv_heads`` must be ``block_mask_map.shape[0]``;
        ``sm_scale``, ``soft_cap``, ``window_left``, ``rope_theta``, ``rope_scale`` and ``enable_split`` as
        ``BlockSparseWrapper.plan``'s. ``PlanError`` names the
        argument: shapes, sizes < 0, heads whose blocks cover different M or N."""
        check_heads(num_qo_heads, num_kv_heads)
        m, n, p, qo, kv_indptr, kv_indices, last = variable_page_table(block_mask_map, block_row_sz, block_col_sz)
        heads = np.shape(block_mask_map)[0]
        if heads != num_kv_heads:
            raise PlanError(f"num_kv_heads: got {num_kv_heads}, but block_mask_map has {heads} heads")
        inner = self._inner_wrapper(p, num_kv_heads)
        group = num_qo_heads // num_kv_heads
        positions = {}
        if self._positions:  # page id s * Hkv + h holds head h's rows from token s; head h's q rows are 0 .. M-1
            positions = {"kv_page_pos": kv_indices // num_kv_heads, "q_pos": np.tile(np.arange(m), num_kv_heads)}
        inner.plan(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last,
                   num_qo_heads=group, num_kv_heads=1, sm_scale=sm_scale, soft_cap=soft_cap, window_left=window_left,
                   rope_theta=rope_theta, rope_scale=rope_scale, num_pages=max(n * num_kv_heads, 1),
                   enable_split=enable_split, **positions)
        self._planned = (inner, m, n, num_qo_heads, num_kv_heads)

    def _inner_wrapper(self, page_size: int, num_kv_heads: int) -> BatchPrefillWrapper:
        key = (page_size, num_kv_heads)
        inner = self._inner.get(key)
        if inner is None:
            spec = self.spec.replace(kv_layout=Paged(page_size, "NHD"))
            backend = overlapping_pages_backend(spec, self._backend)
            inner = BatchPrefillWrapper(spec, device=self.device, num_sms=self.num_sms, backend=backend,
                                        kernel_options=self._options)
            inner._view = head_pages(page_size, num_kv_heads)
            self._inner[key] = inner
        return inner

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False):
        """Attend ``q [M, num_qo_heads, head_dim]`` over ``k [N, num_kv_heads, head_dim]``, ``v [N, num_kv_heads,
        head_dim_vo]`` through each kv head's kept blocks. Returns ``out [M, num_qo_heads, head_dim_vo]`` (q's
        dtype), with ``return_lse`` also ``lse [M, num_qo_heads]`` fp32 (natural log)."""
        if self._planned is None:
            raise RuntimeError("run: call plan() first")
        inner, m, n, hq, hkv = self._planned
        group, d, dv = hq // hkv, self.spec.head_dim, self.spec.head_dim_vo
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (m, hq, d):
            raise ValueError(f"q: expected shape {(m, hq, d)}, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != n:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected [N = {n}, num_kv_heads, dim] (the plan's N), got {shape}")
        if out is None:
            out = torch.empty((m, hq, dv), dtype=q.dtype, device=q.device)
        elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, hq, dv) or out.dtype != q.dtype:
            raise ValueError(f"out: expected {q.dtype} of shape {(m, hq, dv)}")
        q_heads = self._buffer("q", (hkv, m, group, d), q)
        q_heads.copy_(q.view(m, hkv, group, d).transpose(0, 1))
        result = inner.run(q_heads.view(hkv * m, group, d), (k, v), out=self._buffer("out", (hkv * m, group, dv), q),
                           return_lse=return_lse)
        inner_out, inner_lse = result if return_lse else (result, None)
        out.view(m, hkv, group, dv).copy_(inner_out.view(hkv, m, group, dv).transpose(0, 1))
        if not return_lse:
            return out
        return out, inner_lse.view(hkv, m, group).transpose(0, 1).reshape(m, hq)

    def _buffer(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """Scratch ``name`` of ``shape`` in q's dtype, reused while big enough (a fresh allocation is 16-byte
        aligned, as the kernels' q and out rows must be)."""
        numel = math.prod(shape)
        held = self._scratch.get(name)
        if held is None or held.numel() < numel or held.dtype != like.dtype or held.device != like.device:
            held = self._scratch[name] = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
        return held[:numel].view(shape)
