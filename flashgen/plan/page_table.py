"""Page tables: validation and conversion between the two formats in use.

CSR (FlashInfer): ``kv_indptr [batch + 1]``, ``kv_indices [kv_indptr[-1]]``, ``kv_last_page_len [batch]``.
Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``; its KV length is
``(num_pages - 1) * page_size + kv_last_page_len[b]``.

Block table (vLLM, FlashAttention): ``block_table [batch, max_blocks]`` and ``seq_lens [batch]``. Request
``b`` owns pages ``block_table[b, :ceil(seq_lens[b] / page_size)]``; the entries after those are unused and
never read (any value, -1 included, is allowed there).

Empty requests: in CSR a request with no pages has KV length 0 and must have ``kv_last_page_len == 0``; a
request with pages must have ``kv_last_page_len`` in ``1..page_size``. In a block table ``seq_lens[b] == 0``.

All functions are host-side (numpy / CPU torch); errors are ``PageTableError`` naming the array and position.
"""

from __future__ import annotations

import numpy as np
import torch

from .host import PlanError, host_array as _host_array


class PageTableError(PlanError):
    """An invalid page table; the message names the array and the first bad position."""


def host_array(name: str, value: object, ndim: int = 1) -> np.ndarray:
    return _host_array(name, value, ndim, PageTableError)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise PageTableError(f"page_size: got {page_size!r}, expected an integer >= 1")


def validate_indptr(name: str, indptr: object, length: int | None = None) -> np.ndarray:
    """Check an indptr array: 1-D, starts at 0, non-decreasing, and (if given) ends at ``length``.

    Returns it as int64 numpy. Example: ``validate_indptr("qo_indptr", [0, 3, 3, 7])``.
    """
    a = indptr_steps(name, indptr)[0]
    if length is not None and a[-1] != length:
        raise PageTableError(f"{name}[-1] = {int(a[-1])}, expected {length} (the length it indexes)")
    return a


