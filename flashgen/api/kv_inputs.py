"""Intake of KV caches and page tables at the API edge: shapes, dtypes, strides, with named errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan import (
    PageTableError,
    PlanError,
    host_array,
    validate_block_table,
)
from ..plan.host import check_int
from ..plan.page_table import csr_checked, csr_lens, indptr_steps
from ..spec import AttentionSpec, Paged

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
}
_UNSIGNED = {4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


@dataclass(frozen=True)
class KVView:
    """K and V of a cache as the kernels address them: base pointers and element strides."""

    k: torch.Tensor
    v: torch.Tensor
    stride_page: int
    stride_token: int
    stride_head: int
    num_pages: int  # pages in the pool (paged), tokens (ragged)


def kv_view(spec: AttentionSpec, kv_cache: object, num_kv_heads: int) -> KVView:
    """Split ``kv_cache`` into K and V and read its strides.

    Paged: one tensor ``[pages, 2, page_size, kv_heads, dim]`` (NHD; HND: ``[pages, 2, kv_heads, page_size,
    dim]``) or a pair ``(k, v)`` of ``[pages, page_size, kv_heads, dim]`` (HND: ``[pages, kv_heads, page_size,
    dim]``). Ragged: a pair ``(k, v)`` of ``[total_kv, kv_heads, dim]``.
    """
    paged = isinstance(spec.kv_layout, Paged)
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache: expected a (k, v) pair, got {len(kv_cache)} tensors")
        k, v = kv_cache
    elif isinstance(kv_cache, torch.Tensor) and paged:
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache: expected [pages, 2, ...] (5 dims), got shape {tuple(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    else:
        raise ValueError("kv_cache: expected a (k, v) pair" + ("" if paged else " for a Ragged layout"))
    want = TORCH_DTYPES[spec.kv_dtype]
    for name, t, dim in (("k", k, spec.head_dim), ("v", v, spec.head_dim_vo)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise ValueError(f"kv_cache ({name}): expected a CUDA tensor")
        if t.dtype != want:
            raise TypeError(f"kv_cache ({name}): expected dtype {want} (spec.kv_dtype), got {t.dtype}")
        _check_kv_shape(spec, name, t, num_kv_heads, dim)
    if k.stride()[:-1] != v.stride()[:-1]:
        raise ValueError(f"kv_cache: k and v must share strides, got {k.stride()} and {v.stride()}")
    if paged:
        token_dim, head_dim_ = (1, 2) if spec.kv_layout.order == "NHD" else (2, 1)
        return KVView(k, v, k.stride(0), k.stride(token_dim), k.stride(head_dim_), k.shape[0])
    return KVView(k, v, 0, k.stride(0), k.stride(1), k.shape[0])


def _check_kv_shape(spec: AttentionSpec, name: str, t: torch.Tensor, num_kv_heads: int, dim: int) -> None:
    if isinstance(spec.kv_layout, Paged):
        ps = spec.kv_layout.page_size
        expect = (ps, num_kv_heads, dim) if spec.kv_layout.order == "NHD" else (num_kv_heads, ps, dim)
        shape = "[pages, " + ", ".join(map(str, expect)) + f"] ({spec.kv_layout.order})"
        ok = t.dim() == 4 and tuple(t.shape[1:]) == expect
    else:
        shape = f"[total_kv, {num_kv_heads}, {dim}]"
        ok = t.dim() == 3 and tuple(t.shape[1:]) == (num_kv_heads, dim)
    if not ok:
        raise ValueError(f"kv_cache ({name}): expected shape {shape}, got {tuple(t.shape)}")
    if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"kv_cache ({name}): rows must be contiguous and 16-byte aligned, got strides {t.stride()}")


@dataclass
class PageTable:
    """A batch's page table: host KV lengths for planning, device arrays for the kernel."""

    kv_lens: np.ndarray
    kv_indptr_host: np.ndarray | None  # CSR and ragged: copied to the device with the plan
    kv_indices: torch.Tensor | None  # CSR page ids (device, or host to be copied)
    block_table: torch.Tensor | None
    max_page: int = -1  # largest page id used, when the ids are on the host (checked against the cache)


