"""Split-KV planning for decode and prefill: work items that fill the GPU's SMs evenly.

A work item is (request, qo tile, kv chunk), run once for every kv head: the grid has ``capacity *
num_kv_heads`` CTAs, as ``(capacity, num_kv_heads)`` or flattened to 1-D with the kv head fastest (the kernel
chooses how to read its block index: see decode.cuh and prefill_kernel.cuh). With GQA the
``group_size = num_qo_heads // num_kv_heads`` q heads of one kv head are packed into the rows of a qo tile:
packed row ``p`` of a request is its token ``p // group_size`` and q head ``kv_head * group_size + p %
group_size``; tile ``t`` covers packed rows
``[t * tile_rows, min((t + 1) * tile_rows, qo_len * group_size))``.

Every request is cut into ``num_chunks = ceil(kv_len / kv_chunk)`` chunks (one global ``kv_chunk``, so long
requests split more than short ones). An unsplit request's items write the output directly; a split
request's items write partial states that a merge combines (see ``SPLIT_KV_SCHEMA``).
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import NamedTuple

import numpy as np
import torch

from .host import PlanError, host_array
from .page_table import indptr_steps
from .plan import _ALIGN, Plan, PlanField, host_storage

SPLIT_KV_SCHEMA = {
    # per request (length max_batch_size [+ 1]); padded requests have qo_len = kv_len = num_chunks = 0
    "qo_indptr": "[max_batch_size + 1] token offsets of each request's queries (padded with the last value)",
    "kv_len": "[max_batch_size] KV length in tokens",
    "num_chunks": "[max_batch_size] kv chunks (items per qo tile) of the uniform split; 1 = unsplit; 0 = no queries "
                  "or padding; a tile split for the last wave (balance_tail) has its tokens' merge range instead",
    # per output token (length max_total_q + 1)
    "merge_indptr": "[max_total_q + 1] token t's partial rows are merge_indptr[t] .. merge_indptr[t + 1]; "
                    "an empty range means the token was written directly (or is padding)",
    # per work item (length capacity); padding items have request_idx = -1 and kv_start = kv_end = 0
    "request_idx": "[capacity] request of the item, -1 for a padding item (a no-op: writes nothing)",
    "qo_tile_idx": "[capacity] qo tile of the item within its request",
    "chunk_idx": "[capacity] chunk number of a split request (partial row = merge_indptr[token] + chunk_idx), "
                 "-1 when the request is unsplit (write out[qo_indptr[request] + token] directly)",
    "kv_start": "[capacity] first KV position (token index within the request) of the chunk",
    "kv_end": "[capacity] one past the last KV position; kv_end == kv_start on a real item means empty KV: "
              "write out = 0, lse = -inf",
}


class SplitKVInfo(NamedTuple):
    """Host-side sizes of a split-KV plan, for a grid of ``capacity * num_kv_heads`` CTAs.

    ``partial_capacity`` is the number of partial rows the tmp buffers must hold: ``tmp_o [partial_capacity,
    num_qo_heads, head_dim_vo]`` fp32 and ``tmp_lse [partial_capacity, num_qo_heads]`` fp32 (natural log).
    """

    batch_size: int
    max_batch_size: int
    total_q: int
    max_total_q: int
    num_items: int
    capacity: int
    num_qo_heads: int
    num_kv_heads: int
    group_size: int
    tile_rows: int
    kv_chunk: int
    partial_rows: int
    partial_capacity: int
    fixed_capacity: bool

    @property
    def grid(self) -> tuple[int, int]:
        return (self.capacity, self.num_kv_heads)


# ---------------------------------------------------------------------------------------------- heuristics


def default_tile_rows(max_packed_rows: int) -> int:
    """Packed q rows per tile: 16 (decode, one m16 mma tile), 64, or 128 for long prefill.

    >>> default_tile_rows(7), default_tile_rows(40), default_tile_rows(1000)
    (16, 64, 128)
    """
    return 16 if max_packed_rows <= 16 else 64 if max_packed_rows <= 64 else 128


def _split_candidates(max_len: int, work: int, num_kv_heads: int, num_sms: int, granularity: int) -> list[int]:
    # split counts of the longest request: 1, the balanced count s0 +- 2, and 2, 4, 8 x s0 (for batches
    # whose short items already fill waves, finer chunks of the long ones pack better)
    per_sm = work * num_kv_heads // num_sms
    s0 = -(-max_len // (per_sm if per_sm > granularity else granularity))
    splits = (1, s0 - 2, s0 - 1, s0, s0 + 1, s0 + 2, 2 * s0, 4 * s0, 8 * s0)
    chunks = {-(-max_len // s) for s in splits if s > 0}
    return sorted({-(-c // granularity) * granularity for c in chunks}, reverse=True)  # fewest splits first


def choose_kv_chunk(kv_lens: np.ndarray, qo_tiles: np.ndarray, num_kv_heads: int, *, num_sms: int = 132,
                    granularity: int = 16, item_overhead: int = 64, max_items: int | None = None) -> int:
    """Choose the KV chunk length (tokens, a multiple of ``granularity``) for a batch.

    ``kv_lens [batch]`` and ``qo_tiles [batch]`` (qo tiles per request) are int numpy arrays. Model: an item
    costs its KV length plus ``item_overhead`` tokens (launch, prologue, partial write and merge); CTAs run
    in waves of ``num_sms``; a schedule of items no longer than ``longest`` takes about
    ``waves * longest`` with ``waves = ceil(total_cost * num_kv_heads / (num_sms * longest))``. Candidates
    split the longest request 1 time, ``s0 - 2 .. s0 + 2`` and ``2, 4, 8 x s0`` times, where ``s0`` is the
    split count that makes its chunks as long as a perfectly balanced SM's share of the work. The chunk
    with the smallest estimate wins; ties (within 1 %) go to the longer chunk (fewer items, less merging).
    ``max_items`` caps the number of items (the fixed capacity of a CUDA-graph plan).

    Worked example (FA3's): 48 qo tiles of one request, 1 kv head, kv_len 4096, 108 SMs, overhead 64.
    A balanced SM's share is 48 * 4096 / 108 = 1820 tokens, so s0 = 3. Unsplit: 48 items, 1 wave of 4160.
    2 splits: chunk 2048, 96 items, 1 wave -> 2112 (96/108 = 0.89 of the SMs busy). 3 splits: chunk 1376,
    144 items, 2 waves -> 2880 (144/216 = 0.67). 4 splits: 2 waves of 1088 -> 2176. 2 splits win: 2048.
    A mixed decode batch (255 requests of 100 tokens, one of 8000, 8 kv heads, 132 SMs) gets chunk 1008:
    only the long request splits (8 chunks), and the estimate drops from 8064 (unsplit) to 3216.
    """
    return _choose(kv_lens, qo_tiles, num_kv_heads, num_sms, granularity, item_overhead, max_items)[0]


def _choose(kv_lens, qo_tiles, num_kv_heads, num_sms, granularity, item_overhead, max_items, max_len=None):
    # returns (kv_chunk, chunks per request as float64 or None when nothing splits, number of items);
    # chunks counts requests without queries too; qo_tiles None: one tile per request (decode), whose
    # caller may pass max_len = kv_lens.max()
    if max_len is None:
        max_len = int(np.maximum.reduce(kv_lens if qo_tiles is None else kv_lens * (qo_tiles > 0), initial=0))
    if max_len <= granularity:
        return granularity, None, int(kv_lens.size if qo_tiles is None else qo_tiles.sum())
    # chunk counts [candidate, batch] in float64 (exact for lengths < 2**40; SIMD, unlike integer division)
    if qo_tiles is None:  # decode: float64 lengths, one dtype per call (a mixed-dtype call is slow here)
        lens = kv_lens.astype(np.float64)
        work = int(np.add.reduce(lens))
    else:
        lens = np.maximum(kv_lens, 1, dtype=np.float64)  # an empty request has one chunk
        work = int(qo_tiles.astype(np.int64) @ kv_lens)  # int64 (int32 inputs pass 2**31 at long context)
    chunk = _split_candidates(max_len, work, num_kv_heads, num_sms, granularity)
    nchunks = lens / np.array(chunk, np.float64)[:, None]
    np.ceil(nchunks, out=nchunks)
    if qo_tiles is None:
        counted = np.add.reduce(nchunks, axis=1).tolist()
        # chunk[0] >= max_len counts the non-empty requests; an empty one still has a chunk
        empty = kv_lens.size - int(counted[0])
    else:
        counted, empty = (nchunks @ qo_tiles).tolist(), 0
    at, n = _pick(chunk, counted, empty, max_len, work, num_kv_heads, num_sms, item_overhead, max_items)
    counts = nchunks[at]
    return chunk[at], (np.maximum(counts, 1) if empty else counts), n


def _pick(chunk, counted, empty, max_len, work, num_kv_heads, num_sms, item_overhead, max_items):
    # (index, items) of the candidate chunk with the smallest estimate (see choose_kv_chunk); counted: items
    # of each candidate but `empty`
    best_at, best_n, bar = None, None, float("inf")
    total, per_item = work * num_kv_heads, item_overhead * num_kv_heads
    for at, c in enumerate(chunk):
        n = int(counted[at]) + empty
        if max_items is not None and n > max_items:
            continue
        longest = (c if c < max_len else max_len) + item_overhead
        estimate = -(-(total + per_item * n) // (num_sms * longest)) * longest
        if estimate < bar:  # ties (within 1 %) keep the longer chunk
            best_at, best_n, bar = at, n, estimate / 1.01
    if best_at is None:
        raise PlanError(f"capacity: {min(int(n) + empty for n in counted)} work items are needed even unsplit, "
                        f"more than the capacity of {max_items}")
    return best_at, best_n


# ---------------------------------------------------------------------------------------------- the last wave

# A CTA alone on an SM runs this much faster than one of two sharing it (the portable prefill at 4 x 4096, clock64
# stamps of session 12: 124 against 172 us): what a half-empty last wave still gets done
ALONE_SPEEDUP = 1.39


def _wave_time(pieces: int, work: float, slots: int) -> float:
    # pieces of `work` each started together on `slots` (two an SM): full rounds, then a last round that runs
    # at shared speed when it fills more than half the slots, else mostly alone
    rounds, left = divmod(pieces, slots)
    return rounds * work + (0.0 if left == 0 else work if 2 * left > slots else work / ALONE_SPEEDUP)


def choose_tail_split(item_len: float, num_items: int, num_kv_heads: int, *, num_sms: int, granularity: int,
                      item_overhead: int = 64, max_extra: int | None = None) -> tuple[int, int] | None:
    """``(m, k)``: split the ``m`` items the grid runs last into ``k`` KV chunks each, or None.

    For an unsplit plan of ``num_items`` items of about ``item_len`` KV tokens, run once for each kv head on
    ``num_sms`` slots (CTAs that run at once): the full waves leave ``r = num_items * num_kv_heads % num_sms``
    CTAs for a last wave that runs partly empty (the CTAs of a tile are its kv heads, so ``m = ceil(r /
    num_kv_heads)`` items). Splitting those items into ``k`` chunks (each paying ``2 * item_overhead`` tokens: its
    start and its partial's write and merge) spreads that wave over every slot. ``k`` minimises the wave's time
    (``_wave_time``); the split is taken when it saves at least 3 % of it and its chunks keep ``granularity``
    tokens. ``max_extra`` caps the items added (a fixed-capacity plan's spare slots).

    >>> choose_tail_split(4096, 512, 8, num_sms=264, granularity=64)  # 4 x 4096 tokens, 32 / 8 heads, d128
    (17, 5)
    >>> choose_tail_split(4096, 528, 8, num_sms=264, granularity=64) is None  # whole waves
    True
    """
    ctas = num_items * num_kv_heads
    if ctas <= num_sms or item_len < 2 * granularity:
        return None
    r = ctas % num_sms
    if r == 0:
        return None
    m = -(-r // num_kv_heads)
    work = item_len + item_overhead
    best, best_time = None, _wave_time(m * num_kv_heads, work, num_sms)
    for k in range(2, 9):
        if item_len / k < granularity or (max_extra is not None and m * (k - 1) > max_extra):
            break
        t = _wave_time(m * num_kv_heads * k, work / k + 2 * item_overhead, num_sms)
        if t < 0.97 * best_time:
            best, best_time = (m, k), t
    return best


def _split_tail(items: np.ndarray, m: int, k: int, granularity: int) -> tuple[np.ndarray, np.ndarray]:
    # items [5, n] in list order (the grid runs the list from its end): items 0 .. m - 1 become up to k chunks
    # each (chunk bounds on multiples of granularity past kv_start), listed first. Returns the new items and,
    # per split item, its chunk count.
    head = items[:, :m]
    length = head[4] - head[3]
    # the chunk length, a multiple of granularity, then as many chunks as it takes (none of them empty)
    step = -(-length // np.minimum(k, np.maximum(-(-length // granularity), 1)))
    step = np.maximum(-(-step // granularity) * granularity, granularity)
    counts = np.maximum(-(-length // step), 1)
    pieces = np.repeat(np.arange(m), counts)
    j = np.arange(pieces.size) - np.repeat(np.cumsum(counts) - counts, counts)
    c = counts[pieces]
    step = step[pieces]
    start = np.minimum(head[3][pieces] + j * step, head[4][pieces])
    end = np.where(j == c - 1, head[4][pieces], np.minimum(start + step, head[4][pieces]))
    split = np.stack([head[0][pieces], head[1][pieces], np.where(c > 1, j, -1), start, end])
    return np.concatenate([split, items[:, m:]], axis=1), counts


# ---------------------------------------------------------------------------------------------- builder


def _items(qo_len: np.ndarray, kv_lens: np.ndarray, chunks: np.ndarray, group_size: int, tile_rows: int,
           kv_chunk: int):
    tiles = -(-(qo_len * group_size) // tile_rows)
    per_request = (tiles * chunks).astype(np.int64, copy=False)
    ends = np.cumsum(per_request)  # int64 in, int64 out: a cumsum that casts int32 runs ~15x slower
    n = int(ends[-1]) if ends.size else 0
    items = np.empty((5, n), dtype=np.int64)
    request = items[0]
    request[:] = np.repeat(np.arange(qo_len.size), per_request)
    local = np.arange(n) - (ends - per_request)[request]
    c = chunks[request]
    np.floor_divide(local, c, out=items[1])
    chunk = local - items[1] * c
    np.multiply(chunk, kv_chunk, out=items[3])
    np.minimum(items[3] + kv_chunk, kv_lens[request], out=items[4])
    items[2] = np.where(c > 1, chunk, -1)
    return items


ITEM_FIELDS = ("request_idx", "qo_tile_idx", "chunk_idx", "kv_start", "kv_end")
_ITEM_PADS = np.array([-1, 0, 0, 0, 0])


def split_kv_arrays(qo_indptr: np.ndarray, kv_lens: np.ndarray, *, num_qo_heads: int, num_kv_heads: int,
                    tile_rows: int, kv_chunk: int, max_batch_size: int, max_total_q: int,
                    capacity: int | None, partial_capacity: int | None = None, chunks: np.ndarray | None = None,
                    tail: tuple[int, int] | None = None, granularity: int = 1):
    """The fields of ``SPLIT_KV_SCHEMA`` for ``Plan.pack`` and the ``SplitKVInfo``; internal.

    ``tail = (m, k)`` (``choose_tail_split``, an unsplit plan whose tiles hold whole tokens): the ``m`` items
    the grid runs last are split into up to ``k`` chunks of ``granularity`` multiples each.

    Vectorised numpy: a numpy call costs ~1-3 us on a small host, so a plan is a few dozen of them.
    """
    group_size = num_qo_heads // num_kv_heads
    if chunks is None:
        chunks = np.maximum((kv_lens + (kv_chunk - 1)) // kv_chunk, 1)
    qo_len = qo_indptr[1:] - qo_indptr[:-1]
    chunks = chunks * (qo_len > 0)
    items = _items(qo_len, kv_lens, chunks, group_size, tile_rows, kv_chunk)
    # longest items first: decode runs the list from its start (LPT); the prefill kernels run it from its end,
    # and listing it the other way round for them (longest started first) measured no better on mixed batches
    # (session 13: +3 % on 1 x 8192 + 31 x 256 without a mask, -2-10 % with causal, within noise elsewhere)
    items = items[:, np.argsort(items[3] - items[4], kind="stable")]
    total_q = int(qo_indptr[-1])
    # int64 like merge_indptr: np.cumsum of int32 into int64 casts in small buffers, ~2.5 ms at 270k tokens
    merge_count = np.repeat((chunks * (chunks > 1)).astype(np.int64, copy=False), qo_len)
    if tail is not None:
        if tile_rows % group_size or (items[2, :tail[0]] >= 0).any():
            raise ValueError("a tail split needs unsplit items of whole tokens (tile_rows a multiple of the group)")
        orig = items[:, :tail[0]]
        items, counts = _split_tail(items, *tail, granularity)
        # a split tile's tokens get its chunk count as their merge range (tiles hold whole tokens)
        tokens = tile_rows // group_size
        t0 = qo_indptr[orig[0]] + orig[1] * tokens
        n_tok = np.minimum(t0 + tokens, qo_indptr[orig[0] + 1]) - t0
        at = np.repeat(t0 - np.cumsum(n_tok) + n_tok, n_tok) + np.arange(int(n_tok.sum()))
        merge_count[at] = np.repeat(np.where(counts > 1, counts, 0), n_tok)
    num_items = items.shape[1]
    cap = num_items if capacity is None else capacity
    if num_items > cap:
        raise PlanError(f"capacity: the batch needs {num_items} work items, more than the capacity of {cap}")
    merge_indptr = np.empty(total_q + 1, dtype=np.int64)
    merge_indptr[0] = 0
    np.cumsum(merge_count, out=merge_indptr[1:])
    partial_rows = int(merge_indptr[-1])
    fields = {
        "qo_indptr": (qo_indptr, max_batch_size + 1, total_q),
        "kv_len": (kv_lens, max_batch_size, 0),
        "num_chunks": (chunks, max_batch_size, 0),
        "merge_indptr": (merge_indptr, max_total_q + 1, partial_rows),
        ITEM_FIELDS: (items, cap, _ITEM_PADS),
    }
    info = SplitKVInfo(
        batch_size=kv_lens.size, max_batch_size=max_batch_size, total_q=total_q, max_total_q=max_total_q,
        num_items=num_items, capacity=cap, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        group_size=group_size, tile_rows=tile_rows, kv_chunk=kv_chunk, partial_rows=partial_rows,
        partial_capacity=partial_rows if partial_capacity is None else partial_capacity,
        fixed_capacity=capacity is not None)
    return fields, info


def _check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise PlanError(f"num_qo_heads: {num_qo_heads} is not a positive multiple of num_kv_heads = {num_kv_heads}")


def _batch_inputs(qo_indptr: object, kv_lens: object) -> tuple[np.ndarray, np.ndarray]:
    return _checked_inputs(qo_indptr, kv_lens)[:2]


def _checked_inputs(qo_indptr: object, kv_lens: object):
    # (qo, lens, qo_len, longest query, longest KV): the checks and errors of validate_indptr and kv_lens >= 0,
    # with the query lengths and maxima they compute on the way (one pass each)
    qo, qo_len, longest_q = indptr_steps("qo_indptr", qo_indptr)
    lens = host_array("kv_lens", kv_lens)
    if lens.size != qo.size - 1:
        raise PlanError(f"kv_lens: has {lens.size} entries, expected batch_size = {qo.size - 1} (len(qo_indptr) - 1)")
    max_len = int(np.maximum.reduce(lens.view(_UNSIGNED[lens.itemsize]), initial=0))
    if max_len >= _MAX_KV_LEN and lens.min() < 0:  # a negative length is a huge unsigned one
        b = int(np.argmin(lens))
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected >= 0")
    return qo, lens, qo_len, longest_q, max_len


def plan_split_kv(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                  tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132,
                  item_overhead: int = 64, enable_split: bool = True, max_batch_size: int | None = None,
                  max_total_q: int | None = None, capacity: int | None = None,
                  host_buffer: torch.Tensor | None = None, balance_tail: bool = False,
                  split_min_waves: float | None = None) -> Plan:
    """Plan a batch of attention requests (prefill or decode) as split-KV work items.

    ``qo_indptr [batch + 1]`` and ``kv_lens [batch]`` are host integer arrays (numpy, lists or CPU
    tensors; a CUDA tensor is refused, never synchronised on). ``tile_rows``: packed q rows per CTA tile
    (default from ``default_tile_rows``); ``kv_granularity``: chunks are multiples of it (the kernel's KV
    tile, or the page size); ``num_sms``: SMs to fill. ``enable_split=False`` plans one chunk per request.
    ``balance_tail`` (a one-CTA-an-item grid that runs the list from its end, as the portable prefill does):
    where the plan is otherwise unsplit, the items of a partly empty last wave are split (``choose_tail_split``).
    ``split_min_waves`` (prefill; ``plan_prefill`` sets 2): no request is split where the batch's work fills the
    ``num_sms`` slots that many times over with its longest request's KV (``sum(qo_tiles * kv_lens) *
    num_kv_heads >= split_min_waves * num_sms * max(kv_lens)``): there the chunks' partial writes, merges and
    extra CTA starts cost more than the balance gains.

    Fixed-capacity mode (CUDA graphs): give ``max_batch_size`` (and for prefill ``max_total_q``, which
    defaults to ``max_batch_size``, i.e. decode) and optionally ``capacity`` (item slots). Every array then
    has a length that depends only on those maxima, the grid is ``capacity * num_kv_heads`` CTAs and items
    past the batch's own are no-ops (``request_idx = -1``, ``kv_start = kv_end = 0``), so one captured
    graph replays for any smaller batch. ``info.partial_capacity`` is then a batch-independent bound too.

    Returns a ``Plan`` of kind ``"split_kv"`` with fields ``SPLIT_KV_SCHEMA`` and a ``SplitKVInfo``.

    >>> plan = plan_split_kv([0, 1, 2], [100, 40000], num_qo_heads=8, num_kv_heads=8)
    >>> plan.info.kv_chunk, plan["num_chunks"].tolist()
    (2512, [1, 16])
    """
    _check_heads(num_qo_heads, num_kv_heads)
    small = _small_inputs(qo_indptr, kv_lens)
    if small is not None:
        qo_list, lens_list, qo_len_list, longest_q, max_len = small
        sizes = _sizes(len(lens_list), qo_list[-1], lambda: longest_q, num_qo_heads // num_kv_heads, num_kv_heads,
                       num_sms, tile_rows, max_batch_size, max_total_q, capacity)
        plan = _plan_small(qo_list, lens_list, qo_len_list, longest_q, max_len, num_qo_heads, num_kv_heads,
                           kv_granularity, num_sms, item_overhead, enable_split, *sizes, host_buffer, balance_tail,
                           split_min_waves)
        if plan is not None:
            return plan
    qo, lens, qo_len, longest_q, max_len = _checked_inputs(qo_indptr, kv_lens)
    sizes = _sizes(lens.size, int(qo[-1]), lambda: longest_q, num_qo_heads // num_kv_heads, num_kv_heads, num_sms,
                   tile_rows, max_batch_size, max_total_q, capacity)
    plan = _plan_fast(qo, lens, qo_len, longest_q, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms,
                      item_overhead, enable_split, *sizes, host_buffer, balance_tail, split_min_waves)
    if plan is None:  # lengths past the fast path's int32 / float64 bounds
        plan = _plan_general(qo, lens, qo_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead,
                             enable_split, *sizes, host_buffer, balance_tail, split_min_waves)
    return plan


def _sizes(batch, total_q, longest_q, group_size, num_kv_heads, num_sms, tile_rows, max_batch_size, max_total_q,
           capacity):
    # -> (max_batch_size, max_total_q, tile_rows, capacity, partial_capacity). longest_q(): the longest query
    # of a prefill batch, None for decode; called only when an exact plan must choose tile_rows
    fixed = max_batch_size is not None
    if fixed:
        max_total_q = max_batch_size if max_total_q is None else max_total_q
        if batch > max_batch_size:
            raise PlanError(f"qo_indptr: batch_size {batch} exceeds max_batch_size = {max_batch_size}")
        if total_q > max_total_q:
            raise PlanError(f"qo_indptr[-1] = {total_q} exceeds max_total_q = {max_total_q}")
        decode_shape = max_total_q == max_batch_size
    else:
        max_batch_size, max_total_q, decode_shape = batch, total_q, longest_q is None
    if tile_rows is None:
        longest = 1 if decode_shape else max_total_q if fixed else longest_q()
        tile_rows = default_tile_rows(longest * group_size)
    partial_capacity = None
    if fixed:
        min_items = -(-(max_total_q * group_size) // tile_rows) + max_batch_size
        capacity = min_items + 2 * -(-num_sms // num_kv_heads) if capacity is None else capacity
        partial_capacity = capacity * -(-tile_rows // group_size)
    return max_batch_size, max_total_q, tile_rows, capacity, partial_capacity


def _plan_general(qo, lens, qo_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead,
                  enable_split, max_batch_size, max_total_q, tile_rows, capacity, partial_capacity,
                  host_buffer, balance_tail=False, split_min_waves=None) -> Plan:
    group_size = num_qo_heads // num_kv_heads
    tiles = -(-(qo_len * group_size) // tile_rows)
    chunks, tail = None, None
    max_len = int(lens.max(initial=0))
    # a batch whose work fills the SMs split_min_waves times over with its longest request's KV is not split
    # (session 13, 1 x 8192 + 31 x 256 on the portable prefill, 8 such waves: unsplit ran 1.08x the 3-chunk
    # split without a mask and 1.17x with causal, whose chunks past the diagonal still start, write and merge)
    full = enable_split and split_min_waves is not None and int(tiles.astype(np.int64) @ lens) * num_kv_heads >= \
        split_min_waves * num_sms * max_len  # int64: tiles x tokens passes 2**31 at long context
    if enable_split and not full:
        kv_chunk, counts, num_items = _choose(lens, tiles, num_kv_heads, num_sms, kv_granularity, item_overhead,
                                              capacity)
        chunks = None if counts is None else counts.astype(np.int64)
    else:  # one chunk a request
        kv_chunk = max(kv_granularity, -(-max_len // kv_granularity) * kv_granularity)
        counts, num_items = None, int(tiles.sum())
    unsplit = counts is None or bool((counts <= 1).all())
    if enable_split and balance_tail and unsplit and tile_rows % group_size == 0 and num_items:
        # the tail items are the list's first, the longest (the grid runs them last): their length
        longest = int(lens[tiles > 0].max(initial=0))
        tail = choose_tail_split(longest, num_items, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                 item_overhead=item_overhead,
                                 max_extra=None if capacity is None else capacity - num_items)
    arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                   tile_rows=tile_rows, kv_chunk=kv_chunk, max_batch_size=max_batch_size,
                                   max_total_q=max_total_q, capacity=capacity, partial_capacity=partial_capacity,
                                   chunks=chunks, tail=tail, granularity=kv_granularity)
    return Plan.pack("split_kv", arrays, info, host_buffer)


# ---------------------------------------------------------------------------------------------- fast path
# ``_plan_general`` (``_choose``, ``split_kv_arrays``, ``Plan.pack``) in fewer numpy calls, int32 and straight
# into the host buffer, with no per-token temporaries but one ``np.repeat`` for a split batch's merge ranges
# (large temporaries are returned to the OS and page-faulted back on every call: ~2 us a page here). It equals
# ``_plan_general`` field for field (test_plan_paths.py, benchmarks/plan_identity.py); lengths past its bounds
# (int32 items and merge rows, exact float64 sums) go to ``_plan_general``.

_INT32_LIMIT = 2**31
_FLOAT_EXACT = 2**53


def _plan_fast(qo, lens, qo_len, longest_q, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms,
               item_overhead, enable_split, max_batch_size, max_total_q, tile_rows, capacity, partial_capacity,
               host_buffer, balance_tail=False, split_min_waves=None) -> Plan | None:
    batch = lens.size
    total_q = int(qo[-1])
    group_size = num_qo_heads // num_kv_heads
    max_tiles = -(-(longest_q * group_size) // tile_rows)
    tile_bound = -(-(total_q * group_size) // tile_rows) + batch  # >= the tiles of the batch
    if max_len >= _MAX_KV_LEN or longest_q * group_size >= _INT32_LIMIT or tile_bound * max_len >= _FLOAT_EXACT:
        return None
    if lens.itemsize == 8:  # int32 throughout: one dtype per numpy call (a mixed-dtype call is slow here)
        lens = lens.astype(np.int32)
    if qo_len.itemsize == 8:
        qo_len = qo_len.astype(np.int32)
    # qo tiles a request (an exact ceil for non-negative lengths)
    if tile_rows % group_size == 0:
        tokens = tile_rows // group_size
        tiles = qo_len if tokens == 1 else (qo_len + (tokens - 1)) // tokens
    else:
        tiles = (qo_len * group_size + (tile_rows - 1)) // tile_rows
    some_empty = np.count_nonzero(qo_len) < batch  # requests without queries (no tiles, no items)
    # the longest KV of a request with queries
    max_len_q = int(np.maximum.reduce(lens * (qo_len > 0), initial=0)) if some_empty else max_len
    tiles_f = tiles.astype(np.float64)
    counts = None
    if enable_split:
        work = int(tiles_f @ lens.astype(np.float64))  # exact: tile_bound * max_len < 2**53
    # see _plan_general
    full = enable_split and split_min_waves is not None and work * num_kv_heads >= \
        split_min_waves * num_sms * max_len
    if enable_split and not full and max_len_q > kv_granularity:  # _choose
        chunk = _split_candidates(max_len_q, work, num_kv_heads, num_sms, kv_granularity)
        # an empty request has one chunk
        nchunks = np.maximum(lens, 1, dtype=np.float64) / np.array(chunk, np.float64)[:, None]
        np.ceil(nchunks, out=nchunks)
        at, num_items = _pick(chunk, (nchunks @ tiles_f).tolist(), 0, max_len_q, work, num_kv_heads, num_sms,
                              item_overhead, capacity)
        kv_chunk = chunk[at]
        if max_len > kv_chunk:  # some request splits (one without queries counts too, as in _plan_general)
            counts = nchunks[at]
    elif enable_split and not full:
        kv_chunk, num_items = kv_granularity, int(np.add.reduce(tiles_f))
    else:  # one chunk a request
        kv_chunk = max(kv_granularity, -(-max_len // kv_granularity) * kv_granularity)
        num_items = int(np.add.reduce(tiles_f))
    if num_items >= _INT32_LIMIT or total_q * -(-max_len // kv_chunk) >= _INT32_LIMIT:  # items, merge rows
        return None
    tail = None
    if enable_split and balance_tail and counts is None and tile_rows % group_size == 0 and num_items:
        tail = choose_tail_split(max_len_q, num_items, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                 item_overhead=item_overhead,
                                 max_extra=None if capacity is None else capacity - num_items)

    # the items, longest first (see split_kv_arrays)
    one_tile = max_tiles <= 1  # every request with queries has one tile
    if counts is None:  # unsplit: a request's tiles in order, requests longest first (a stable sort)
        order = (-lens).argsort(kind="stable")
        n = num_items
        if one_tile and not some_empty:  # one item a request
            request, tile = order, 0
        else:
            t = tiles.take(order)
            request = order.repeat(t)
            tile = _iota(n) - (np.add.accumulate(t, dtype=np.int32) - t).repeat(t) if not one_tile else 0
        items = np.empty((5, n), dtype=np.int32)
        items[0] = request
        items[1] = tile
        items[2:4] = _UNSPLIT_FILL[1:]
        items[4] = lens.take(request)
        head = 0
        if tail is not None:
            pieces, counts_tail = _tail_pieces(items, *tail, kv_granularity)
            head = tail[0]
            num_items = pieces.shape[1] + n - head
    else:
        chunks = counts.astype(np.int32)
        if some_empty:
            chunks *= qo_len > 0
        items = _split_items(lens, tiles, chunks, kv_chunk, num_items, one_tile)
    cap = num_items if capacity is None else capacity
    if num_items > cap:
        raise PlanError(f"capacity: the batch needs {num_items} work items, more than the capacity of {cap}")

    schema, numel, (qo_at, kv_at, chunks_at, merge_at, items_at, stride) = _decode_schema(max_batch_size,
                                                                                          max_total_q, cap)
    host, flat = host_storage(numel, host_buffer)
    flat[qo_at: qo_at + batch + 1] = qo
    flat[kv_at: kv_at + batch] = lens
    out = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    merge = flat[merge_at: merge_at + max_total_q + 1]
    if counts is None:
        if some_empty:
            np.greater(qo_len, 0, out=flat[chunks_at: chunks_at + batch])
        else:
            flat[chunks_at: chunks_at + batch] = 1
        if tail is None:
            out[:, :n] = items
            merge[:] = 0
            partial_rows = 0
        else:
            p = pieces.shape[1]
            out[:, :p] = pieces
            out[:, p: p + n - head] = items[:, head:]
            partial_rows = _tail_merge(merge, qo, items[:, :head], counts_tail, tile_rows // group_size)
    else:
        flat[chunks_at: chunks_at + batch] = chunks
        out[:, :num_items] = items
        merge[0] = 0
        if total_q:
            np.add.accumulate((chunks * (chunks > 1)).repeat(qo_len), dtype=np.int32, out=merge[1: total_q + 1])
        partial_rows = int(merge[total_q])
        merge[total_q + 1:] = partial_rows
    return _finish_plan(schema, host, flat, out, (qo_at, kv_at, chunks_at), batch, max_batch_size, total_q,
                        max_total_q, num_items, cap, partial_rows, num_qo_heads, num_kv_heads, tile_rows, kv_chunk,
                        capacity, partial_capacity)


def _split_items(lens, tiles, chunks, kv_chunk, n, one_tile):
    # _items, longest first: [5, n] int32
    per = tiles * chunks
    ends = np.add.accumulate(per, dtype=np.int32)
    request = _iota(chunks.size).repeat(per)
    local = _iota(n) - (ends - per).repeat(per)
    c = chunks.take(request)
    items = np.empty((5, n), dtype=np.int32)
    items[0] = request
    if one_tile:
        items[1] = 0
        chunk = local
    else:
        chunk = items[2]
        np.divmod(local, c, out=(items[1], chunk))
    start = np.multiply(chunk, kv_chunk, out=items[3])
    np.minimum(start + kv_chunk, lens.take(request), out=items[4])
    np.subtract(chunk, c == 1, out=items[2])  # chunk_idx -1 for an unsplit request (its one chunk is 0)
    return items.take((start - items[4]).argsort(kind="stable"), axis=1)


_TAIL_J = np.arange(16, dtype=np.int32)


def _tail_pieces(items, m, k, granularity):
    # _split_tail of unsplit items (kv_start 0): items 0 .. m - 1 as up to k chunks each, [5, pieces] int32,
    # and the chunk count of each
    length = items[4, :m]
    per = np.maximum((length + (granularity - 1)) // granularity, 1)  # chunks of `granularity` tokens, <= k
    np.minimum(per, k, out=per)
    step = (length + (per - 1)) // per
    step = np.maximum((step + (granularity - 1)) // granularity * granularity, granularity)
    counts = np.maximum((length + (step - 1)) // step, 1)
    j = _TAIL_J[:k]
    keep = j < counts[:, None]  # [m, k]: chunk j of item i exists
    grid = np.empty((5, m, k), dtype=np.int32)
    grid[0] = items[0, :m, None]
    grid[1] = items[1, :m, None]
    grid[2] = np.where(counts[:, None] > 1, j, -1)
    np.multiply(j, step[:, None], out=grid[3])
    # chunk j < count - 1 ends at (j + 1) * step < length; the last at length
    np.minimum(grid[3] + step[:, None], length[:, None], out=grid[4])
    return grid[:, keep], counts


def _tail_merge(merge, qo, head, counts, tokens):
    # merge_indptr of an unsplit plan whose head items (whole-token tiles) were split into `counts` chunks:
    # their tokens' merge ranges, zero elsewhere. Returns partial_rows.
    t0 = qo.take(head[0]) + head[1] * tokens
    n_tok = np.minimum(t0 + tokens, qo.take(head[0] + 1)) - t0
    return _write_ramps(merge, sorted(r for r in zip(t0.tolist(), n_tok.tolist(), counts.tolist()) if r[2] > 1))


def _write_ramps(merge, ramps):
    # merge_indptr [max_total_q + 1] whose tokens have no partial rows but those of `ramps`, (first token, tokens,
    # partial rows a token) sorted and disjoint: 0 up to the first ramp, a cumsum over the span of the ramps, then
    # the total. Returns partial_rows.
    if not ramps:
        merge[:] = 0
        return 0
    first, end = ramps[0][0], ramps[-1][0] + ramps[-1][1]
    merge[: first + 1] = 0
    span = merge[first + 1: end + 1]
    span[:] = 0
    if len(ramps) <= 16:
        for t0, n, c in ramps:
            span[t0 - first: t0 - first + n] = c
    else:  # one scatter
        t0, n, c = (np.array(column, dtype=np.int64) for column in zip(*ramps))
        ends = np.add.accumulate(n)
        span[(t0 - first - ends + n).repeat(n) + _iota(int(ends[-1]))] = c.repeat(n)
    np.add.accumulate(span, dtype=np.int32, out=span)
    rows = int(span[-1])
    merge[end + 1:] = rows
    return rows


# ---------------------------------------------------------------------------------------------- small batches
# A batch of a few requests is planned on Python lists (``_plan_small``): a numpy call costs ~1.5 us on a small
# host, more than a Python loop over a dozen requests and a few hundred items. Same fields as ``_plan_fast``;
# chunk counts by integer ceil (float64's for lengths below 2**52, whose sums are exact too).

_SMALL_BATCH = 12
_SMALL_ITEMS = 40  # tiles: past ~40 items the numpy path wins (its cost barely grows with them)
_SMALL_SPLIT_ITEMS = 160  # items of a split batch, once its chunk is chosen (the numpy path would choose again)


def _small_inputs(qo_indptr: object, kv_lens: object):
    # (qo, lens, qo_len, longest query, longest KV) as lists for a small valid batch of host arrays, else None
    # (then _checked_inputs checks, raises, or takes it on)
    if isinstance(qo_indptr, (np.ndarray, torch.Tensor)) and qo_indptr.ndim == 1 and qo_indptr.shape[0] <= \
            _SMALL_BATCH + 1 and qo_indptr.shape[0] >= 1:
        qo = host_array("qo_indptr", qo_indptr).tolist()
        qo_len = [b - a for a, b in zip(qo, qo[1:])]
        if qo[0] != 0 or min(qo_len, default=0) < 0:  # qo_indptr's errors come first
            return None
        lens = host_array("kv_lens", kv_lens).tolist()
        if len(lens) == len(qo_len) and min(lens, default=0) >= 0:
            return qo, lens, qo_len, max(qo_len, default=0), max(lens, default=0)
    return None


def _plan_small(qo, lens, qo_len, longest_q, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms,
                item_overhead, enable_split, max_batch_size, max_total_q, tile_rows, capacity, partial_capacity,
                host_buffer, balance_tail=False, split_min_waves=None) -> Plan | None:
    # _plan_fast on lists; None where it does not apply (lengths past its bounds, too many items)
    batch = len(lens)
    total_q = qo[-1]
    group_size = num_qo_heads // num_kv_heads
    if max_len >= _MAX_KV_LEN or longest_q * group_size >= _INT32_LIMIT or total_q >= _INT32_LIMIT:
        return None
    tiles = [-(-(q * group_size) // tile_rows) for q in qo_len]
    if sum(tiles) > _SMALL_ITEMS:  # at least one item a tile
        return None
    some_empty = 0 in qo_len
    max_len_q = max([x for x, q in zip(lens, qo_len) if q], default=0) if some_empty else max_len
    counts = None
    if enable_split:
        work = sum([t * x for t, x in zip(tiles, lens)])
    full = enable_split and split_min_waves is not None and work * num_kv_heads >= \
        split_min_waves * num_sms * max_len
    if enable_split and not full and max_len_q > kv_granularity:  # _choose
        chunk = _split_candidates(max_len_q, work, num_kv_heads, num_sms, kv_granularity)
        weighted = [(t, -x or -1) for t, x in zip(tiles, lens) if t]  # an empty request has one chunk
        counted = [-sum([t * (y // c) for t, y in weighted]) for c in chunk]  # ceil(x / c) = -(-x // c)
        at, num_items = _pick(chunk, counted, 0, max_len_q, work, num_kv_heads, num_sms, item_overhead, capacity)
        kv_chunk = chunk[at]
        if max_len > kv_chunk:  # some request splits (see _plan_fast)
            counts = [-(-(x or 1) // kv_chunk) if q else 0 for x, q in zip(lens, qo_len)]
    elif enable_split and not full:
        kv_chunk, num_items = kv_granularity, sum(tiles)
    else:  # one chunk a request
        kv_chunk, num_items = max(kv_granularity, -(-max_len // kv_granularity) * kv_granularity), sum(tiles)
    if num_items > _SMALL_SPLIT_ITEMS or total_q * -(-max_len // kv_chunk) >= _INT32_LIMIT:
        return None
    tail = None
    if enable_split and balance_tail and counts is None and tile_rows % group_size == 0 and num_items:
        tail = choose_tail_split(max_len_q, num_items, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                 item_overhead=item_overhead,
                                 max_extra=None if capacity is None else capacity - num_items)

    # the items (request, qo tile, chunk_idx, kv_start, kv_end), longest first (see split_kv_arrays)
    splits = None
    if counts is None:  # a request's tiles in order, requests longest first (a stable sort)
        order = sorted(range(batch), key=lens.__getitem__, reverse=True)  # reverse=True keeps ties in order
        rows = [(r, t, -1, 0, lens[r]) for r in order for t in range(tiles[r])]
        if tail is not None:
            m, k = tail
            pieces, splits = [], []
            for r, t, _, _, length in rows[:m]:  # _tail_pieces
                per = min(max(-(-length // kv_granularity), 1), k)
                step = -(-length // per)
                step = max(-(-step // kv_granularity) * kv_granularity, kv_granularity)
                c = max(-(-length // step), 1)
                splits.append((r, t, c))
                if c == 1:
                    pieces.append((r, t, -1, 0, length))
                else:  # chunk j < c - 1 ends at (j + 1) * step < length
                    pieces += [(r, t, j, j * step, (j + 1) * step) for j in range(c - 1)]
                    pieces.append((r, t, c - 1, (c - 1) * step, length))
            rows[:m] = pieces
            num_items = len(rows)
    else:
        rows = []
        for r, (x, c) in enumerate(zip(lens, counts)):
            if c == 1:  # unsplit: x <= kv_chunk
                rows += [(-x, r, t, -1, 0, x) for t in range(tiles[r])]
            elif c:  # chunk j < c - 1 ends at (j + 1) * kv_chunk < x
                last = (c - 1) * kv_chunk
                rows += [(-kv_chunk, r, t, j, j * kv_chunk, (j + 1) * kv_chunk) if j < c - 1
                         else (last - x, r, t, j, last, x) for t in range(tiles[r]) for j in range(c)]
        rows.sort(key=_first_key)  # stable: longest first, ties in list order
        rows = [row[1:] for row in rows]
    cap = num_items if capacity is None else capacity
    if num_items > cap:
        raise PlanError(f"capacity: the batch needs {num_items} work items, more than the capacity of {cap}")

    schema, numel, (qo_at, kv_at, chunks_at, merge_at, items_at, stride) = _decode_schema(max_batch_size,
                                                                                          max_total_q, cap)
    host, flat = host_storage(numel, host_buffer)
    flat[qo_at: qo_at + batch + 1] = qo
    flat[kv_at: kv_at + batch] = lens
    if counts is None:
        flat[chunks_at: chunks_at + batch] = [1 if q else 0 for q in qo_len] if some_empty else 1
    else:
        flat[chunks_at: chunks_at + batch] = counts
    out = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    if num_items:
        out[0, :num_items], out[1, :num_items], out[2, :num_items], out[3, :num_items], out[4, :num_items] = \
            zip(*rows)
    # merge_indptr: the partial rows before each token, rising by c over the tokens of a tile split c ways
    if counts is not None:
        ramps = [(qo[r], q, c) for r, (q, c) in enumerate(zip(qo_len, counts)) if c > 1 and q]
    elif splits is not None:  # a split tail tile's tokens (tiles hold whole tokens)
        tokens = tile_rows // group_size
        ramps = sorted((qo[r] + t * tokens, min(qo[r] + (t + 1) * tokens, qo[r + 1]) - qo[r] - t * tokens, c)
                       for r, t, c in splits if c > 1)
    else:
        ramps = ()
    partial_rows = _write_ramps(flat[merge_at: merge_at + max_total_q + 1], ramps)
    return _finish_plan(schema, host, flat, out, (qo_at, kv_at, chunks_at), batch, max_batch_size, total_q,
                        max_total_q, num_items, cap, partial_rows, num_qo_heads, num_kv_heads, tile_rows, kv_chunk,
                        capacity, partial_capacity)


# ---------------------------------------------------------------------------------------------- decode fast path
# Decode with one qo tile per request (group_size <= tile_rows) is the hot call: it writes the fields straight
# into the int32 host buffer with about 30 numpy calls and no per-token arrays. It equals the general path
# (``plan_split_kv(arange(batch + 1), kv_lens)``) field for field, item order included (test_plan_fast.py).

_IOTA = np.arange(4096, dtype=np.int32)
_IOTA.flags.writeable = False
_UNSPLIT_FILL = np.array([[0], [-1], [0]], dtype=np.int32)  # qo_tile_idx, chunk_idx, kv_start of unsplit items
_ITEM_PAD_COLUMN = _ITEM_PADS.reshape(-1, 1)
_UNSIGNED = {4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_MAX_KV_LEN = 2**30  # kv_start + kv_chunk stays an int32


def _iota(n: int) -> np.ndarray:
    global _IOTA
    if _IOTA.size < n:
        _IOTA = np.arange(max(n, 2 * _IOTA.size), dtype=np.int32)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


_FIELD_NAMES = ("qo_indptr", "kv_len", "num_chunks", "merge_indptr", *ITEM_FIELDS)
_new_field = functools.partial(tuple.__new__, PlanField)  # PlanField(...) without its Python-level __new__


@functools.lru_cache(maxsize=64)
def _decode_schema(max_batch_size: int, max_total_q: int, capacity: int):
    # (schema, numel, offsets of qo_indptr, kv_len, num_chunks, merge_indptr, the item block, item row stride):
    # schema_for's layout of SPLIT_KV_SCHEMA (fields 4-aligned, in order), built directly (a plan of a new
    # batch size misses the cache: 3 us instead of 6.5)
    per_request = -(-max_batch_size // _ALIGN) * _ALIGN
    kv_at = -(-(max_batch_size + 1) // _ALIGN) * _ALIGN
    chunks_at = kv_at + per_request
    merge_at = chunks_at + per_request
    items_at = merge_at + -(-(max_total_q + 1) // _ALIGN) * _ALIGN
    stride = -(-capacity // _ALIGN) * _ALIGN
    offsets = (0, kv_at, chunks_at, merge_at, items_at, items_at + stride, items_at + 2 * stride, items_at + 3 * stride,
               items_at + 4 * stride)
    lengths = (max_batch_size + 1, max_batch_size, max_batch_size, max_total_q + 1, *(capacity,) * 5)
    schema = {name: _new_field((name, offset, length)) for name, offset, length in zip(_FIELD_NAMES, offsets, lengths)}
    return schema, items_at + 5 * stride, (0, kv_at, chunks_at, merge_at, items_at, stride)


def _plan_decode(lens, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead, enable_split,
                 max_batch_size, max_total_q, tile_rows, capacity, partial_capacity, host_buffer) -> Plan:
    batch = lens.size
    if enable_split:
        kv_chunk, counts, n = _choose(lens, None, num_kv_heads, num_sms, kv_granularity, item_overhead, capacity,
                                      max_len)
    else:
        kv_chunk, counts, n = max(kv_granularity, -(-max_len // kv_granularity) * kv_granularity), None, batch
    cap = n if capacity is None else capacity
    if n > cap:
        raise PlanError(f"capacity: the batch needs {n} work items, more than the capacity of {cap}")
    schema, numel, (qo_at, kv_at, chunks_at, merge_at, items_at, stride) = _decode_schema(max_batch_size,
                                                                                          max_total_q, cap)
    host, flat = host_storage(numel, host_buffer)
    flat[qo_at: qo_at + batch + 1] = _iota(batch + 1)
    kv = flat[kv_at: kv_at + batch]
    kv[:] = lens
    chunks = flat[chunks_at: chunks_at + batch]
    chunks[:] = 1 if counts is None else counts
    items = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    flat[merge_at] = 0
    if n == batch:  # nothing split: one item per request, longest first
        order = (-kv).argsort(kind="stable")
        items[0, :n] = order
        items[1:4, :n] = _UNSPLIT_FILL
        kv.take(order, out=items[4, :n], mode="clip")
        partial_rows, merged = 0, 0  # no token has partial rows
    else:
        _split_decode_items(kv, chunks, kv_chunk, n, items, flat[merge_at + 1: merge_at + batch + 1])
        partial_rows, merged = int(flat[merge_at + batch]), batch
    flat[merge_at + merged + 1: merge_at + max_total_q + 1] = partial_rows  # past the requests written
    return _finish_plan(schema, host, flat, items, (qo_at, kv_at, chunks_at), batch, max_batch_size, batch,
                        max_total_q, n, cap, partial_rows, num_qo_heads, num_kv_heads, tile_rows, kv_chunk, capacity,
                        partial_capacity)


def _finish_plan(schema, host, flat, items, offsets, batch, max_batch_size, total_q, max_total_q, n, cap,
                 partial_rows, num_qo_heads, num_kv_heads, tile_rows, kv_chunk, capacity, partial_capacity) -> Plan:
    # the end of the fast paths (prefill numpy and lists, decode numpy and lists): fixed-capacity padding of the
    # per-request fields and of the items past n, then the plan and its info (merge ranges: the caller's)
    qo_at, kv_at, chunks_at = offsets
    if max_batch_size > batch:  # fixed capacity: pad the per-request fields
        flat[qo_at + batch + 1: qo_at + max_batch_size + 1] = total_q
        flat[kv_at + batch: kv_at + max_batch_size] = 0
        flat[chunks_at + batch: chunks_at + max_batch_size] = 0
    if cap > n:
        items[:, n:cap] = _ITEM_PAD_COLUMN
    info = SplitKVInfo(batch, max_batch_size, total_q, max_total_q, n, cap, num_qo_heads, num_kv_heads,
                       num_qo_heads // num_kv_heads, tile_rows, kv_chunk, partial_rows,
                       partial_rows if partial_capacity is None else partial_capacity, capacity is not None)
    return Plan("split_kv", schema, host, info)


# A small batch is planned on Python lists: a numpy call costs ~1.5 us here, a Python loop over a few dozen
# requests and items less than the dozens of calls it replaces.
_SMALL_DECODE = 24


def _plan_decode_small(lens, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead,
                       enable_split, max_batch_size, max_total_q, tile_rows, capacity, partial_capacity,
                       host_buffer) -> Plan:
    # _plan_decode on a list of lengths, same fields. Chunk counts by integer ceil: float64's (``_choose``) for
    # lengths below 2**52, and sums of them are exact in float64 too
    batch = len(lens)
    counts = None
    if not enable_split:
        kv_chunk, n = max(kv_granularity, -(-max_len // kv_granularity) * kv_granularity), batch
    elif max_len <= kv_granularity:
        kv_chunk, n = kv_granularity, batch
    else:
        work = sum(lens)
        chunk = _split_candidates(max_len, work, num_kv_heads, num_sms, kv_granularity)
        negative = [-x for x in lens]  # ceil(x / c) = -(-x // c)
        counted = [-sum([y // c for y in negative]) for c in chunk]
        at, n = _pick(chunk, counted, batch - counted[0], max_len, work, num_kv_heads, num_sms, item_overhead,
                      capacity)
        kv_chunk = chunk[at]
        if n > batch:
            counts = [-(-x // kv_chunk) or 1 for x in lens]  # an empty request has one chunk
    cap = n if capacity is None else capacity
    if n > cap:
        raise PlanError(f"capacity: the batch needs {n} work items, more than the capacity of {cap}")
    schema, numel, (qo_at, kv_at, chunks_at, merge_at, items_at, stride) = _decode_schema(max_batch_size,
                                                                                          max_total_q, cap)
    host, flat = host_storage(numel, host_buffer)
    flat[qo_at: qo_at + batch + 1] = _iota(batch + 1)
    flat[kv_at: kv_at + batch] = lens
    items = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    flat[merge_at] = 0
    if counts is None:  # nothing split: one item per request, longest first
        flat[chunks_at: chunks_at + batch] = 1
        order = sorted(range(batch), key=lens.__getitem__, reverse=True)  # stable, as reverse=True keeps ties
        items[0, :n] = order  # row by row: numpy takes a 1-D list faster than a 2-D one
        items[1:4, :n] = _UNSPLIT_FILL
        items[4, :n] = [lens[r] for r in order]
        partial_rows, merged = 0, 0  # no token has partial rows
    elif n > _SMALL_ITEMS:  # the numpy path's items (and merge ranges)
        chunks = flat[chunks_at: chunks_at + batch]
        chunks[:] = counts
        _split_decode_items(flat[kv_at: kv_at + batch], chunks, kv_chunk, n, items,
                            flat[merge_at + 1: merge_at + batch + 1])
        partial_rows, merged = int(flat[merge_at + batch]), batch
    else:
        flat[chunks_at: chunks_at + batch] = counts
        rows = []  # (start - end, request, chunk_idx, start, end) in (request, chunk) order
        for r, (x, c) in enumerate(zip(lens, counts)):
            if c == 1:  # unsplit: x <= kv_chunk
                rows.append((-x, r, -1, 0, x))
            else:  # chunk j < c - 1 ends at (j + 1) * kv_chunk < x
                rows += [(-kv_chunk, r, j, j * kv_chunk, (j + 1) * kv_chunk) for j in range(c - 1)]
                start = (c - 1) * kv_chunk
                rows.append((start - x, r, c - 1, start, x))
        rows.sort(key=_first_key)  # stable: longest first, ties in list order
        _, items[0, :n], items[2, :n], items[3, :n], items[4, :n] = zip(*rows)
        items[1, :n] = 0
        flat[merge_at + 1: merge_at + batch + 1] = list(itertools.accumulate([c if c > 1 else 0 for c in counts]))
        partial_rows, merged = int(flat[merge_at + batch]), batch
    flat[merge_at + merged + 1: merge_at + max_total_q + 1] = partial_rows  # past the requests written
    return _finish_plan(schema, host, flat, items, (qo_at, kv_at, chunks_at), batch, max_batch_size, batch,
                        max_total_q, n, cap, partial_rows, num_qo_heads, num_kv_heads, tile_rows, kv_chunk, capacity,
                        partial_capacity)


_first_key = operator.itemgetter(0)


def _split_decode_items(kv: np.ndarray, chunks: np.ndarray, kv_chunk: int, n: int, out: np.ndarray,
                        merge: np.ndarray) -> None:
    # items in (request, chunk) order, stably sorted longest first into out[:, :n]; merge = merge_indptr[1:].
    # int32 throughout (kv lengths < 2**30, checked by plan_decode), one dtype per call
    ends = np.add.accumulate(chunks, dtype=np.int32)
    partial = chunks * (chunks > 1)  # partial rows of each request
    np.add.accumulate(partial, dtype=np.int32, out=merge)
    items = np.zeros((5, n), dtype=np.int32)  # request_idx, qo_tile_idx (0), chunk_idx, kv_start, kv_end
    request = _iota(chunks.size).repeat(chunks)
    items[0] = request
    # an unsplit request's first item is itself: its chunk_idx 0 - 1 = -1, and kv_start max(-1, 0) = 0
    chunk = np.subtract(_iota(n), (ends - partial).repeat(chunks), out=items[2])
    start = np.maximum(chunk, 0, out=items[3])
    np.multiply(start, kv_chunk, out=start)
    end = np.minimum(start + kv_chunk, kv.take(request), out=items[4])
    items.take((start - end).argsort(kind="stable"), axis=1, out=out[:, :n], mode="clip")


def plan_decode(kv_lens: object, *, num_qo_heads: int, num_kv_heads: int, tile_rows: int | None = None,
                kv_granularity: int = 16, num_sms: int = 132, item_overhead: int = 64, enable_split: bool = True,
                max_batch_size: int | None = None, max_total_q: int | None = None, capacity: int | None = None,
                host_buffer: torch.Tensor | None = None) -> Plan:
    """Split-KV plan for decode: one query token per request. ``kv_lens [batch]`` host ints.

    Options as for ``plan_split_kv`` (``max_batch_size`` for a CUDA-graph plan). The hot call of a decode
    step: pass a reused (pinned) ``host_buffer``, or each call allocates one.

    >>> plan_decode([300, 9000, 12], num_qo_heads=32, num_kv_heads=8).info.grid[1]
    8
    """
    _check_heads(num_qo_heads, num_kv_heads)
    lens = host_array("kv_lens", kv_lens)
    batch = lens.size
    if batch <= _SMALL_DECODE:
        values = lens.tolist()
        max_len = max(values, default=0)
        if batch and min(values) < 0:
            max_len = _MAX_KV_LEN
    else:  # one pass for the check and the longest request: a negative length is a huge unsigned one
        max_len = int(np.maximum.reduce(lens.view(_UNSIGNED[lens.itemsize]), initial=0))
    if max_len >= _MAX_KV_LEN:
        b = int(np.argmin(lens))
        if lens[b] < 0:
            raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected >= 0")
        b = int(np.argmax(lens))
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected < 2**30 (plans hold int32 positions)")
    group_size = num_qo_heads // num_kv_heads
    sizes = _sizes(batch, batch, None, group_size, num_kv_heads, num_sms, tile_rows, max_batch_size, max_total_q,
                   capacity)
    if group_size <= sizes[2] and batch <= _SMALL_DECODE:
        return _plan_decode_small(values, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms,
                                  item_overhead, enable_split, *sizes, host_buffer)
    if group_size <= sizes[2]:  # one qo tile per request
        return _plan_decode(lens, max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead,
                            enable_split, *sizes, host_buffer)
    qo, qo_len = _iota(batch + 1), _iota(batch + 1)[1:] - _iota(batch)
    plan = _plan_fast(qo, lens, qo_len, min(batch, 1), max_len, num_qo_heads, num_kv_heads, kv_granularity, num_sms,
                      item_overhead, enable_split, *sizes, host_buffer)
    if plan is None:
        plan = _plan_general(qo, lens, np.ones(batch, np.int64), num_qo_heads, num_kv_heads, kv_granularity, num_sms,
                             item_overhead, enable_split, *sizes, host_buffer)
    return plan


def plan_prefill(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                 **options) -> Plan:
    """Split-KV plan for prefill / append: ``qo_indptr [batch + 1]``, ``kv_lens [batch]`` host ints. Requests
    are split only where the batch cannot fill the SMs twice over with its longest request's KV
    (``split_min_waves=2``, see ``plan_split_kv``).

    >>> plan_prefill([0, 100, 101], [100, 5000], num_qo_heads=4, num_kv_heads=4).info.tile_rows
    128
    """
    options.setdefault("split_min_waves", 2.0)
    return plan_split_kv(qo_indptr, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, **options)