_UNSIGNED = {4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_SIGNED_MAX = {4: 2**31 - 1, 8: 2**63 - 1}


# arrays up to this many entries are checked in Python on a list: one tolist() and a short loop cost less than
# the five or six numpy calls of the vectorised checks (each ~1-2 us on the H200 host)
SMALL_BATCH = 33


def indptr_steps(name: str, indptr: object) -> tuple[np.ndarray, np.ndarray, int]:
    """``validate_indptr``'s checks but the length; returns ``(indptr, steps, longest step)`` (0 when empty)."""
    a = host_array(name, indptr)
    if a.size == 0:
        raise PageTableError(f"{name}: is empty, expected batch_size + 1 >= 1 entries")
    if a[0] != 0:
        raise PageTableError(f"{name}[0] = {int(a[0])}, expected 0")
    steps = a[1:] - a[:-1]
    if a.size <= SMALL_BATCH:
        values = steps.tolist()
        top = max(values, default=0)
        if values and min(values) < 0:
            _not_increasing(name, a, next(i for i, x in enumerate(values) if x < 0))
        return a, steps, top
    # one pass for the check and the longest step: a negative step is a huge unsigned one
    top = int(np.maximum.reduce(steps.view(_UNSIGNED[steps.itemsize]), initial=0))
    if top > _SIGNED_MAX[steps.itemsize]:
        _not_increasing(name, a, _first(steps < 0))
    return a, steps, top


def _not_increasing(name: str, a: np.ndarray, i: int) -> None:
    raise PageTableError(f"{name}[{i + 1}] = {int(a[i + 1])} < {name}[{i}] = {int(a[i])}: must be non-decreasing")


def csr_lens(kv_indptr: object, kv_last_page_len: object, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kv_indptr, kv_lens)`` of a CSR page table whose page ids are not read (device ids): the checks and
    errors of ``validate_csr`` on ``kv_indptr`` and ``kv_last_page_len``, in its order, in one pass.

    >>> [a.tolist() for a in csr_lens([0, 2, 2], [5, 0], 16)]
    [[0, 2, 2], [21, 0]]
    """
    indptr = host_array("kv_indptr", kv_indptr)
    last = host_array("kv_last_page_len", kv_last_page_len)
    n = indptr.size
    if not 0 < n <= SMALL_BATCH:
        indptr, steps, _ = indptr_steps("kv_indptr", indptr)
        _check_last_size(last, n - 1)
        return indptr, _csr_lens(steps, last, page_size, int(indptr[-1]))
    ptr = indptr.tolist()
    if ptr[0] != 0:
        raise PageTableError(f"kv_indptr[0] = {ptr[0]}, expected 0")
    npages = [b - a for a, b in zip(ptr, ptr[1:])]
    if npages and min(npages) < 0:
        _not_increasing("kv_indptr", indptr, next(i for i, x in enumerate(npages) if x < 0))
    _check_last_size(last, n - 1)
    return indptr, _small_csr_lens(npages, last.tolist(), page_size)


def _check_last_size(last: np.ndarray, batch: int) -> None:
    if last.size != batch:
        raise PageTableError(f"kv_last_page_len: has {last.size} entries, expected batch_size = {batch} "
                             f"(len(kv_indptr) - 1)")


def _csr_lens(npages: np.ndarray, last: np.ndarray, page_size: int, total_pages: int) -> np.ndarray:
    """KV lengths from pages and last-page lengths (numpy), checking ``kv_last_page_len``: ``1..page_size`` for a
    request with pages, 0 for one without. ``tail = last - has`` lies in ``0 .. (page_size - 1) * has`` exactly
    when ``last`` is valid (one unsigned compare finds a negative one too); then the length is
    ``(npages - has) * page_size + last``."""
    has = npages > 0
    tail = last - has
    bad = tail.view(_UNSIGNED[tail.itemsize]) > has * (page_size - 1)
    if bad.any():
        b = _first(bad)
        _bad_last(b, int(npages[b]), int(last[b]), page_size)
    if total_pages * page_size >= 2**31:  # lengths past int32 (the planner then names the request)
        npages = npages.astype(np.int64)
    return (npages - has) * page_size + last


def validate_csr(kv_indptr: object, kv_indices: object, kv_last_page_len: object, page_size: int,
                 num_pages: int | None = None) -> np.ndarray:
    """Validate a CSR page table and return the KV lengths ``[batch]`` (int64 numpy).

    ``kv_indptr [batch + 1]``, ``kv_indices [>= kv_indptr[-1]]``, ``kv_last_page_len [batch]``, int32/int64.
    ``num_pages`` (the pool size) bounds the indices when given.

    >>> validate_csr([0, 2, 2, 3], [4, 1, 0], [5, 0, 16], page_size=16, num_pages=8)
    array([21,  0, 16])
    """
    return csr_checked(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)[1]


def csr_checked(kv_indptr: object, kv_indices: object, kv_last_page_len: object, page_size: int,
                num_pages: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """``validate_csr``'s checks and errors; returns ``(kv_indptr, kv_lens, largest page id used or -1)``."""
    _check_page_size(page_size)
    indptr, npages, _ = indptr_steps("kv_indptr", kv_indptr)
    indices = host_array("kv_indices", kv_indices)
    last = host_array("kv_last_page_len", kv_last_page_len)
    batch = indptr.size - 1
    _check_last_size(last, batch)
    total = int(indptr[-1])
    if total > indices.size:
        raise PageTableError(f"kv_indptr[-1] = {total} > len(kv_indices) = {indices.size}")
    used = indices[:total]
    top = int(used.max()) if total else -1  # one pass for the largest id, one for the smallest
    if total and (int(used.min()) < 0 or (num_pages is not None and top >= num_pages)):
        bad = (used < 0) if num_pages is None else ((used < 0) | (used >= num_pages))
        i = _first(bad)
        pool = "[0, inf)" if num_pages is None else f"[0, {num_pages})"
        raise PageTableError(f"kv_indices[{i}] = {int(used[i])} is outside the page pool {pool}")
    if batch < SMALL_BATCH:
        return indptr, _small_csr_lens(npages.tolist(), last.tolist(), page_size), top
    return indptr, _csr_lens(npages, last, page_size, total), top


def _small_csr_lens(npages: list, last: list, page_size: int) -> np.ndarray:
    lens = [0] * len(npages)
    for b, (pages, tail) in enumerate(zip(npages, last)):
        if pages > 0 and 1 <= tail <= page_size:
            lens[b] = (pages - 1) * page_size + tail
        elif pages > 0 or tail != 0:
            _bad_last(b, pages, tail, page_size)
    return np.array(lens, dtype=np.int64)


def _bad_last(b: int, pages: int, tail: int, page_size: int) -> None:
    expect = f"1..{page_size}" if pages > 0 else "0 (the request has no pages)"
    raise PageTableError(f"kv_last_page_len[{b}] = {tail}, expected {expect}")


def validate_block_table(block_table: object, seq_lens: object, page_size: int,
                         num_pages: int | None = None) -> np.ndarray:
    """Validate a block table and return the KV lengths ``[batch]`` (int64 numpy).

    ``block_table [batch, max_blocks]`` and ``seq_lens [batch]``, int32/int64. Only the used entries
    ``block_table[b, :ceil(seq_lens[b] / page_size)]`` are checked against the pool ``[0, num_pages)``.

    >>> validate_block_table([[3, 1, -1], [0, -1, -1]], [20, 16], page_size=16, num_pages=4)
    array([20, 16])
    """
    _check_page_size(page_size)
    table = host_array("block_table", block_table, ndim=2)
    lens = host_array("seq_lens", seq_lens)
    batch, max_blocks = table.shape
    if lens.size != batch:
        raise PageTableError(f"seq_lens: has {lens.size} entries, expected batch_size = {batch} "
                             f"(block_table.shape[0])")
    if (lens < 0).any():
        b = _first(lens < 0)
        raise PageTableError(f"seq_lens[{b}] = {int(lens[b])}, expected >= 0")
    blocks = -(-lens // page_size)
    if (blocks > max_blocks).any():
        b = _first(blocks > max_blocks)
        raise PageTableError(f"seq_lens[{b}] = {int(lens[b])} needs {int(blocks[b])} pages, more than "
                             f"block_table's {max_blocks} columns (max_blocks * page_size = {max_blocks * page_size})")
    used = np.arange(max_blocks)[None, :] < blocks[:, None]
    bad = used & ((table < 0) if num_pages is None else ((table < 0) | (table >= num_pages)))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        pool = "[0, inf)" if num_pages is None else f"[0, {num_pages})"
        raise PageTableError(f"block_table[{b}, {j}] = {int(table[b, j])} is outside the page pool {pool}")
    return lens


def csr_to_block_table(kv_indptr: object, kv_indices: object, kv_last_page_len: object, page_size: int,
                       max_blocks: int | None = None, pad_value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a CSR page table to ``(block_table [batch, max_blocks], seq_lens [batch])``, int32 CPU tensors.

    Unused entries are ``pad_value``. ``max_blocks`` defaults to the most pages any request has.

    >>> bt, lens = csr_to_block_table([0, 2, 3], [4, 1, 0], [5, 16], page_size=16)
    >>> bt.tolist(), lens.tolist()
    ([[4, 1], [0, 0]], [21, 16])
    """
    lens = validate_csr(kv_indptr, kv_indices, kv_last_page_len, page_size)
    indptr = host_array("kv_indptr", kv_indptr)
    indices = host_array("kv_indices", kv_indices)
    npages = np.diff(indptr)
    width = int(npages.max(initial=0)) if max_blocks is None else max_blocks
    if npages.size and npages.max() > width:
        b = _first(npages > width)
        raise PageTableError(f"kv_indptr: request {b} has {int(npages[b])} pages, more than max_blocks = {width}")
    table = np.full((npages.size, width), pad_value, dtype=np.int32)
    rows = np.repeat(np.arange(npages.size), npages)
    cols = np.arange(indptr[-1]) - np.repeat(indptr[:-1], npages)
    table[rows, cols] = indices[: indptr[-1]]
    return torch.from_numpy(table), torch.from_numpy(lens.astype(np.int32))


def block_table_to_csr(block_table: object, seq_lens: object, page_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert ``(block_table, seq_lens)`` to CSR ``(kv_indptr, kv_indices, kv_last_page_len)``, int32 CPU.

    >>> indptr, indices, last = block_table_to_csr([[4, 1, 9], [0, 7, 7]], [21, 16], page_size=16)
    >>> indptr.tolist(), indices.tolist(), last.tolist()
    ([0, 2, 3], [4, 1, 0], [5, 16])
    """
    lens = validate_block_table(block_table, seq_lens, page_size)
    table = host_array("block_table", block_table, ndim=2)
    npages = -(-lens // page_size)
    indptr = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(npages, out=indptr[1:])
    used = np.arange(table.shape[1])[None, :] < npages[:, None]
    last = np.where(npages > 0, lens - (npages - 1) * page_size, 0)
    return (torch.from_numpy(indptr), torch.from_numpy(table[used].astype(np.int32)),
            torch.from_numpy(last.astype(np.int32)))


def kv_lens_from_csr(kv_indptr: object, kv_last_page_len: object, page_size: int) -> np.ndarray:
    """KV lengths ``[batch]`` (int64 numpy) of a CSR page table, checking ``kv_indptr`` and
    ``kv_last_page_len`` but not reading the page ids (``csr_lens``).

    >>> kv_lens_from_csr([0, 2, 2], [5, 0], 16)
    array([21,  0])
    """
    _check_page_size(page_size)
    return csr_lens(kv_indptr, kv_last_page_len, page_size)[1].astype(np.int64, copy=False)
