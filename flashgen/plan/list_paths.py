"""The planner's list paths: a batch of a few requests planned on Python lists.

A numpy call costs ~1.5 us on a small host, more than a Python loop over a dozen requests and a few hundred
items. ``plan_lists`` (prefill) and ``plan_decode_lists`` (decode, one qo tile a request) give the fields of
the numpy paths (``fast_paths``), and so of the reference: chunk counts by integer ceil, which equals
float64's for lengths below 2**52, whose sums are exact in float64 too.
"""

from __future__ import annotations

import itertools
import operator
import struct

import numpy as np
import torch

from .fast_paths import INT32_LIMIT, MAX_KV_LEN, UNSPLIT_FILL, finish_plan, iota, split_decode_items, storage, \
    tail_split, write_ramps
from .heuristics import fills_waves, pick_chunk
from .host import host_list
from .plan import Plan
from .request import BATCH, OPTIONS, PlanRequest

SMALL_BATCH = 12  # requests of a prefill batch
SMALL_DECODE = 24  # requests of a decode batch
_SMALL_ITEMS = 40  # tiles: past ~40 items the numpy path wins (its cost barely grows with them)
_SMALL_SPLIT_ITEMS = 160  # items of a split batch, once its chunk is chosen (the numpy path would choose again)
_first_key = operator.itemgetter(0)
_chain = itertools.chain.from_iterable
_packers: dict[tuple[int, int], struct.Struct] = {}


def _pack_items(flat: np.ndarray, items_at: int, stride: int, n: int, columns) -> None:
    """Write the five item fields (``columns``: five sequences of ``n`` ints, in ``ITEM_FIELDS`` order) into the
    item block of ``flat`` at ``items_at`` (rows ``stride`` apart) with one ``struct.pack_into``: a numpy write
    from a list costs ~1 us a row on a small host, this ~2 us for all five (the gaps after ``n`` get zeros)."""
    packer = _packers.get((n, stride))
    if packer is None:
        if len(_packers) >= 256:
            _packers.clear()
        packer = _packers[(n, stride)] = struct.Struct("=" + f"{n}i{4 * (stride - n)}x" * 5)
    packer.pack_into(flat, 4 * items_at, *_chain(columns))


def small_inputs(qo_indptr: object, kv_lens: object):
    """``(qo, lens, qo_len, longest query, longest KV)`` as lists for a small valid batch of host arrays, else
    None (then ``split_kv._checked_inputs`` checks, raises, or takes it on)."""
    if isinstance(qo_indptr, (np.ndarray, torch.Tensor)) and qo_indptr.ndim == 1 and \
            1 <= qo_indptr.shape[0] <= SMALL_BATCH + 1:
        qo = host_list("qo_indptr", qo_indptr)
        qo_len = [b - a for a, b in zip(qo, qo[1:])]
        if qo[0] != 0 or min(qo_len, default=0) < 0:  # qo_indptr's errors come first
            return None
        lens = host_list("kv_lens", kv_lens)
        if len(lens) == len(qo_len) and min(lens, default=0) >= 0:
            return qo, lens, qo_len, max(qo_len, default=0), max(lens, default=0)
    return None


