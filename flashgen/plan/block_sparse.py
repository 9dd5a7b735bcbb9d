"""Block-sparse attention as a page plan.

A BSR pattern over a ``qo_len x kv_len`` (M x N) score matrix with blocks ``block_q x block_kv`` (R x C):
block row ``r`` (query rows ``r*R .. min((r+1)*R, M)``) attends the column blocks
``indices[indptr[r]:indptr[r+1]]`` (sorted, unique). Seen as pages of ``page_size = C`` over the dense KV
``[N, num_kv_heads, dim]`` (viewed as ``[ceil(N / C), C, num_kv_heads, dim]``, NHD; pad N to a multiple of
C for a kernel), every block row is a request whose page list is its column blocks. A missing block is a
page that is not listed, so it costs nothing; a block row with no blocks is a request with no KV, whose
single item per qo tile only writes ``out = 0``, ``lse = -inf``.

KV positions inside a request are logical (page list order), so block-sparse plans are for specs without
causal/window masks or positional encodings (the reference handles those densely).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .host import PlanError, check_int, host_array
from .page_table import validate_indptr
from .plan import Plan
from .heuristics import choose_kv_chunk, default_tile_rows
from .split_kv import SplitKVInfo, _check_options, split_kv_arrays


class BlockSparseInfo(NamedTuple):
    """Sizes of a block-sparse plan; ``split_kv`` describes its work items."""

    split_kv: SplitKVInfo
    page_size: int
    qo_len: int
    kv_len: int
    num_blocks: int


def bsr_page_table(indptr: object, indices: object, *, block_q: int, block_kv: int, qo_len: int, kv_len: int):
    """The page view of a BSR pattern: ``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_lens)``.

    All int64 numpy; one request per block row, ``page_size = block_kv``.

    >>> [a.tolist() for a in bsr_page_table([0, 2, 2], [0, 2], block_q=2, block_kv=4, qo_len=3, kv_len=10)]
    [[0, 2, 3], [0, 2, 2], [0, 2], [2, 0], [6, 0]]
    """
    for name, value, minimum in (("block_q", block_q, 1), ("block_kv", block_kv, 1), ("qo_len", qo_len, 0),
                                 ("kv_len", kv_len, 0)):
        check_int(name, value, minimum)
    rows, cols = -(-qo_len // block_q), -(-kv_len // block_kv)
    ptr = validate_indptr("indptr", indptr)
    if ptr.size != rows + 1:
        raise PlanError(f"indptr: has {ptr.size} entries, expected ceil(qo_len / block_q) + 1 = {rows + 1}")
    idx = host_array("indices", indices)
    if ptr[-1] > idx.size:
        raise PlanError(f"indptr[-1] = {int(ptr[-1])} > len(indices) = {idx.size}")
    idx = idx[: ptr[-1]]
    bad = (idx < 0) | (idx >= cols)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"indices[{i}] = {int(idx[i])} is outside the column blocks [0, {cols})")
    same_row = np.repeat(np.arange(rows), np.diff(ptr))
    unsorted = (np.diff(idx) <= 0) & (np.diff(same_row) == 0)
    if unsorted.any():
        i = int(np.flatnonzero(unsorted)[0]) + 1
        raise PlanError(f"indices[{i}] = {int(idx[i])}: each block row's indices must be sorted and unique")
    nblocks = np.diff(ptr)
    tail = kv_len - (cols - 1) * block_kv
    last_index = idx[np.maximum(ptr[1:] - 1, 0)] if idx.size else np.zeros(rows, np.int64)
    last = np.where(nblocks > 0, np.where(last_index == cols - 1, tail, block_kv), 0)
    qo_indptr = np.minimum(np.arange(rows + 1) * block_q, qo_len)
    kv_lens = np.where(nblocks > 0, (nblocks - 1) * block_kv + last, 0)
    return qo_indptr, ptr, idx, last, kv_lens


def plan_block_sparse(indptr: object, indices: object, *, block_q: int, block_kv: int, qo_len: int, kv_len: int,
                      num_qo_heads: int, num_kv_heads: int, tile_rows: int | None = None, num_sms: int = 132,
                      item_overhead: int = 64, host_buffer: torch.Tensor | None = None) -> Plan:
    """Plan a BSR pattern (``indptr [ceil(M / R) + 1]``, ``indices [nnz]`` host ints) as a page plan.

    Returns a ``Plan`` of kind ``"block_sparse"``: the ``SPLIT_KV_SCHEMA`` fields (one request per block
    row, chunks a multiple of ``block_kv``) plus the page table ``kv_indptr``, ``kv_indices``,
    ``kv_last_page_len`` with ``page_size = block_kv``; ``info`` is a ``BlockSparseInfo``.

    >>> plan = plan_block_sparse([0, 1, 1], [1], block_q=4, block_kv=4, qo_len=8, kv_len=8,
    ...                          num_qo_heads=2, num_kv_heads=2)
    >>> plan["kv_len"].tolist(), plan["kv_indices"].tolist()
    ([4, 0], [1])
    """
    _check_options(num_qo_heads, num_kv_heads, tile_rows, 1, num_sms, item_overhead)
    qo, kv_indptr, kv_indices, last, lens = bsr_page_table(indptr, indices, block_q=block_q, block_kv=block_kv,
                                                           qo_len=qo_len, kv_len=kv_len)
    group_size = num_qo_heads // num_kv_heads
    rows = default_tile_rows(block_q * group_size) if tile_rows is None else tile_rows
    tiles = -(-(np.diff(qo) * group_size) // rows)
    chunk = choose_kv_chunk(lens, tiles, num_kv_heads, num_sms=num_sms, granularity=block_kv,
                            item_overhead=item_overhead)
    arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, tile_rows=rows,
                                   kv_chunk=chunk, max_batch_size=qo.size - 1, max_total_q=qo_len, capacity=None)
    arrays.update(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last)
    return Plan.pack("block_sparse", arrays, BlockSparseInfo(info, block_kv, qo_len, kv_len, kv_indices.size),
                     host_buffer)
