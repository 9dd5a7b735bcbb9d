"""Sparse attention over pages (Quest- or top-k-style decode): a CSR page table cut down to the kept pages.

A decode (or prefill) wrapper reads whatever page list a request has, so a step that attends only some of a
request's pages is the same wrapper planned over a table that lists only those. ``select_pages`` builds that
table from a selection and keeps the lengths right: every kept page is full but the request's own last page,
which keeps its ``kv_last_page_len`` wherever it is kept. With ``positions=True`` it also gives the kept pages'
true positions and each request's query position, for a wrapper with explicit positions, so RoPE, ALiBi and
sliding windows stay right over the skipped pages.
"""

from __future__ import annotations

import numpy as np
import torch

from ..plan import PlanError
from ..plan.host import host_array, host_values
from ..plan.page_table import csr_lens, validate_indptr
from ..spec import AttentionSpec, NoMask, Paged, SpecError

POSITIONS_NOTE = ("without explicit positions the kernels number a request's keys by their place in its page list, "
                  "so a skipped page would shift the positions after it")


def position_free(spec: AttentionSpec) -> bool:
    """Whether ``spec``'s answer does not depend on positions: no mask, no positional encoding."""
    return isinstance(spec.mask, NoMask) and spec.pos_encoding is None


def check_position_free(spec: AttentionSpec, what: str, fix: str = "") -> None:
    """``SpecError`` unless ``spec`` has no mask and no positional encoding (soft-cap and sm_scale are
    position-free): ``what`` runs keys whose positions are their places in a list of kept pages or blocks.
    ``fix``: how to get true positions instead (appended to the message)."""
    if not isinstance(spec.mask, NoMask):
        raise SpecError(f"mask: {what} takes NoMask() only, got {spec.mask!r}; {POSITIONS_NOTE}{fix}")
    if spec.pos_encoding is not None:
        raise SpecError(f"pos_encoding: {what} takes None only, got {spec.pos_encoding!r}; {POSITIONS_NOTE}{fix}")


