"""Cascade plans: a batch whose requests share KV prefixes, split into levels.

Level 0 is typically one group (the prefix all requests share), level 1 groups of requests (a prefix per
group), the last level one group per request (its unique suffix). Every level covers all ``total_q`` query
tokens: its ``qo_indptr`` cuts the batch's tokens into that level's groups (a group's requests must be
consecutive) and its page table gives each group's own KV over that level's pages. So a shared prefix is read
once per group, not once per request; each token's states of all levels merge into its output (a group with
no KV contributes ``lse = -inf``, weight 0).

Masks and positions: levels before the last see all of their KV (no mask); the last level applies the spec's
causal mask aligned to its own KV end. That equals causal attention over the whole sequence as long as every
shared key precedes (or is) each request's first query position: last-level ``kv_len >= qo_len - 1``.

This module holds the levels' host side:

- ``CascadeLevel``: one level as a caller gives it (CSR or block table, as the other wrappers take them);
  ``check_levels`` validates a list of them into ``LevelTable`` records (numpy, host page ids as CSR).
- ``derive_levels``: the levels of a batch of per-request page tables, found as a prefix tree over consecutive
  requests (worked example in its docstring).
- ``fold_level``: a level's pages prepended to the groups of the next level (one level fewer to run).
- ``plan_cascade``: every level as a split-KV plan in one buffer (the CPU executor runs it).

The cost model that decides which levels pay is ``cascade_cost``.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

from .host import PlanError, check_int, host_array
from .page_table import block_table_to_csr, csr_checked, csr_lens, indptr_steps, validate_block_table
from .plan import Plan
from .heuristics import choose_kv_chunk, default_tile_rows
from .split_kv import SplitKVInfo, _batch_inputs, _check_options, split_kv_arrays


class CascadeLevel(NamedTuple):
    """One level of a cascade, as ``CascadeWrapper.plan(levels=[...])`` takes it.

    ``qo_indptr [groups + 1]`` (host): the query tokens of each group, consecutive ranges covering all
    ``total_q`` tokens. The groups' KV as a CSR page table (``kv_indptr [groups + 1]`` host, ``kv_indices``
    host or device int32, ``kv_last_page_len [groups]`` host) or a block table (``block_table [groups,
    max_blocks]`` host or device, ``seq_lens [groups]`` host). A group with no KV is allowed (its tokens get
    nothing from this level). Host page ids let the planner fold a level that does not pay into the next.

    >>> level = CascadeLevel([0, 4], [0, 2], [7, 3], [16])   # 4 tokens, one group over pages 7 and 3 (32 tokens)
    >>> level.kv_indices, level.block_table
    ([7, 3], None)
    """

    qo_indptr: object
    kv_indptr: object = None
    kv_indices: object = None
    kv_last_page_len: object = None
    block_table: object = None
    seq_lens: object = None


class LevelTable(NamedTuple):
    """A checked level: ``qo_indptr [groups + 1]``, ``kv_lens [groups]`` (numpy) and its page table, CSR
    (``kv_indices`` a numpy array: host ids, foldable; or a device tensor) or a device block table."""

    qo_indptr: np.ndarray
    kv_lens: np.ndarray
    kv_indptr: np.ndarray | None = None
    kv_indices: object = None
    kv_last_page_len: np.ndarray | None = None
    block_table: object = None
    seq_lens: np.ndarray | None = None

    @property
    def groups(self) -> int:
        return self.qo_indptr.size - 1

    @property
    def host(self) -> bool:
        """Whether the page ids are host CSR arrays (the level can be folded and derived from)."""
        return isinstance(self.kv_indices, np.ndarray)

    def table(self) -> dict:
        """The page-table arguments of a wrapper's ``plan()``."""
        if self.block_table is not None:
            return {"block_table": self.block_table, "seq_lens": self.seq_lens}
        return {"kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices, "kv_last_page_len": self.kv_last_page_len}


def empty_level(total_q: int) -> LevelTable:
    """A level of one group holding every token and no KV (a CUDA-graph wrapper's level with nothing to run)."""
    zero = np.zeros(1, np.int32)
    return LevelTable(np.array([0, total_q], np.int64), zero.astype(np.int64), np.zeros(2, np.int32),
                      np.zeros(0, np.int32), zero)


# ---------------------------------------------------------------------------------------------- given levels


def check_levels(levels: object, page_size: int, num_pages: int | None = None) -> list[LevelTable]:
    """Validate ``levels`` (a non-empty sequence of ``CascadeLevel``, 4-tuples ``(qo_indptr, kv_indptr,
    kv_indices, kv_last_page_len)`` or mappings with ``CascadeLevel``'s keys) into ``LevelTable`` records; host
    block tables become CSR. Errors are ``PlanError`` naming the level and argument, e.g. ``levels[1].kv_indptr``.

    >>> levels = check_levels([([0, 3], [0, 1], [5], [16]), ([0, 1, 3], [0, 1, 2], [2, 4], [3, 9])], 16)
    >>> [t.kv_lens.tolist() for t in levels]
    [[16], [3, 9]]
    """
    if isinstance(levels, (str, bytes, Mapping)) or not isinstance(levels, Sequence) or not levels:
        raise PlanError("levels: expected a non-empty list of CascadeLevel (qo_indptr and a page table per level)")
    tables, total_q = [], None
    for index, level in enumerate(levels):
        try:
            table = _check_level(_as_level(level), page_size, num_pages)
        except PlanError as exc:
            raise type(exc)(f"levels[{index}].{exc}") from exc
        if total_q is None:
            total_q = int(table.qo_indptr[-1])
        elif table.qo_indptr[-1] != total_q:
            raise PlanError(f"levels[{index}].qo_indptr[-1] = {int(table.qo_indptr[-1])}, expected total_q = "
                            f"{total_q} (levels[0]'s: every level covers all query tokens)")
        tables.append(table)
    return tables


def _as_level(level: object) -> CascadeLevel:
    if isinstance(level, CascadeLevel):
        return level
    if isinstance(level, Mapping):
        unknown = set(level) - set(CascadeLevel._fields)
        if unknown:
            raise PlanError(f"{sorted(unknown)[0]}: not a CascadeLevel field (expected "
                            f"{', '.join(CascadeLevel._fields)})")
        if "qo_indptr" not in level:
            raise PlanError("qo_indptr: required")
        return CascadeLevel(**level)
    if isinstance(level, (tuple, list)) and len(level) == 4:
        return CascadeLevel(*level)
    raise PlanError(f"qo_indptr: expected a CascadeLevel, a mapping or a 4-tuple (qo_indptr, kv_indptr, kv_indices, "
                    f"kv_last_page_len), got {type(level).__name__}")


def _check_level(level: CascadeLevel, page_size: int, num_pages: int | None) -> LevelTable:
    qo = indptr_steps("qo_indptr", level.qo_indptr)[0]
    groups = qo.size - 1
    if level.block_table is not None:
        if level.seq_lens is None or any(x is not None for x in (level.kv_indptr, level.kv_indices,
                                                                 level.kv_last_page_len)):
            raise PlanError("block_table: give block_table with seq_lens, and no CSR arrays")
        table = level.block_table
        if isinstance(table, torch.Tensor) and table.is_cuda:
            lens = host_array("seq_lens", level.seq_lens)
            if table.dim() != 2 or lens.size != table.shape[0] or lens.size != groups:
                raise PlanError(f"seq_lens: has {lens.size} entries for a block_table of shape {tuple(table.shape)}, "
                                f"expected one per group ({groups}, len(qo_indptr) - 1)")
            cap = table.shape[1] * page_size
            if lens.size and (lens.min() < 0 or lens.max() > cap):
                b = int(np.flatnonzero((lens < 0) | (lens > cap))[0])
                raise PlanError(f"seq_lens[{b}] = {int(lens[b])}, expected 0..{cap} (block_table's columns)")
            return LevelTable(qo, lens.astype(np.int64), block_table=table, seq_lens=lens)
        validate_block_table(table, level.seq_lens, page_size, num_pages)
        indptr, indices, last = (t.numpy() for t in block_table_to_csr(table, level.seq_lens, page_size))
        level = CascadeLevel(qo, indptr, indices, last)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        if getattr(level, name) is None:
            raise PlanError(f"{name}: required (a paged level takes kv_indptr, kv_indices and kv_last_page_len, "
                            "or block_table and seq_lens)")
    ids = level.kv_indices
    if isinstance(ids, torch.Tensor) and ids.is_cuda:
        indptr, lens = csr_lens(level.kv_indptr, level.kv_last_page_len, page_size)
        if ids.dim() != 1 or indptr[-1] > ids.numel():
            raise PlanError(f"kv_indptr[-1] = {int(indptr[-1])}, more than kv_indices' {ids.numel()} ids")
    else:
        ids = host_array("kv_indices", ids)
        indptr, lens, _ = csr_checked(level.kv_indptr, ids, level.kv_last_page_len, page_size, num_pages)
    if indptr.size != groups + 1:
        raise PlanError(f"kv_indptr: has {indptr.size} entries, expected len(qo_indptr) = {groups + 1} (one group "
                        "per qo_indptr range)")
    return LevelTable(qo, lens, indptr, ids, host_array("kv_last_page_len", level.kv_last_page_len))


def check_causal(levels: list[LevelTable]) -> None:
    """``PlanError`` naming the first request (group of the last level) whose queries would see shared keys after
    their own position: a causal cascade needs, for each request with shared keys, last-level ``kv_len >= qo_len -
    1`` (every shared key at or before its first query)."""
    last = levels[-1]
    qo_lens = np.diff(last.qo_indptr)
    first = last.qo_indptr[:-1]
    shared = np.zeros(last.groups, np.int64)
    for level in levels[:-1]:
        if level.groups:
            shared += level.kv_lens[np.clip(np.searchsorted(level.qo_indptr, first, side="right") - 1, 0,
                                            level.groups - 1)]
    bad = (qo_lens > 0) & (shared > 0) & (last.kv_lens < qo_lens - 1)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        qo_len, kv_len = int(qo_lens[b]), int(last.kv_lens[b])
        raise PlanError(f"levels[{len(levels) - 1}]: request {b} has {qo_len} queries but {kv_len} keys in its last "
                        f"level after {int(shared[b])} shared ones; with a Causal mask every shared key must precede "
                        f"its first query (last-level kv_len >= qo_len - 1): move its last {qo_len - 1 - kv_len} "
                        "shared keys into its last level")


def level_positions(levels: Sequence[LevelTable], page_size: int) -> tuple[list[np.ndarray], np.ndarray]:
    """True positions of a cascade's levels, for kernels with explicit positions: ``(kv_page_pos of each level,
    q_pos)``. A level's group starts where its tokens' keys of the earlier levels end (the sum of their groups'
    ``kv_lens``), so its page ``i`` starts at that offset + ``i x page_size`` (``kv_page_pos``, parallel to its
    ``kv_indices``); a token's position is its request's whole KV length (all levels) - qo_len + its index in the
    request (``q_pos [total_q]``; negative for the first queries of a request with fewer keys than queries, as
    flat attention places them). Numpy over the tokens and pages, one pass a level. ``PlanError``: a block-table
    level, or a group whose tokens have different keys before it (levels must nest).

    >>> shared = LevelTable(np.array([0, 2]), np.array([20]), np.array([0, 2]), np.arange(2), np.array([4]))
    >>> last = LevelTable(np.array([0, 1, 2]), np.array([3, 17]), np.array([0, 1, 3]), np.arange(3), np.array([3, 1]))
    >>> pages, q_pos = level_positions([shared, last], 16)
    >>> [x.tolist() for x in pages], q_pos.tolist()
    ([[0, 16], [20, 20, 36]], [22, 36])
    """
    total_q = int(levels[-1].qo_indptr[-1])
    before = np.zeros(total_q + 1, np.int64)  # per token (and one spare): keys of the levels so far
    pages = []
    for index, level in enumerate(levels):
        if level.kv_indptr is None:
            raise PlanError(f"levels[{index}]: true positions (RoPE, ALiBi, a sliding window) take CSR page tables "
                            "(kv_indptr, kv_indices, kv_last_page_len), not block_table")
        qo = level.qo_indptr.astype(np.int64, copy=False)
        counts = np.diff(qo)
        start = before[qo[:-1]]
        bad = (counts > 0) & (start != before[np.maximum(qo[1:] - 1, 0)])
        if bad.any():
            g = int(np.flatnonzero(bad)[0])
            raise PlanError(f"levels[{index}]: group {g}'s tokens have different keys before this level (each group's "
                            "requests must share every earlier level's group)")
        npages = np.diff(level.kv_indptr.astype(np.int64, copy=False))
        within = np.arange(int(npages.sum())) - np.repeat(np.cumsum(npages) - npages, npages)
        pages.append(np.repeat(start, npages) + within * page_size)
        before[:total_q] += np.repeat(level.kv_lens.astype(np.int64, copy=False), counts)
    qo = levels[-1].qo_indptr.astype(np.int64, copy=False)
    counts = np.diff(qo)
    q_pos = before[:total_q] - np.repeat(counts, counts) + (
        np.arange(total_q) - np.repeat(qo[:-1], counts))
    return pages, q_pos


# ---------------------------------------------------------------------------------------------- derived levels


def derive_levels(qo_indptr: object, kv_indptr: object, kv_indices: object, kv_last_page_len: object,
                  page_size: int, *, causal: bool = False, max_levels: int | None = None,
                  num_pages: int | None = None, with_table: bool = False, block_table: object = None):
    """The cascade levels of a batch whose consecutive requests share leading pages (host CSR arrays).

    Consecutive requests whose page lists start with the same page ids form a group; groups nest (a prefix
    tree over consecutive requests), one level per branching depth, and a last level holds each request's own
    remaining pages. A request that branches off earlier gets an empty group (no KV) at the deeper levels. Only
    whole pages are shared: a page shared by requests is full in each of them, or the last page of all of them
    with one ``kv_last_page_len``. With ``causal``, a request shares only pages whose keys precede (or are) its
    first query position, so its queries lie in its last level. ``max_levels`` caps the levels (shared
    levels + the last): deeper shared pages stay in the last level. Reads every page id once (numpy).
    ``block_table``: the same page ids as a host block table ``[batch, >= max pages]`` (padding after each
    row's pages), where the caller has one (``PagedKVCache.page_tables`` builds both): neighbouring requests'
    leading pages then compare as rows in one pass instead of pair by pair. Its rows' first and last ids are
    checked against ``kv_indices``.

    Example, page_size 4: requests 0-2 start with pages 7, 8; requests 1 and 2 also share page 2; request 3
    shares nothing. Three levels::

        request  pages           level 0 (groups)      level 1            last
        0        7 8 1           [7 8] for 0-2         []                 [1]
        1        7 8 2 5  (+2)                         [2] for 1-2        [5] (2 tokens)
        2        7 8 2 6                                                  [6]
        3        9        (+3)   [] for 3              []                 [9] (3 tokens)

    >>> levels = derive_levels([0, 1, 2, 3, 4], [0, 3, 7, 11, 12], [7, 8, 1, 7, 8, 2, 5, 7, 8, 2, 6, 9],
    ...                        [4, 2, 4, 3], page_size=4)
    >>> [(t.qo_indptr.tolist(), t.kv_indices.tolist(), t.kv_lens.tolist()) for t in levels]
    [([0, 3, 4], [7, 8], [8, 0]), ([0, 1, 3, 4], [2], [0, 4, 0]), ([0, 1, 2, 3, 4], [1, 5, 6, 9], [4, 2, 4, 3])]
    """
    max_levels = check_int("max_levels", max_levels, 1, optional=True)
    ids = host_array("kv_indices", kv_indices)
    indptr, kv_lens, _ = csr_checked(kv_indptr, ids, kv_last_page_len, page_size, num_pages)
    last = host_array("kv_last_page_len", kv_last_page_len).astype(np.int64)
    qo = indptr_steps("qo_indptr", qo_indptr)[0]
    batch = kv_lens.size
    if qo.size != batch + 1:
        raise PlanError(f"qo_indptr: has {qo.size} entries, expected batch_size + 1 = {batch + 1} (len(kv_indptr))")
    indptr = indptr.astype(np.int64)
    npages = np.diff(indptr)
    shareable = npages
    if causal:  # whole pages of keys at or before the first query position (a decode query sees every key)
        qo_lens = np.diff(qo)
        shareable = np.where(qo_lens <= 1, npages, np.clip((kv_lens - qo_lens + 1) // page_size, 0, None))
    rows = None if block_table is None else _block_rows(block_table, indptr, ids, npages)
    lcp = _pair_prefixes(indptr, ids, npages, last, shareable, page_size, rows)
    nodes = _prefix_tree(lcp.tolist(), batch, (max_levels or 2**30) - 1)
    depth = 1 + max((node[0] for node in nodes), default=-1)
    ends = np.zeros((depth, batch), np.int64)  # ends[t, b]: pages of request b in levels 0..t
    interior = np.zeros((depth, batch + 1), bool)  # a group boundary inside a node of level t
    for t, i, j, m in nodes:
        ends[t, i:j] = m
        interior[t, i + 1:j] = True
    np.maximum.accumulate(ends, axis=0, out=ends)  # a request outside every node of level t keeps its depth
    levels = []
    begins = np.zeros(batch, np.int64)
    for t in range(depth):
        starts = np.flatnonzero(~interior[t])
        first = starts[:-1]
        levels.append(_level_table(qo[starts], indptr[first], ids, begins[first], ends[t, first], npages[first],
                                   last[first], page_size))
        begins = ends[t]
    flat = LevelTable(qo, kv_lens, indptr, ids, last)
    levels.append(_level_table(qo, indptr[:-1], ids, begins, npages, npages, last, page_size) if depth else flat)
    return (levels, flat) if with_table else levels


PAIR_LOOP = 64  # pairs compared one by one up to this many, or while they average this many pages


def _block_rows(block_table: object, indptr: np.ndarray, ids: np.ndarray, npages: np.ndarray) -> np.ndarray:
    """``block_table`` as a host 2-D array, checked to hold ``kv_indices``' pages row by row (shape, and each
    row's first and last id: one gather over the batch), else ``PlanError``."""
    table = host_array("block_table", block_table, ndim=2)
    width = int(npages.max(initial=0))
    if table.shape[0] != npages.size or table.shape[1] < width:
        raise PlanError(f"block_table: expected the batch's page ids as [batch = {npages.size}, >= {width}] (the most "
                        f"pages a request holds), got shape {table.shape}")
    held = np.flatnonzero(npages > 0)
    if held.size:
        first = table[held, 0] != ids[indptr[held]]
        final = table[held, npages[held] - 1] != ids[indptr[held + 1] - 1]
        if first.any() or final.any():
            b = int(held[np.flatnonzero(first | final)[0]])
            raise PlanError(f"block_table: row {b} does not hold request {b}'s page ids (kv_indices[kv_indptr[{b}]:"
                            f"kv_indptr[{b + 1}]])")
    return table


def _pair_prefixes(indptr, ids, npages, last, shareable, page_size, rows=None) -> np.ndarray:
    """``lcp [batch - 1]``: the pages requests ``b`` and ``b + 1`` may share (equal leading ids, whole pages).
    Pairs whose first ids differ are ruled out at once; the others compare slices pair by pair (contiguous
    compares, ~3 us a pair of 2k pages on the CI host) or, for many short pairs, in one gather; given the block
    table ``rows``, neighbouring rows compare in one pass (~50 us for 128 rows of 2k pages)."""
    batch = npages.size
    if batch < 2 or not ids.size:
        return np.zeros(max(batch - 1, 0), np.int64)
    m = np.minimum(shareable[:-1], shareable[1:])
    top = ids.size - 1
    heads = ids[np.minimum(indptr[:-1], top)]
    pairs = np.flatnonzero((m > 0) & (heads[:-1] == heads[1:]))
    lcp = np.zeros(batch - 1, np.int64)
    if rows is not None and pairs.size:
        width = int(m[pairs].max())
        neq = rows[:-1, :width] != rows[1:, :width]
        k = neq.argmax(axis=1)[pairs]
        lcp[pairs] = np.minimum(np.where(neq[pairs, k], k, width), m[pairs])
    elif pairs.size <= PAIR_LOOP or int(m[pairs].sum()) >= pairs.size * PAIR_LOOP:
        for b, a, c, n in zip(pairs.tolist(), indptr[pairs].tolist(), indptr[pairs + 1].tolist(), m[pairs].tolist()):
            neq = ids[a:a + n] != ids[c:c + n]
            k = int(neq.argmax())
            lcp[b] = k if neq[k] else n
    elif pairs.size:
        n = m[pairs]
        ends = np.cumsum(n)
        starts = ends - n
        a = np.repeat(indptr[pairs] - starts, n) + np.arange(int(ends[-1]))  # request b's j-th page id, pair by pair
        bad = np.flatnonzero(ids[a] != ids[a + np.repeat(npages[pairs], n)])
        lcp[pairs] = n
        if bad.size:
            pair = np.searchsorted(ends, bad, side="right")
            first = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
            lcp[pairs[pair[first]]] = bad[first] - starts[pair[first]]
    full = np.maximum(npages - (last < page_size), 0)  # leading full pages
    limit = np.minimum(full[:-1], full[1:])
    over = lcp > limit  # the pair shares a partial page: only as the last page of both, with one length
    if over.any():
        same = (npages[:-1] == lcp) & (npages[1:] == lcp) & (last[:-1] == last[1:])
        lcp = np.where(over & ~same, limit, lcp)
    return lcp


def _prefix_tree(lcp: list, batch: int, max_depth: int) -> list[tuple[int, int, int, int]]:
    """Nodes ``(level, first, end, pages)`` of the prefix tree over consecutive requests: requests ``first ..
    end - 1`` (two or more) share their first ``pages`` pages, the node's own pages being those past its
    parent's; ``level`` counts the nodes above it. Levels from ``max_depth`` on are left out."""
    if batch < 2 or max_depth < 1:
        return []
    nodes = []
    stack = [(0, batch, 0, 0)]  # a range of requests that share `depth` pages, and its level
    while stack:
        i, j, depth, level = stack.pop()
        shared = min(lcp[i:j - 1])
        if shared > depth:
            nodes.append((level, i, j, shared))
            depth, level = shared, level + 1
            if level >= max_depth:
                continue
        start = i
        for b in range(i, j - 1):  # the children: split where neighbours share no more than `depth`
            if lcp[b] == depth:
                if b + 1 - start >= 2:
                    stack.append((start, b + 1, depth, level))
                start = b + 1
        if j - start >= 2:
            stack.append((start, j, depth, level))
    return nodes


def _level_table(qo, base, ids, begin, end, npages, last, page_size) -> LevelTable:
    """The level whose group ``g`` holds pages ``begin[g] .. end[g] - 1`` of the request whose page list
    starts at ``ids[base[g]]`` (its first member); ``qo [groups + 1]`` its token ranges."""
    counts = end - begin
    kv_indptr = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=kv_indptr[1:])
    total = int(kv_indptr[-1])
    src = np.repeat(base + begin - kv_indptr[:-1], counts) + np.arange(total)
    tail = np.where(counts == 0, 0, np.where(end == npages, last, page_size))
    lens = np.where(counts == 0, 0, (counts - 1) * page_size + tail)
    return LevelTable(qo.astype(np.int64), lens, kv_indptr, ids[src].astype(np.int32), tail)


# ---------------------------------------------------------------------------------------------- folding


def fold_level(parent: LevelTable, child: LevelTable, page_size: int) -> LevelTable | None:
    """``child`` with ``parent``'s pages prepended to each of its groups (``parent`` then need not run), or
    None where that is not possible (``fold_lens``).

    >>> parent = check_levels([([0, 3], [0, 2], [7, 8], [4])], 4)[0]
    >>> child = check_levels([([0, 1, 3], [0, 1, 1], [5], [2, 0])], 4)[0]
    >>> folded = fold_level(parent, child, 4)
    >>> folded.kv_indices.tolist(), folded.kv_indptr.tolist(), folded.kv_lens.tolist()
    ([7, 8, 5, 7, 8], [0, 3, 5], [10, 8])
    """
    found = _fold_map(parent, child, page_size)
    if found is None:
        return None
    p, add = found
    if p is None:
        return child
    child_pages = np.diff(child.kv_indptr)
    counts = np.stack([add, child_pages], axis=1).ravel()
    held = int(parent.kv_indptr[-1])
    pool = np.concatenate([parent.kv_indices[:held], child.kv_indices[:int(child.kv_indptr[-1])]])
    starts = np.stack([parent.kv_indptr[p], held + child.kv_indptr[:-1]], axis=1).ravel()
    kv_indptr = np.zeros(child.groups + 1, np.int64)
    np.cumsum(add + child_pages, out=kv_indptr[1:])
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    src = np.repeat(starts - offsets, counts) + np.arange(int(kv_indptr[-1]))
    last = np.where(child_pages > 0, child.kv_last_page_len, np.where(add > 0, parent.kv_last_page_len[p], 0))
    return LevelTable(child.qo_indptr, fold_lens(parent, child, page_size), kv_indptr, pool[src].astype(np.int32),
                      last)


def fold_lens(parent: LevelTable, child: LevelTable, page_size: int) -> np.ndarray | None:
    """The ``kv_lens`` of ``fold_level(parent, child)`` (without moving page ids), or None where the fold is not
    possible: page ids on the device, a child group (with tokens) not inside one parent group, or a parent group
    ending in a partial page ahead of child pages."""
    found = _fold_map(parent, child, page_size)
    if found is None:
        return None
    p, add = found
    return child.kv_lens if p is None else child.kv_lens + np.where(add > 0, parent.kv_lens[p], 0)


def _fold_map(parent: LevelTable, child: LevelTable, page_size: int):
    """``(p, add)``: each child group's parent group and the parent pages it takes (0 for a group with no
    tokens); ``(None, None)`` when there is nothing to fold; None when the fold is not possible."""
    if not (parent.host and child.host):
        return None
    if child.groups == 0 or parent.groups == 0:
        return None, None
    pq, cq = parent.qo_indptr, child.qo_indptr
    tokens = cq[1:] > cq[:-1]
    p = np.clip(np.searchsorted(pq, cq[:-1], side="right") - 1, 0, parent.groups - 1)
    if (tokens & (cq[1:] > pq[p + 1])).any():
        return None
    add = np.where(tokens, np.diff(parent.kv_indptr)[p], 0)
    if ((add > 0) & (np.diff(child.kv_indptr) > 0) & (parent.kv_last_page_len[p] != page_size)).any():
        return None
    return p, add


# ---------------------------------------------------------------------------------------------- split-KV plans


class CascadeInfo(NamedTuple):
    """Sizes of a cascade plan: ``levels[l]`` describes the split-KV plan of level ``l``."""

    num_levels: int
    total_q: int
    levels: tuple[SplitKVInfo, ...]


def plan_cascade(levels: Sequence[tuple[object, object]], *, num_qo_heads: int, num_kv_heads: int,
                 tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132,
                 item_overhead: int = 64, host_buffer: torch.Tensor | None = None) -> Plan:
    """Plan a cascade: ``levels[l] = (qo_indptr [groups_l + 1], kv_lens [groups_l])``, host ints.

    All levels' ``qo_indptr`` must end at the same ``total_q``. Returns a ``Plan`` of kind ``"cascade"``:
    fields ``level{l}.<SPLIT_KV_SCHEMA name>`` and a ``CascadeInfo``; ``plan.level(l)`` gives level ``l``
    as a split-KV plan over the same buffer.

    >>> plan = plan_cascade([([0, 6], [4096]), ([0, 2, 6], [100, 37])], num_qo_heads=8, num_kv_heads=2)
    >>> plan.info.num_levels, plan.level(1)["kv_len"].tolist()
    (2, [100, 37])
    """
    _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead)
    if not levels:
        raise PlanError("levels: empty, expected at least one (qo_indptr, kv_lens) level")
    group_size = num_qo_heads // num_kv_heads
    arrays: dict[str, np.ndarray] = {}
    infos = []
    total_q = None
    for level, (qo_indptr, kv_lens) in enumerate(levels):
        qo, lens = _batch_inputs(qo_indptr, kv_lens)
        if total_q is None:
            total_q = int(qo[-1])
        elif qo[-1] != total_q:
            raise PlanError(f"levels[{level}]: qo_indptr[-1] = {int(qo[-1])}, expected total_q = {total_q} "
                            f"(every level covers all query tokens)")
        rows = default_tile_rows(int(np.diff(qo).max(initial=0)) * group_size) if tile_rows is None else tile_rows
        tiles = -(-(np.diff(qo) * group_size) // rows)
        chunk = choose_kv_chunk(lens, tiles, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                item_overhead=item_overhead)
        level_arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                             tile_rows=rows, kv_chunk=chunk, max_batch_size=qo.size - 1,
                                             max_total_q=total_q, capacity=None)
        for key, values in level_arrays.items():
            names = tuple(f"level{level}.{name}" for name in (key if isinstance(key, tuple) else (key,)))
            arrays[names if isinstance(key, tuple) else names[0]] = values
        infos.append(info)
    return Plan.pack("cascade", arrays, CascadeInfo(len(levels), total_q, tuple(infos)), host_buffer)
