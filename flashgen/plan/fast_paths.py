"""The planner's numpy fast paths: ``split_kv._plan_general`` (the reference) in fewer numpy calls.

``plan_numpy`` (prefill, and decode whose GQA group spans tiles) and ``plan_decode_numpy`` (decode, one qo tile
a request: the hot call of a decode step) write int32 fields straight into the host buffer, with no per-token
temporaries but one ``np.repeat`` for a split batch's merge ranges (large temporaries are returned to the OS
and page-faulted back on every call: ~2 us a page on a small host). A numpy call costs ~1-3 us there, so a
plan is a few dozen of them. Both equal the reference field for field, item order included
(tests/plan/test_plan_paths.py, tests/plan/test_plan_fast.py, tests/tools/plan_identity.py); lengths past their bounds
(int32 items and merge rows, exact float64 sums) make ``plan_numpy`` return None, for the reference to plan.
"""

from __future__ import annotations

import functools

import numpy as np

from .heuristics import choose_split, fills_waves, pick_chunk
from .host import PlanError
from .plan import _ALIGN, Plan, PlanField, host_storage
from .request import BATCH, ITEM_FIELDS, ITEM_PADS, OPTIONS, SIZES, PlanRequest, new_info

INT32_LIMIT = 2**31
FLOAT_EXACT = 2**53
MAX_KV_LEN = 2**30  # kv_start + kv_chunk stays an int32

_IOTA = np.arange(4096, dtype=np.int32)
_IOTA.flags.writeable = False
UNSPLIT_FILL = np.array([[0], [-1], [0]], dtype=np.int32)  # qo_tile_idx, chunk_idx, kv_start of unsplit items
_ITEM_PAD_COLUMN = ITEM_PADS.reshape(-1, 1)
_TAIL_J = np.arange(16, dtype=np.int32)


def iota(n: int) -> np.ndarray:
    """``arange(n)`` as int32, a read-only view of a shared array."""
    global _IOTA
    if _IOTA.size < n:
        _IOTA = np.arange(max(n, 2 * _IOTA.size), dtype=np.int32)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


# ---------------------------------------------------------------------------------------------- prefill