def select_pages(spec: AttentionSpec, kv_indptr, kv_indices, kv_last_page_len, *, keep=None, keep_indptr=None,
                 page_mask=None, positions: bool = False) -> dict:
    """The CSR page table of the kept pages of each request: ``{"kv_indptr", "kv_indices", "kv_last_page_len"}``,
    to pass to ``BatchDecodeWrapper.plan`` (or ``BatchPrefillWrapper.plan``) as they are.

    ``kv_indptr [batch + 1]``, ``kv_last_page_len [batch]``: host ints; ``kv_indices [>= kv_indptr[-1]]``: host
    ints or an int32 tensor on the GPU (the kept ids are then gathered there, no sync; the result is a device
    tensor). The selection, one of:

    - ``keep [batch, k]``: positions in each request's page list (0 = its first page), any order, negative
      entries padding (what a top-k over page scores gives, moved to the host);
    - ``keep [n]`` with ``keep_indptr [batch + 1]``: request b keeps ``keep[keep_indptr[b]:keep_indptr[b+1]]``;
    - ``page_mask [kv_indptr[-1]]``: bool, one flag per page of the table (aligned with ``kv_indices``).

    Kept pages stay in page-table order. A kept page is full, except the request's last page, which keeps its
    ``kv_last_page_len`` (it is the last kept page whenever it is kept); a request that keeps no page gets 0
    pages and length 0 (its output is 0, its lse -inf). ``spec``: a ``Paged`` spec (its page size).

    ``positions=True`` adds ``"kv_page_pos"`` (int64 ``[kept pages]``: each kept page's first token's true
    position, ``page index in the request x page_size``) and ``"q_pos"`` (int64 ``[batch]``: each request's
    decode query at the end of its whole sequence, ``kv_len - 1``; 0 for an empty request) to the table, for a
    decode wrapper built with ``kernel_options={"positions": True}``: RoPE, ALiBi and sliding windows then see
    each kept key at its place in the sequence. Without it the kernels number the kept keys by their place in
    the kept list, so the spec must have ``NoMask()`` and no positional encoding (``SpecError`` otherwise); soft-cap and sm_scale are position-free. Raises
    ``PlanError`` naming the argument for a position outside its request's pages or a page kept twice.

    Example::

        keep = page_scores.topk(8, dim=1).indices.cpu()       # [batch, 8] of each request's pages
        table = flashgen.select_pages(spec, kv_indptr, kv_indices, kv_last_page_len, keep=keep)
        wrapper.plan(**table, num_qo_heads=32, num_kv_heads=8)
        out = wrapper.run(q, kv_cache)

        # RoPE / ALiBi / window: true positions of the kept pages
        wrapper = flashgen.BatchDecodeWrapper(spec, kernel_options={"positions": True})
        wrapper.plan(**flashgen.select_pages(spec, ..., keep=keep, positions=True), num_qo_heads=32, num_kv_heads=8)
    """
    if not isinstance(spec, AttentionSpec) or not isinstance(spec.kv_layout, Paged):
        raise SpecError(f"spec: select_pages takes a spec with a Paged(...) kv_layout, got {spec!r}")
    if not positions:
        check_position_free(spec, "select_pages", " (pass positions=True, with a decode wrapper built with "
                            "kernel_options={'positions': True})")
    page_size = spec.kv_layout.page_size
    ptr, kv_lens = csr_lens(kv_indptr, kv_last_page_len, page_size)
    ptr = ptr.astype(np.int64, copy=False)
    last = host_array("kv_last_page_len", kv_last_page_len)
    batch = ptr.size - 1
    if (keep is None) == (page_mask is None):
        raise PlanError("keep: give one selection, keep (with keep_indptr for a flat list) or page_mask")
    if page_mask is not None:
        if keep_indptr is not None:
            raise PlanError("keep_indptr: goes with keep, not with page_mask")
        flat, new_indptr = _from_mask(page_mask, int(ptr[-1]), ptr)
    else:
        flat, new_indptr = _from_positions(keep, keep_indptr, ptr, batch)
    has = new_indptr[1:] > new_indptr[:-1]
    last_kept = flat[np.maximum(new_indptr[1:] - 1, 0)] if flat.size else np.zeros(batch, np.int64)
    new_last = np.where(has, np.where(last_kept == ptr[1:] - 1, last, page_size), 0).astype(np.int64)
    table = {"kv_indptr": new_indptr, "kv_indices": _gather_ids(kv_indices, flat, int(ptr[-1])),
             "kv_last_page_len": new_last}
    if positions:  # a kept page's place in its request's pages, from the flat places: flat - ptr[its request]
        rows = np.repeat(np.arange(batch), np.diff(new_indptr))
        table["kv_page_pos"] = (flat - ptr[:-1][rows]) * page_size
        table["q_pos"] = np.maximum(np.asarray(kv_lens, np.int64) - 1, 0)
    return table