def page_table(spec: AttentionSpec, *, kv_indptr=None, kv_indices=None, kv_last_page_len=None, block_table=None,
               seq_lens=None, num_pages: int | None = None) -> PageTable:
    """Check and take in one of the page-table forms (host arrays are validated in full)."""
    if num_pages is not None and (type(num_pages) is not int or num_pages < 0):
        num_pages = check_int("num_pages", num_pages, 0, optional=True, note=" (the page pool's size)")
    if not isinstance(spec.kv_layout, Paged):
        if kv_indptr is None or any(x is not None for x in (kv_indices, kv_last_page_len, block_table, seq_lens)):
            raise PlanError("kv_indptr: a Ragged layout takes kv_indptr (token offsets of each request) only")
        indptr, lens, _ = indptr_steps("kv_indptr", kv_indptr)
        return PageTable(lens, indptr, None, None)
    page_size = spec.kv_layout.page_size
    if block_table is not None:
        if any(x is not None for x in (kv_indptr, kv_indices, kv_last_page_len)) or seq_lens is None:
            raise PlanError("block_table: give block_table with seq_lens, and no CSR arrays")
        table = _int_tensor("block_table", block_table, 2)
        if table.is_cuda:  # its entries stay on the device (never read back); check what the host has
            lens = _seq_lens_fit(seq_lens, table.shape, page_size)
            return PageTable(lens, None, None, table)
        lens = validate_block_table(table, seq_lens, page_size, num_pages)
        used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page_size)
        return PageTable(lens, None, None, table, int(table.numpy()[used].max(initial=-1)))
    if kv_indptr is None or kv_indices is None or kv_last_page_len is None:
        raise PlanError("kv_indptr: a paged layout takes kv_indptr, kv_indices and kv_last_page_len (CSR), "
                        "or block_table and seq_lens")
    indices = _int_tensor("kv_indices", kv_indices, 1)
    if indices.is_cuda:
        indptr, lens = csr_lens(kv_indptr, kv_last_page_len, page_size)
        if indptr[-1] > indices.numel():
            raise PlanError(f"kv_indptr[-1] = {int(indptr[-1])} > len(kv_indices) = {indices.numel()}")
        return PageTable(lens, indptr, indices, None)
    indptr, lens, top = csr_checked(kv_indptr, indices.numpy(), kv_last_page_len, page_size, num_pages)
    return PageTable(lens, indptr, indices, None, top)


def _seq_lens_fit(seq_lens: object, shape: tuple[int, int], page_size: int) -> np.ndarray:
    """``seq_lens`` of a device block table (its entries are never read): each in ``0 .. width * page_size``,
    checked with one unsigned max (a negative length is a huge unsigned one)."""
    lens = host_array("seq_lens", seq_lens)
    if lens.size != shape[0]:
        raise PageTableError(f"seq_lens: has {lens.size} entries, expected batch_size = {shape[0]} (block_table.shape[0])")
    cap = shape[1] * page_size
    if int(np.maximum.reduce(lens.view(_UNSIGNED[lens.itemsize]), initial=0)) > cap:
        b = int(np.flatnonzero((lens < 0) | (lens > cap))[0])
        raise PageTableError(f"seq_lens[{b}] = {int(lens[b])}, expected 0..{cap} "
                             f"(block_table's {shape[1]} columns of {page_size} tokens)")
    return lens


def _int_tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    else:
        array = np.asarray(value)
        if array.size == 0 and array.dtype.kind == "f":  # an empty list: no values, so no dtype to read
            array = array.astype(np.int32).reshape((0,) * ndim if array.ndim < ndim else array.shape)
        t = torch.as_tensor(array)
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != ndim:
        raise PlanError(f"{name}: expected an int32 tensor with {ndim} dimension(s), got {t.dtype} {tuple(t.shape)}")
    if t.is_cuda and t.dtype != torch.int32:
        raise PlanError(f"{name}: a device page table must be int32, got {t.dtype}")
    return t


def device_page_ids(ids: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(address, row stride) of a device page table the kernel reads in place. The caller must keep ``ids``
    alive for as long as the plan is used (the wrappers hold it until the next plan)."""
    if ids.device != device:
        raise PlanError(f"page table: on {ids.device}, expected {device}")
    if ids.dim() == 1 and not ids.is_contiguous():
        raise PlanError("kv_indices: expected a contiguous tensor")
    return ids.data_ptr(), (ids.stride(0) if ids.dim() == 2 else 0)