def plan_lists(req: PlanRequest) -> Plan | None:
    """``fast_paths.plan_numpy`` on lists; None where it does not apply (lengths past its bounds, too many
    items)."""
    qo, lens, qo_len, longest_q, max_len = req[BATCH]
    total_q = qo[-1]
    group_size, tile_rows = req.num_qo_heads // req.num_kv_heads, req.tile_rows
    if max_len >= MAX_KV_LEN or longest_q * group_size >= INT32_LIMIT or total_q >= INT32_LIMIT:
        return None
    tiles = [-(-(q * group_size) // tile_rows) for q in qo_len]
    if sum(tiles) > _SMALL_ITEMS:  # at least one item a tile
        return None
    max_len_q = max([x for x, q in zip(lens, qo_len) if q], default=0) if 0 in qo_len else max_len
    kv_chunk, counts, num_items = _list_chunk(req, tiles, max_len_q)
    if num_items > _SMALL_SPLIT_ITEMS or total_q * -(-max_len // kv_chunk) >= INT32_LIMIT:
        return None
    if counts is not None:
        return _write_lists(req, _split_rows(lens, tiles, counts, kv_chunk), counts, None, kv_chunk)
    # a request's tiles in order, requests longest first (a stable sort: reverse=True keeps ties in order)
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    rows = [(r, t, -1, 0, lens[r]) for r in order for t in range(tiles[r])]
    tail = tail_split(req, num_items, max_len_q)
    splits = None
    if tail is not None:
        rows[:tail[0]], splits = _tail_rows(rows[:tail[0]], tail[1], req.kv_granularity)
    return _write_lists(req, rows, None, splits, kv_chunk)


def _list_chunk(req: PlanRequest, tiles: list, max_len_q: int):
    # (kv_chunk, chunk counts per request or None when nothing splits, items): see fast_paths._numpy_chunk
    lens, max_len = req.lens, req.max_len
    _, num_kv_heads, g, num_sms, item_overhead, enable_split, _, split_min_waves, policy, _ = req[OPTIONS]
    if enable_split:
        work = sum([t * x for t, x in zip(tiles, lens)])
        if not fills_waves(work, num_kv_heads, num_sms, max_len, split_min_waves):
            if max_len_q <= g:
                return g, None, sum(tiles)
            chunk = policy.candidates(max_len_q, work, num_kv_heads, num_sms, g)
            weighted = [(t, -x or -1) for t, x in zip(tiles, lens) if t]  # an empty request has one chunk
            counted = [-sum([t * (y // c) for t, y in weighted]) for c in chunk]  # ceil(x / c) = -(-x // c)
            at, num_items = pick_chunk(chunk, counted, 0, max_len_q, work, num_kv_heads, num_sms, item_overhead,
                                       req.capacity)
            kv_chunk = chunk[at]
            if max_len <= kv_chunk:  # no request splits (one without queries counts too)
                return kv_chunk, None, num_items
            return kv_chunk, [-(-(x or 1) // kv_chunk) if q else 0 for x, q in zip(lens, req.qo_len)], num_items
    return max(g, -(-max_len // g) * g), None, sum(tiles)  # one chunk a request


def _split_rows(lens, tiles, counts, kv_chunk):
    # the items (request, qo tile, chunk_idx, kv_start, kv_end) of a split batch, longest first
    rows = []
    for r, (x, c) in enumerate(zip(lens, counts)):
        if c == 1:  # unsplit: x <= kv_chunk
            rows += [(-x, r, t, -1, 0, x) for t in range(tiles[r])]
        elif c:  # chunk j < c - 1 ends at (j + 1) * kv_chunk < x
            last = (c - 1) * kv_chunk
            rows += [(-kv_chunk, r, t, j, j * kv_chunk, (j + 1) * kv_chunk) if j < c - 1
                     else (last - x, r, t, j, last, x) for t in range(tiles[r]) for j in range(c)]
    rows.sort(key=_first_key)  # stable: longest first, ties in list order
    return [row[1:] for row in rows]


def _tail_rows(head, k, granularity):
    # fast_paths._tail_pieces on rows: each of the head items as up to k chunks of granularity multiples;
    # returns the pieces and (request, tile, chunks) of each head item
    pieces, splits = [], []
    for r, t, _, _, length in head:
        per = min(max(-(-length // granularity), 1), k)
        step = -(-length // per)
        step = max(-(-step // granularity) * granularity, granularity)
        c = max(-(-length // step), 1)
        splits.append((r, t, c))
        if c == 1:
            pieces.append((r, t, -1, 0, length))
        else:  # chunk j < c - 1 ends at (j + 1) * step < length
            pieces += [(r, t, j, j * step, (j + 1) * step) for j in range(c - 1)]
            pieces.append((r, t, c - 1, (c - 1) * step, length))
    return pieces, splits


def _write_lists(req: PlanRequest, rows, counts, splits, kv_chunk):
    qo, lens, qo_len = req.qo, req.lens, req.qo_len
    num_items, batch, total_q = len(rows), len(lens), qo[-1]
    cap, schema, host, flat, offsets = storage(req, num_items)
    qo_at, kv_at, chunks_at, merge_at, items_at, stride = offsets
    flat[qo_at: qo_at + batch + 1] = qo
    flat[kv_at: kv_at + batch] = lens
    if counts is None:
        flat[chunks_at: chunks_at + batch] = [1 if q else 0 for q in qo_len] if 0 in qo_len else 1
    else:
        flat[chunks_at: chunks_at + batch] = counts
    if num_items:
        _pack_items(flat, items_at, stride, num_items, zip(*rows))
    out = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    # merge_indptr: the partial rows before each token, rising by c over the tokens of a tile split c ways
    if counts is not None:
        ramps = [(qo[r], q, c) for r, (q, c) in enumerate(zip(qo_len, counts)) if c > 1 and q]
    elif splits is not None:  # a split tail tile's tokens (tiles hold whole tokens)
        tokens = req.tile_rows // (req.num_qo_heads // req.num_kv_heads)
        ramps = sorted((qo[r] + t * tokens, min(qo[r] + (t + 1) * tokens, qo[r + 1]) - qo[r] - t * tokens, c)
                       for r, t, c in splits if c > 1)
    else:
        ramps = ()
    partial_rows = write_ramps(flat[merge_at: merge_at + req.max_total_q + 1], ramps)
    return finish_plan(req, schema, host, flat, offsets, out, batch, total_q, num_items, cap, partial_rows,
                       kv_chunk)


def plan_decode_lists(req: PlanRequest) -> Plan:
    """``fast_paths.plan_decode_numpy`` on a list of lengths (``req.lens``), same fields."""
    lens, max_len = req.lens, req.max_len
    _, num_kv_heads, g, num_sms, item_overhead, enable_split, _, _, policy, _ = req[OPTIONS]
    batch = len(lens)
    counts = None
    if not enable_split:
        kv_chunk, n = max(g, -(-max_len // g) * g), batch
    elif max_len <= g:
        kv_chunk, n = g, batch
    else:
        work = sum(lens)
        chunk = policy.candidates(max_len, work, num_kv_heads, num_sms, g)
        negative = [-x for x in lens]  # ceil(x / c) = -(-x // c)
        counted = [-sum([y // c for y in negative]) for c in chunk]
        at, n = pick_chunk(chunk, counted, batch - counted[0], max_len, work, num_kv_heads, num_sms,
                           item_overhead, req.capacity)
        kv_chunk = chunk[at]
        if n > batch:
            counts = [-(-x // kv_chunk) or 1 for x in lens]  # an empty request has one chunk
    cap, schema, host, flat, offsets = storage(req, n)
    qo_at, kv_at, chunks_at, merge_at, items_at, stride = offsets
    flat[qo_at: qo_at + batch + 1] = iota(batch + 1)
    flat[kv_at: kv_at + batch] = lens
    items = flat[items_at: items_at + 5 * stride].reshape(5, stride)
    flat[merge_at] = 0
    if counts is None:  # nothing split: one item per request, longest first
        flat[chunks_at: chunks_at + batch] = 1
        order = sorted(range(batch), key=lens.__getitem__, reverse=True)  # stable, as reverse=True keeps ties
        items[0, :n] = order  # row by row: numpy takes a 1-D list faster than a 2-D one
        items[1:4, :n] = UNSPLIT_FILL
        items[4, :n] = [lens[r] for r in order]
        partial_rows, merged = 0, 0  # no token has partial rows
    elif n > _SMALL_ITEMS:  # the numpy path's items (and merge ranges)
        chunks = flat[chunks_at: chunks_at + batch]
        chunks[:] = counts
        split_decode_items(flat[kv_at: kv_at + batch], chunks, kv_chunk, n, items,
                           flat[merge_at + 1: merge_at + batch + 1])
        partial_rows, merged = int(flat[merge_at + batch]), batch
    else:
        flat[chunks_at: chunks_at + batch] = counts
        _write_decode_rows(flat, items_at, stride, lens, counts, kv_chunk, n)
        flat[merge_at + 1: merge_at + batch + 1] = list(itertools.accumulate([c if c > 1 else 0 for c in counts]))
        partial_rows, merged = int(flat[merge_at + batch]), batch
    flat[merge_at + merged + 1: merge_at + req.max_total_q + 1] = partial_rows  # past the requests written
    return finish_plan(req, schema, host, flat, offsets, items, batch, batch, n, cap, partial_rows, kv_chunk)


def _write_decode_rows(flat, items_at, stride, lens, counts, kv_chunk, n):
    # decode items, stably sorted longest first: the chunks of kv_chunk tokens (every chunk of a request but its
    # last, and a last one of exactly kv_chunk) keep (request, chunk) order, written as ranges; the shorter last
    # chunks (and unsplit requests) follow, sorted by length
    request, chunk, start, end = [], [], [], []
    short = []  # (start - end, request, chunk_idx, start, end)
    for r, (x, c) in enumerate(zip(lens, counts)):
        if c == 1:  # unsplit: x <= kv_chunk
            if x == kv_chunk:
                request.append(r), chunk.append(-1), start.append(0), end.append(x)
            else:
                short.append((-x, r, -1, 0, x))
            continue
        last = (c - 1) * kv_chunk  # chunk j < c - 1 is [j * kv_chunk, (j + 1) * kv_chunk)
        full = c if x - last == kv_chunk else c - 1
        request += [r] * full
        chunk += range(full)
        start += range(0, full * kv_chunk, kv_chunk)
        end += range(kv_chunk, (full + 1) * kv_chunk, kv_chunk)
        if full < c:
            short.append((last - x, r, c - 1, last, x))
    if short:
        short.sort(key=_first_key)  # stable: ties in request order
        _, r_short, c_short, s_short, e_short = zip(*short)
        request += r_short
        chunk += c_short
        start += s_short
        end += e_short
    _pack_items(flat, items_at, stride, n, (request, (0,) * n, chunk, start, end))
