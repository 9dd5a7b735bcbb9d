"""KV layouts for the reference: gather each request's K/V into dense tensors, and build paged caches.

The reference reads every layout the kernels read (ragged, paged NHD/HND with a CSR page table or a block
table, K and V as one ``[pages, 2, ...]`` tensor or as a pair, block-sparse dense KV) and turns it into one
dense ``(k [kv_len, num_kv_heads, head_dim], v [kv_len, num_kv_heads, head_dim_vo])`` pair per request.
``random_batch`` and ``fp8_codes`` draw test inputs in those layouts.
"""

from __future__ import annotations

import numpy as np
import torch

from flashgen.plan.page_table import PageTableError, validate_block_table, validate_csr, validate_indptr
from flashgen.spec import AttentionSpec, BlockSparse, Paged, Ragged


def split_kv(kv: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` from a pair, or from one tensor with K and V stacked on dim 1 (``[pages, 2, ...]``)."""
    if isinstance(kv, (tuple, list)):
        if len(kv) != 2:
            raise ValueError(f"kv: a sequence of {len(kv)} tensors, expected (k, v)")
        return kv[0], kv[1]
    if not isinstance(kv, torch.Tensor) or kv.dim() < 2 or kv.shape[1] != 2:
        raise ValueError("kv: expected (k, v) or one tensor with K and V on dim 1 ([pages, 2, ...])")
    return kv[:, 0], kv[:, 1]


def _pages_nhd(x: torch.Tensor, layout: Paged, name: str) -> torch.Tensor:
    if x.dim() != 4:
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected 4-D pages ({layout.order})")
    x = x.transpose(1, 2) if layout.order == "HND" else x
    if x.shape[1] != layout.page_size:
        raise ValueError(f"{name}: page size {x.shape[1]} in shape {tuple(x.shape)} ({layout.order}), "
                         f"expected kv_layout.page_size = {layout.page_size}")
    return x


def _page_lists(spec: AttentionSpec, num_pages: int, kv_indptr, kv_indices, kv_last_page_len, block_table,
                seq_lens) -> tuple[list[np.ndarray], np.ndarray]:
    page_size = spec.kv_layout.page_size
    if kv_indices is not None:
        if kv_indptr is None or kv_last_page_len is None:
            raise PageTableError("kv_indices: a CSR page table also needs kv_indptr and kv_last_page_len")
        lens = validate_csr(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
        indptr, indices = np.asarray(kv_indptr, dtype=np.int64), np.asarray(kv_indices, dtype=np.int64)
        return [indices[indptr[b]: indptr[b + 1]] for b in range(lens.size)], lens
    if block_table is None or seq_lens is None:
        raise PageTableError("paged KV needs kv_indptr/kv_indices/kv_last_page_len or block_table/seq_lens")
    lens = validate_block_table(block_table, seq_lens, page_size, num_pages)
    table = np.asarray(block_table, dtype=np.int64)
    return [table[b, : -(-int(n) // page_size)] for b, n in enumerate(lens)], lens


def request_kv(spec: AttentionSpec, kv: object, *, kv_indptr=None, kv_indices=None, kv_last_page_len=None,
               block_table=None, seq_lens=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's dense ``(k [kv_len, num_kv_heads, head_dim], v [kv_len, num_kv_heads, head_dim_vo])``.

    ``kv`` follows ``spec.kv_layout``: ``Paged``: pages NHD ``[pages, page_size, num_kv_heads, dim]`` or HND
    ``[pages, num_kv_heads, page_size, dim]`` with a CSR page table or ``block_table``/``seq_lens``;
    ``Ragged``: ``[total_kv, num_kv_heads, dim]`` with ``kv_indptr``; ``BlockSparse``: one request of dense
    ``[kv_len, num_kv_heads, dim]``. K and V as a pair, or stacked on dim 1. Dtypes are kept.

    >>> spec = AttentionSpec(64, kv_layout=Ragged())
    >>> k = torch.randn(5, 2, 64); [kk.shape[0] for kk, _ in request_kv(spec, (k, k), kv_indptr=[0, 2, 5])]
    [2, 3]
    """
    k, v = split_kv(kv)
    layout = spec.kv_layout
    if isinstance(layout, Paged):
        k, v = _pages_nhd(k, layout, "k"), _pages_nhd(v, layout, "v")
        pages, lens = _page_lists(spec, k.shape[0], kv_indptr, kv_indices, kv_last_page_len, block_table, seq_lens)
        out = []
        for p, n in zip(pages, lens):
            idx = torch.from_numpy(p).to(k.device)
            out.append((k[idx].flatten(0, 1)[: int(n)], v[idx].flatten(0, 1)[: int(n)]))
        return out
    if isinstance(layout, Ragged):
        if kv_indptr is None:
            raise PageTableError("kv_indptr: required for ragged KV")
        indptr = validate_indptr("kv_indptr", kv_indptr)
        if indptr[-1] > k.shape[0]:
            raise PageTableError(f"kv_indptr[-1] = {int(indptr[-1])} > {k.shape[0]} KV rows")
        return [(k[a:b], v[a:b]) for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist())]
    if isinstance(layout, BlockSparse):
        return [(k, v)]
    raise ValueError(f"kv_layout: {layout!r} is not supported by the reference")


def paged_kv_cache(ks: list[torch.Tensor], vs: list[torch.Tensor], page_size: int, *, order: str = "NHD",
                   combined: bool = False, spare_pages: int = 1, generator: torch.Generator | None = None):
    """Scatter per-request dense K/V into a paged cache with shuffled page ids (for tests and examples).

    ``ks[b] [kv_len_b, num_kv_heads, head_dim]``, ``vs[b] [kv_len_b, num_kv_heads, head_dim_vo]``.
    Returns ``(kv, kv_indptr, kv_indices, kv_last_page_len)``: ``kv`` is ``(k_cache, v_cache)`` or, with
    ``combined``, one ``[pages, 2, ...]`` tensor; the page table is int32 CPU. Slots no request owns
    (``spare_pages`` whole pages and each last page's tail) hold NaN, so reading them shows. ``order`` is "NHD" or "HND".

    >>> kv, indptr, indices, last = paged_kv_cache([torch.randn(5, 1, 8)], [torch.randn(5, 1, 8)], 4)
    >>> indptr.tolist(), last.tolist(), kv[0].shape
    ([0, 2], [1], torch.Size([3, 4, 1, 8]))
    """
    lens = np.array([k.shape[0] for k in ks], dtype=np.int64)
    npages = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    total = int(indptr[-1]) + spare_pages
    perm = torch.randperm(total, generator=generator)[: indptr[-1]].to(torch.int32)
    caches = []
    for xs in (ks, vs):
        heads, dim, dtype = xs[0].shape[1], xs[0].shape[2], xs[0].dtype
        cache = torch.full((total * page_size, heads, dim), float("nan"), dtype=torch.float32).to(dtype)
        for b, x in enumerate(xs):
            pages = perm[indptr[b]: indptr[b + 1]].long()
            rows = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[: x.shape[0]]
            cache[rows] = x
        cache = cache.view(total, page_size, heads, dim)
        caches.append(cache.transpose(1, 2).contiguous() if order == "HND" else cache)
    kv = torch.stack(caches, dim=1) if combined else tuple(caches)
    last = np.where(npages > 0, lens - (npages - 1) * page_size, 0).astype(np.int32)
    return kv, torch.from_numpy(indptr), perm, torch.from_numpy(last)


def random_batch(spec: AttentionSpec, qo_lens: list[int], kv_lens: list[int], num_kv_heads: int, group: int, *,
                 combined: bool = False, generator: torch.Generator | None = None):
    """A random batch in ``spec``'s layout and dtype, for kernel tests: ``(q, kv, table)``.

    ``q [sum(qo_lens), num_kv_heads * group, head_dim]``; ``kv`` a paged cache (``paged_kv_cache``: shuffled
    pages, NaN in every slot no request owns) or a ragged ``(k, v)`` pair; ``table`` the CSR page table
    (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) or, ragged, ``kv_indptr``; all on the CPU.
    """
    dtype = getattr(torch, spec.dtype)
    ks = [torch.randn(n, num_kv_heads, spec.head_dim, generator=generator).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, num_kv_heads, spec.head_dim_vo, generator=generator).to(dtype) for n in kv_lens]
    q = torch.randn(sum(qo_lens), num_kv_heads * group, spec.head_dim, generator=generator).to(dtype)
    if isinstance(spec.kv_layout, Paged):
        kv, indptr, indices, last = paged_kv_cache(ks, vs, spec.kv_layout.page_size, order=spec.kv_layout.order,
                                                   combined=combined, generator=generator)
        return q, kv, {"kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": last}
    kv = (torch.cat(ks), torch.cat(vs))
    return q, kv, {"kv_indptr": torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)}


def fp8_codes(like: torch.Tensor, fp8: torch.dtype, subnormal_only: bool, gen: torch.Generator) -> torch.Tensor:
    """Random fp8 codes shaped like ``like``: every finite code (or only the subnormals and zeros), NaN where
    ``like`` is NaN (the slots no request owns)."""
    codes = torch.randint(0, 256, like.shape, generator=gen, dtype=torch.int32)
    exp_mask = 0x78 if fp8 == torch.float8_e4m3fn else 0x7C
    if subnormal_only:
        codes &= ~exp_mask
    special = (codes & 0x7F) == 0x7F if fp8 == torch.float8_e4m3fn else (codes & exp_mask) == exp_mask
    codes = torch.where(special, codes & 0x80, codes)  # NaN / inf codes -> signed zeros
    out = codes.to(torch.uint8).view(fp8)
    return torch.where(torch.isnan(like), torch.full_like(out, float("nan")), out)