def _from_mask(page_mask, total: int, ptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mask = host_values("page_mask", page_mask)
    if mask.dtype != np.bool_ or mask.ndim != 1 or mask.size != total:
        raise PlanError(f"page_mask: expected bool [{total}] (kv_indptr[-1], one flag per page), got {mask.dtype} "
                        f"{tuple(mask.shape)}")
    kept = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    return np.flatnonzero(mask), kept[ptr]


def _from_positions(keep, keep_indptr, ptr: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat page-table positions of the kept pages (ascending) and the new indptr."""
    npages = np.diff(ptr)
    keep = host_array("keep", keep, np.ndim(keep) if np.ndim(keep) in (1, 2) else 1)
    if keep.ndim == 2:
        return _from_rows(keep, keep_indptr, ptr, npages, batch)
    if keep_indptr is None:
        raise PlanError("keep_indptr: required with a flat keep [n] (or pass keep as [batch, k])")
    kip = validate_indptr("keep_indptr", keep_indptr)
    if kip.size != batch + 1:
        raise PlanError(f"keep_indptr: has {kip.size} entries, expected batch_size + 1 = {batch + 1}")
    if kip[-1] > keep.size:
        raise PlanError(f"keep_indptr[-1] = {int(kip[-1])} > len(keep) = {keep.size}")
    local = keep[: kip[-1]].astype(np.int64)
    rows = np.repeat(np.arange(batch), np.diff(kip))
    bad = local.view(np.uint64) >= npages[rows]  # a negative position is a huge unsigned one
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _outside(f"keep[{i}]", int(local[i]), int(rows[i]), int(npages[rows[i]]))
    flat = ptr[rows] + local
    if not (np.diff(flat) > 0).all():  # not ascending already: sort, then look for a page kept twice
        order = np.argsort(flat, kind="stable")
        flat = flat[order]
        twice = np.flatnonzero(np.diff(flat) == 0)
        if twice.size:
            i = int(order[twice[0] + 1])
            raise PlanError(f"keep[{i}] = {int(local[i])}: request {rows[i]} keeps that page twice")
    return flat, kip.astype(np.int64, copy=False)


def _from_rows(keep: np.ndarray, keep_indptr, ptr: np.ndarray, npages: np.ndarray, batch: int):
    """``_from_positions`` of ``keep [batch, k]`` (negative entries padding): each row sorted, so the kept
    positions come out ascending and a page kept twice is two equal neighbours."""
    if keep_indptr is not None:
        raise PlanError("keep_indptr: goes with a flat keep [n], not keep [batch, k]")
    if keep.shape[0] != batch:
        raise PlanError(f"keep: has {keep.shape[0]} rows, expected batch_size = {batch} (len(kv_indptr) - 1)")
    if keep.shape[1] == 0:
        return np.zeros(0, np.int64), np.zeros(batch + 1, np.int64)
    srt = np.sort(keep, axis=1)  # padding first
    valid = srt >= 0
    high = srt[:, -1] >= npages
    if high.any():
        b = int(np.flatnonzero(high)[0])
        j = int(np.flatnonzero(keep[b] >= npages[b])[0])
        _outside(f"keep[{b}, {j}]", int(keep[b, j]), b, int(npages[b]))
    twice = (srt[:, 1:] == srt[:, :-1]) & valid[:, 1:]
    if twice.any():
        b, j = (int(x[0]) for x in np.nonzero(twice))
        j = int(np.flatnonzero(keep[b] == srt[b, j])[1])
        raise PlanError(f"keep[{b}, {j}] = {int(keep[b, j])}: request {b} keeps that page twice")
    counts = valid.sum(1)
    flat = np.repeat(ptr[:-1], counts) + srt[valid]
    return flat, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _outside(where: str, value: int, request: int, pages: int):
    raise PlanError(f"{where} = {value} is outside request {request}'s pages [0, {pages})")


def _gather_ids(kv_indices, flat: np.ndarray, total: int):
    """The kept page ids: a device tensor gathered on its device, host ids as int64 numpy."""
    if isinstance(kv_indices, torch.Tensor) and kv_indices.device.type != "cpu":
        if kv_indices.dim() != 1 or kv_indices.dtype != torch.int32:
            raise PlanError(f"kv_indices: a device page table must be int32 [n], got {kv_indices.dtype} "
                            f"{tuple(kv_indices.shape)}")
        if kv_indices.numel() < total:
            raise PlanError(f"kv_indptr[-1] = {total} > len(kv_indices) = {kv_indices.numel()}")
        index = torch.from_numpy(flat).to(kv_indices.device, non_blocking=True)
        return kv_indices.index_select(0, index)
    ids = host_array("kv_indices", kv_indices)
    if ids.size < total:
        raise PlanError(f"kv_indptr[-1] = {total} > len(kv_indices) = {ids.size}")
    return ids[flat].astype(np.int64, copy=False)