def plan_numpy(req: PlanRequest) -> Plan | None:
    """The plan of ``req`` (numpy arrays), or None where lengths pass the int32 / float64 bounds."""
    qo, lens, qo_len, longest_q, max_len = req[BATCH]
    group_size, tile_rows = req.num_qo_heads // req.num_kv_heads, req.tile_rows
    batch = lens.size
    total_q = int(qo[-1])
    tile_bound = -(-(total_q * group_size) // tile_rows) + batch  # >= the tiles of the batch
    if max_len >= MAX_KV_LEN or longest_q * group_size >= INT32_LIMIT or tile_bound * max_len >= FLOAT_EXACT:
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
    kv_chunk, counts, num_items = _numpy_chunk(req, lens, tiles_f, max_len_q)
    if num_items >= INT32_LIMIT or total_q * -(-max_len // kv_chunk) >= INT32_LIMIT:  # items, merge rows
        return None
    one_tile = -(-(longest_q * group_size) // tile_rows) <= 1  # every request with queries has one tile
    if counts is not None:
        chunks = counts.astype(np.int32)
        if some_empty:
            chunks *= qo_len > 0
        items = _split_items(lens, tiles, chunks, kv_chunk, num_items, one_tile)
        return _write_split(req, qo, lens, qo_len, total_q, chunks, items, kv_chunk)
    tail = tail_split(req, num_items, max_len_q)
    items = _unsplit_items(lens, tiles, num_items, one_tile and not some_empty, one_tile)
    return _write_unsplit(req, qo, lens, qo_len, total_q, some_empty, items, tail, kv_chunk)


def _numpy_chunk(req: PlanRequest, lens: np.ndarray, tiles_f: np.ndarray, max_len_q: int):
    # (kv_chunk, chunks per request as float64 or None when nothing splits, items): heuristics.choose_split on
    # int32 lengths, with float64 sums (exact below FLOAT_EXACT)
    _, num_kv_heads, g, num_sms, item_overhead, enable_split, _, split_min_waves, policy, _ = req[OPTIONS]
    max_len = req.max_len
    if enable_split:
        work = int(tiles_f @ lens.astype(np.float64))
        if not fills_waves(work, num_kv_heads, num_sms, max_len, split_min_waves):
            if max_len_q <= g:
                return g, None, int(np.add.reduce(tiles_f))
            chunk = policy.candidates(max_len_q, work, num_kv_heads, num_sms, g)
            # an empty request has one chunk
            nchunks = np.maximum(lens, 1, dtype=np.float64) / np.array(chunk, np.float64)[:, None]
            np.ceil(nchunks, out=nchunks)
            at, n = pick_chunk(chunk, (nchunks @ tiles_f).tolist(), 0, max_len_q, work, num_kv_heads, num_sms,
                               item_overhead, req.capacity)
            # some request splits (one without queries counts too, as in _plan_general)
            return chunk[at], (nchunks[at] if max_len > chunk[at] else None), n
    return max(g, -(-max_len // g) * g), None, int(np.add.reduce(tiles_f))  # one chunk a request


def tail_split(req: PlanRequest, num_items: int, item_len: int) -> tuple[int, int] | None:
    """The policy's last-wave split of an unsplit plan of ``num_items`` items (``balance_tail``), or None."""
    if not (req.enable_split and req.balance_tail and num_items and
            req.tile_rows % (req.num_qo_heads // req.num_kv_heads) == 0):
        return None
    capacity = req.capacity
    return req.policy.tail_split(item_len, num_items, req.num_kv_heads, num_sms=req.num_sms,
                                 granularity=req.kv_granularity, item_overhead=req.item_overhead,
                                 max_extra=None if capacity is None else capacity - num_items)


def _unsplit_items(lens, tiles, n, one_item_a_request, one_tile):
    # a request's tiles in order, requests longest first (a stable sort): [5, n] int32
    order = (-lens).argsort(kind="stable")
    if one_item_a_request:
        request, tile = order, 0
    else:
        t = tiles.take(order)
        request = order.repeat(t)
        tile = iota(n) - (np.add.accumulate(t, dtype=np.int32) - t).repeat(t) if not one_tile else 0
    items = np.empty((5, n), dtype=np.int32)
    items[0] = request
    items[1] = tile
    items[2:4] = UNSPLIT_FILL[1:]
    items[4] = lens.take(request)
    return items


def _split_items(lens, tiles, chunks, kv_chunk, n, one_tile):
    # split_kv._items, longest first: [5, n] int32
    per = tiles * chunks
    ends = np.add.accumulate(per, dtype=np.int32)
    request = iota(chunks.size).repeat(per)
    local = iota(n) - (ends - per).repeat(per)
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


def _write_split(req, qo, lens, qo_len, total_q, chunks, items, kv_chunk):
    num_items = items.shape[1]
    cap, schema, host, flat, offsets = storage(req, num_items)
    qo_at, kv_at, chunks_at, merge_at, items_at, stride = offsets
    batch = lens.size
    flat[qo_at: qo_at + batch + 1] = qo
    flat[kv_at: kv_at + batch] = lens
    flat[chunks_at: chunks_at + batch] = chunks
    out = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    out[:, :num_items] = items
    merge = flat[merge_at: merge_at + req.max_total_q + 1]
    merge[0] = 0
    if total_q:
        np.add.accumulate((chunks * (chunks > 1)).repeat(qo_len), dtype=np.int32, out=merge[1: total_q + 1])
    partial_rows = int(merge[total_q])
    merge[total_q + 1:] = partial_rows
    return finish_plan(req, schema, host, flat, offsets, out, batch, total_q, num_items, cap, partial_rows,
                       kv_chunk)


def _write_unsplit(req, qo, lens, qo_len, total_q, some_empty, items, tail, kv_chunk):
    n = items.shape[1]
    head, num_items = 0, n
    if tail is not None:
        pieces, counts = _tail_pieces(items, *tail, req.kv_granularity)
        head = tail[0]
        num_items = pieces.shape[1] + n - head
    cap, schema, host, flat, offsets = storage(req, num_items)
    qo_at, kv_at, chunks_at, merge_at, items_at, stride = offsets
    batch = lens.size
    flat[qo_at: qo_at + batch + 1] = qo
    flat[kv_at: kv_at + batch] = lens
    if some_empty:
        np.greater(qo_len, 0, out=flat[chunks_at: chunks_at + batch])
    else:
        flat[chunks_at: chunks_at + batch] = 1
    out = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    merge = flat[merge_at: merge_at + req.max_total_q + 1]
    if tail is None:
        out[:, :n] = items
        merge[:] = 0
        partial_rows = 0
    else:
        p = pieces.shape[1]
        out[:, :p] = pieces
        out[:, p: p + n - head] = items[:, head:]
        tokens = req.tile_rows // (req.num_qo_heads // req.num_kv_heads)
        partial_rows = _tail_merge(merge, qo, items[:, :head], counts, tokens)
    return finish_plan(req, schema, host, flat, offsets, out, batch, total_q, num_items, cap, partial_rows,
                       kv_chunk)


def _tail_pieces(items, m, k, granularity):
    # split_kv._split_tail of unsplit items (kv_start 0): items 0 .. m - 1 as up to k chunks each, [5, pieces]
    # int32, and the chunk count of each
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
    return write_ramps(merge, sorted(r for r in zip(t0.tolist(), n_tok.tolist(), counts.tolist()) if r[2] > 1))


def write_ramps(merge: np.ndarray, ramps) -> int:
    """Fill ``merge`` (merge_indptr [max_total_q + 1]) for tokens without partial rows but those of ``ramps``,
    ``(first token, tokens, partial rows a token)`` sorted and disjoint: 0 up to the first ramp, a cumsum over
    the span of the ramps, then the total. Returns partial_rows."""
    if not ramps:
        merge[:] = 0
        return 0
    first, end = ramps[0][0], ramps[-1][0] + ramps[-1][1]
    merge[: first + 1] = 0
    if len(ramps) == 1:  # one split tile or request (a small batch): c, 2c, ... over its tokens
        c = ramps[0][2]
        rows = (end - first) * c
        np.multiply(iota(end - first + 1)[1:], c, out=merge[first + 1: end + 1])
        merge[end + 1:] = rows
        return rows
    span = merge[first + 1: end + 1]
    span[:] = 0
    if len(ramps) <= 16:
        for t0, n, c in ramps:
            span[t0 - first: t0 - first + n] = c
    else:  # one scatter
        t0, n, c = (np.array(column, dtype=np.int64) for column in zip(*ramps))
        ends = np.add.accumulate(n)
        span[(t0 - first - ends + n).repeat(n) + iota(int(ends[-1]))] = c.repeat(n)
    np.add.accumulate(span, dtype=np.int32, out=span)
    rows = int(span[-1])
    merge[end + 1:] = rows
    return rows


# ---------------------------------------------------------------------------------------------- the host buffer

_FIELD_NAMES = ("qo_indptr", "kv_len", "num_chunks", "merge_indptr", *ITEM_FIELDS)
_new_field = functools.partial(tuple.__new__, PlanField)  # PlanField(...) without its Python-level __new__


@functools.lru_cache(maxsize=64)
def split_kv_layout(max_batch_size: int, max_total_q: int, capacity: int):
    """``(schema, numel, offsets)``: ``plan.schema_for``'s layout of ``SPLIT_KV_SCHEMA`` (fields 4-aligned, in
    order), built directly (a plan of a new batch size misses the cache: 3 us instead of 6.5). ``offsets``:
    of qo_indptr, kv_len, num_chunks, merge_indptr, the item block, and the item row stride."""
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


def storage(req: PlanRequest, num_items: int):
    """``(capacity, schema, host, flat, offsets)`` of a plan of ``num_items`` items (``split_kv_layout``), in
    ``req.host_buffer`` or a new one; ``PlanError`` where the items exceed a fixed capacity."""
    max_batch_size, max_total_q, _, capacity, _ = req[SIZES]
    cap = num_items if capacity is None else capacity
    if num_items > cap:
        raise PlanError(f"capacity: the batch needs {num_items} work items, more than the capacity of {cap}")
    schema, numel, offsets = split_kv_layout(max_batch_size, max_total_q, cap)
    host, flat = host_storage(numel, req.host_buffer)
    return cap, schema, host, flat, offsets


def finish_plan(req: PlanRequest, schema, host, flat, offsets, items, batch, total_q, n, cap, partial_rows,
                kv_chunk) -> Plan:
    """The end of every fast path: fixed-capacity padding of the per-request fields and of the items past
    ``n``, then the plan and its info (the merge ranges are the caller's)."""
    qo_at, kv_at, chunks_at = offsets[:3]
    max_batch_size, max_total_q, tile_rows, capacity, partial_capacity = req[SIZES]
    if max_batch_size > batch:  # fixed capacity: pad the per-request fields
        flat[qo_at + batch + 1: qo_at + max_batch_size + 1] = total_q
        flat[kv_at + batch: kv_at + max_batch_size] = 0
        flat[chunks_at + batch: chunks_at + max_batch_size] = 0
    if cap > n:
        items[:, n:cap] = _ITEM_PAD_COLUMN
    num_qo_heads, num_kv_heads = req.num_qo_heads, req.num_kv_heads
    info = new_info((batch, max_batch_size, total_q, max_total_q, n, cap, num_qo_heads, num_kv_heads,
                     num_qo_heads // num_kv_heads, tile_rows, kv_chunk, partial_rows,
                     partial_rows if partial_capacity is None else partial_capacity, capacity is not None))
    return Plan("split_kv", schema, host, info)


# ---------------------------------------------------------------------------------------------- decode
# Decode with one qo tile per request (group_size <= tile_rows): about 30 numpy calls and no per-token arrays.
# It equals the reference (``plan_split_kv(arange(batch + 1), kv_lens)``) field for field, item order included.


def plan_decode_numpy(req: PlanRequest) -> Plan:
    """The plan of a decode ``req`` of one qo tile a request (``req.lens`` a numpy array, < ``MAX_KV_LEN``)."""
    lens, max_len = req.lens, req.max_len
    _, num_kv_heads, g, num_sms, item_overhead, enable_split, _, _, policy, _ = req[OPTIONS]
    batch = lens.size
    if enable_split:
        kv_chunk, counts, n = choose_split(lens, None, num_kv_heads, num_sms, g, item_overhead, req.capacity,
                                           max_len, policy.candidates)
    else:
        kv_chunk, counts, n = max(g, -(-max_len // g) * g), None, batch
    cap, schema, host, flat, offsets = storage(req, n)
    qo_at, kv_at, chunks_at, merge_at, items_at, stride = offsets
    flat[qo_at: qo_at + batch + 1] = iota(batch + 1)
    kv = flat[kv_at: kv_at + batch]
    kv[:] = lens
    chunks = flat[chunks_at: chunks_at + batch]
    chunks[:] = 1 if counts is None else counts
    items = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    flat[merge_at] = 0
    if n == batch:  # nothing split: one item per request, longest first
        order = (-kv).argsort(kind="stable")
        items[0, :n] = order
        items[1:4, :n] = UNSPLIT_FILL
        kv.take(order, out=items[4, :n], mode="clip")
        partial_rows, merged = 0, 0  # no token has partial rows
    else:
        split_decode_items(kv, chunks, kv_chunk, n, items, flat[merge_at + 1: merge_at + batch + 1])
        partial_rows, merged = int(flat[merge_at + batch]), batch
    flat[merge_at + merged + 1: merge_at + req.max_total_q + 1] = partial_rows  # past the requests written
    return finish_plan(req, schema, host, flat, offsets, items, batch, batch, n, cap, partial_rows, kv_chunk)


def split_decode_items(kv: np.ndarray, chunks: np.ndarray, kv_chunk: int, n: int, out: np.ndarray,
                       merge: np.ndarray) -> None:
    """Decode items in (request, chunk) order, stably sorted longest first into ``out[:, :n]``; ``merge`` =
    ``merge_indptr[1:]``. int32 throughout (kv lengths < ``MAX_KV_LEN``), one dtype per call."""
    ends = np.add.accumulate(chunks, dtype=np.int32)
    partial = chunks * (chunks > 1)  # partial rows of each request
    np.add.accumulate(partial, dtype=np.int32, out=merge)
    items = np.zeros((5, n), dtype=np.int32)  # request_idx, qo_tile_idx (0), chunk_idx, kv_start, kv_end
    request = iota(chunks.size).repeat(chunks)
    items[0] = request
    # an unsplit request's first item is itself: its chunk_idx 0 - 1 = -1, and kv_start max(-1, 0) = 0
    chunk = np.subtract(iota(n), (ends - partial).repeat(chunks), out=items[2])
    start = np.maximum(chunk, 0, out=items[3])
    np.multiply(start, kv_chunk, out=start)
    end = np.minimum(start + kv_chunk, kv.take(request), out=items[4])
    items.take((start - end).argsort(kind="stable"), axis=1, out=out[:, :n], mode="clip")
