"""A cascade's shared level split over its keys into chunks of whole pages, for the Hopper prefill (whose plans
run every request unsplit: one CTA a (q tile, kv head)).

The shared level of a decode batch has many keys and few q tiles: 128 queries x GQA 4 = 4 tiles x 8 kv heads =
32 CTAs for a 32k prefix on 132 SMs. Cut each group's pages into ``chunks`` runs of whole pages, each attended by
the group's queries as a request of its own, and the level has ``chunks`` times the work items; each chunk's
(out, lse) is one more partial state of its tokens, merged with the other levels' (``merge_states_in_place``).
A shared level's keys all precede its queries, so no causal mask cuts a chunk; with explicit positions a page
keeps its true position (its ``kv_page_pos`` entry moves with it).

Layout, chunk-major: request ``k * groups + g`` is chunk ``k`` of group ``g``; its queries are rows
``k * total_q + qo_indptr[g] ...`` of q repeated ``chunks`` times, so the output rows ``k * total_q ...`` hold
chunk ``k``'s states of every token (``[chunks, total_q, ...]``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cascade import LevelTable
from .host import PlanError

SPLIT_MIN_FILL = 0.6  # "auto" splits for the Hopper kernel only where the items fill this share of the SMs


class ChunkedLevel(NamedTuple):
    """A level split into ``chunks``: ``table`` (``chunks x groups`` requests, chunk-major) and ``order``, where
    the chunked table's page entries come from in the level's ``kv_indices`` (None: the same entries, in order;
    always so for one group). ``positions`` maps the level's position arrays onto it."""

    table: LevelTable
    chunks: int
    order: np.ndarray | None

    def positions(self, kv_page_pos: np.ndarray, q_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(kv_page_pos, q_pos)`` of the chunked requests: each page entry's true position moves with it, and
        every chunk's queries sit where the level's do."""
        pages = kv_page_pos if self.order is None else kv_page_pos[self.order]
        return pages, np.tile(q_pos, self.chunks)


def choose_chunks(tiles: int, num_kv_heads: int, max_pages: int, page_size: int, num_sms: int, *,
                  min_chunk_tokens: int = 2048, item_overhead: int = 256, min_fill: float = 0.0) -> int:
    """How many chunks a shared level's keys are split into for the Hopper kernel (1: not split).

    ``tiles``: the level's q tiles (all groups), each run once per kv head; ``max_pages``: the pages of its
    longest group. A level whose ``tiles x num_kv_heads`` items fill the SMs runs unsplit. Else the candidates
    are the most chunks that keep the items within one wave and within two (``waves x num_sms // items``),
    each chunk of the longest group at least ``min_chunk_tokens`` keys (whole pages); the estimate is ``waves x
    longest`` with ``longest`` the longest chunk's keys + ``item_overhead`` (an item's Q load, pipeline fill and
    epilogue, in keys), and a candidate must beat the fewer chunks by 1 %. ``min_fill``: a split whose items
    fill less than this share of the SMs is not taken (the portable kernel's split-KV plan fills them all).

    A decode batch of 128 over a 32k prefix (2048 pages of 16), 4 tiles x 8 kv heads = 32 items on 132 SMs:
    unsplit one wave of 32768 + 256; 4 chunks, 128 items, one wave of 8192 + 256 = 8448; 8 chunks, 256 items,
    two waves of 4096 + 256 = 8704. 4 chunks win. At 2k keys the 2048-key minimum leaves it whole:

    >>> choose_chunks(4, 8, 2048, 16, 132), choose_chunks(4, 8, 128, 16, 132)
    (4, 1)
    >>> choose_chunks(1, 8, 2048, 16, 132), choose_chunks(4, 8, 256, 16, 132, min_fill=0.6)
    (16, 1)
    """
    items = tiles * num_kv_heads
    if items <= 0 or items >= num_sms or max_pages <= 1:
        return 1
    most = max_pages // -(-min_chunk_tokens // page_size)  # chunks of the longest group keep >= the minimum
    best, bar = 1, (max_pages * page_size + item_overhead) / 1.01
    for waves in (1, 2):
        chunks = min(waves * num_sms // items, most)
        if chunks <= best:
            continue
        estimate = -(-(items * chunks) // num_sms) * (-(-max_pages // chunks) * page_size + item_overhead)
        if estimate < bar:
            best, bar = chunks, estimate / 1.01
    if best > 1 and items * best < min_fill * num_sms:
        return 1
    return best


def chunk_bounds(npages: np.ndarray, chunks: int) -> np.ndarray:
    """``[groups, chunks + 1]``: the first page (within its group) of each chunk, and the group's page count.
    Chunk ``k`` of ``n`` pages holds pages ``k n // chunks .. (k + 1) n // chunks``: every page in exactly one
    chunk, sizes differing by at most one, the last page always in the last chunk (earlier chunks are empty
    when ``n < chunks``).

    >>> chunk_bounds(np.array([5, 2, 0]), 3).tolist()
    [[0, 1, 3, 5], [0, 0, 1, 2], [0, 0, 0, 0]]
    """
    return (np.arange(chunks + 1, dtype=np.int64)[None, :] * np.asarray(npages, np.int64)[:, None]) // chunks


def splittable(table: LevelTable) -> bool:
    """Whether ``split_level`` takes ``table``: a CSR table, its page ids on the host or one group (device ids
    are then re-cut, never gathered)."""
    return table.kv_indptr is not None and (table.host or table.groups == 1)


def split_level(table: LevelTable, chunks: int, page_size: int) -> ChunkedLevel:
    """``table`` (a shared level, ``splittable``) as ``chunks x groups`` requests, chunk-major (module docstring).
    A chunk that does not end its group ends on a whole page (``kv_last_page_len = page_size``); an empty chunk
    has no keys (``lse = -inf``, weight 0 in the merge). Numpy over the groups and pages, no per-group Python.

    >>> level = LevelTable(np.array([0, 3]), np.array([71]), np.array([0, 5]), np.arange(10, 15), np.array([7]))
    >>> chunked = split_level(level, 2, 16).table
    >>> chunked.qo_indptr.tolist(), chunked.kv_indptr.tolist(), chunked.kv_lens.tolist()
    ([0, 3, 6], [0, 2, 5], [32, 39])
    """
    if chunks < 1:
        raise PlanError(f"chunks: got {chunks}, expected >= 1")
    if not splittable(table):
        raise PlanError("levels: a level split into chunks takes a CSR page table, with host page ids when it "
                        "has more than one group")
    qo = table.qo_indptr.astype(np.int64, copy=False)
    groups, total_q = qo.size - 1, int(qo[-1])
    indptr = table.kv_indptr.astype(np.int64, copy=False)
    npages = np.diff(indptr)
    bounds = chunk_bounds(npages, chunks)
    sizes = np.diff(bounds, axis=1).T  # [chunks, groups]
    qo_chunked = np.empty(chunks * groups + 1, np.int64)
    qo_chunked[:-1] = (np.arange(chunks, dtype=np.int64)[:, None] * total_q + qo[None, :-1]).ravel()
    qo_chunked[-1] = chunks * total_q
    kv_indptr = np.zeros(chunks * groups + 1, np.int64)
    np.cumsum(sizes.ravel(), out=kv_indptr[1:])
    last = np.where(sizes > 0, page_size, 0)
    last[-1] = table.kv_last_page_len[:groups]  # the group's last page is its last chunk's
    kv_lens = np.where(sizes > 0, (sizes - 1) * page_size + last, 0).ravel()
    order, ids = None, table.kv_indices
    if groups > 1:
        starts = (indptr[:-1, None] + bounds[:, :-1]).T.ravel()  # each chunk's first entry in the level's table
        order = np.repeat(starts - kv_indptr[:-1], sizes.ravel()) + np.arange(int(kv_indptr[-1]))
        ids = ids[order]
    chunked = LevelTable(qo_chunked, kv_lens, kv_indptr.astype(np.int32), ids, last.ravel().astype(np.int32))
    return ChunkedLevel(chunked, chunks, order)
