"""Split-KV planning for decode and prefill: work items that fill the GPU's SMs evenly.

A work item is (request, qo tile, kv chunk), run once for every kv head: the grid has ``capacity *
num_kv_heads`` CTAs, as ``(capacity, num_kv_heads)`` or flattened to 1-D with the kv head fastest (the kernel
chooses how to read its block index: see decode/kernel.cuh and prefill/kernel.cuh). With GQA the
``group_size = num_qo_heads // num_kv_heads`` q heads of one kv head are packed into the rows of a qo tile:
packed row ``p`` of a request is its token ``p // group_size`` and q head ``kv_head * group_size + p %
group_size``; tile ``t`` covers packed rows
``[t * tile_rows, min((t + 1) * tile_rows, qo_len * group_size))``.

Every request is cut into ``num_chunks = ceil(kv_len / kv_chunk)`` chunks (one global ``kv_chunk``, so long
requests split more than short ones). An unsplit request's items write the output directly; a split
request's items write partial states that a merge combines (see ``SPLIT_KV_SCHEMA``).
"""

from __future__ import annotations

import numpy as np
import torch

# SPLIT_KV_SCHEMA, SplitKVInfo, SplitPolicy and the heuristics' public names are re-exported from here (flashgen.plan
# and older imports take them from this module)
from . import native
from .fast_paths import MAX_KV_LEN, iota, plan_decode_numpy, plan_numpy
from .heuristics import (DEFAULT_SPLIT_POLICY, SplitPolicy, choose_kv_chunk, choose_split, choose_tail_split,
                         default_tile_rows, fills_waves)
from .host import PlanError, check_heads, check_int, host_array, is_int_vector
from .list_paths import SMALL_DECODE, plan_decode_lists, plan_lists, small_inputs
from .page_table import indptr_steps
from .plan import Plan
from .request import ITEM_FIELDS, ITEM_PADS, SPLIT_KV_SCHEMA, PlanRequest, SplitKVInfo, new_request

_UNSIGNED = {4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


# ---------------------------------------------------------------------------------------------- entry points


def plan_split_kv(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                  tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132,
                  item_overhead: int = 64, enable_split: bool = True, max_batch_size: int | None = None,
                  max_total_q: int | None = None, capacity: int | None = None,
                  host_buffer: torch.Tensor | None = None, balance_tail: bool = False,
                  split_min_waves: float | None = None, split_policy: SplitPolicy | None = None) -> Plan:
    """Plan a batch of attention requests (prefill or decode) as split-KV work items.

    ``qo_indptr [batch + 1]`` and ``kv_lens [batch]`` are host integer arrays (numpy, lists or CPU
    tensors; a CUDA tensor is refused, never synchronised on). ``tile_rows``: packed q rows per CTA tile
    (default from ``default_tile_rows``); ``kv_granularity``: chunks are multiples of it (the kernel's KV
    tile, or the page size); ``num_sms``: SMs to fill. ``enable_split=False`` plans one chunk per request.
    ``balance_tail`` (a one-CTA-an-item grid that runs the list from its end, as the portable prefill does):
    where the plan is otherwise unsplit, the items of a partly empty last wave are split (``choose_tail_split``).
    ``split_min_waves`` (prefill; ``plan_prefill`` sets 2): no request is split where the batch's work fills the
    ``num_sms`` slots that many times over with its longest request's KV (``heuristics.fills_waves``).
    ``split_policy``: the chunk candidates and the tail split to use (``heuristics.SplitPolicy``; default
    ``DEFAULT_SPLIT_POLICY``).

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
    if split_policy is None or split_policy is DEFAULT_SPLIT_POLICY:  # a small batch: the list paths, natively
        plan = native.plan_prefill(qo_indptr, kv_lens, host_buffer, num_qo_heads, num_kv_heads, tile_rows,
                                   kv_granularity, num_sms, item_overhead, enable_split, balance_tail,
                                   split_min_waves, max_batch_size, max_total_q, capacity)
        if plan is not None:
            return plan
    _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead)
    options = (num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead, enable_split, balance_tail,
               split_min_waves, DEFAULT_SPLIT_POLICY if split_policy is None else split_policy, host_buffer)
    small = small_inputs(qo_indptr, kv_lens)
    if small is not None:
        sizes = _sizes(len(small[1]), small[0][-1], small[3], num_qo_heads // num_kv_heads, num_kv_heads, num_sms,
                       tile_rows, max_batch_size, max_total_q, capacity)
        plan = plan_lists(new_request(small + sizes + options))
        if plan is not None:
            return plan
    checked = _checked_inputs(qo_indptr, kv_lens)
    sizes = _sizes(checked[1].size, int(checked[0][-1]), checked[3], num_qo_heads // num_kv_heads, num_kv_heads,
                   num_sms, tile_rows, max_batch_size, max_total_q, capacity)
    request = new_request(checked + sizes + options)
    plan = plan_numpy(request)
    return _plan_general(request) if plan is None else plan  # None: lengths past the fast path's bounds


def plan_decode(kv_lens: object, *, num_qo_heads: int, num_kv_heads: int, tile_rows: int | None = None,
                kv_granularity: int = 16, num_sms: int = 132, item_overhead: int = 64, enable_split: bool = True,
                max_batch_size: int | None = None, max_total_q: int | None = None, capacity: int | None = None,
                host_buffer: torch.Tensor | None = None, split_policy: SplitPolicy | None = None) -> Plan:
    """Split-KV plan for decode: one query token per request. ``kv_lens [batch]`` host ints.

    Options as for ``plan_split_kv`` (``max_batch_size`` for a CUDA-graph plan). The hot call of a decode
    step: pass a reused (pinned) ``host_buffer``, or each call allocates one.

    >>> plan_decode([300, 9000, 12], num_qo_heads=32, num_kv_heads=8).info.grid[1]
    8
    """
    if split_policy is None or split_policy is DEFAULT_SPLIT_POLICY:  # a small batch: the list path, natively
        plan = native.plan_decode(kv_lens, host_buffer, num_qo_heads, num_kv_heads, tile_rows, kv_granularity,
                                  num_sms, item_overhead, enable_split, max_batch_size, max_total_q, capacity)
        if plan is not None:
            return plan
    _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead)
    lens = values = None
    if is_int_vector(kv_lens) and kv_lens.numel() <= SMALL_DECODE:
        values = kv_lens.tolist()
    else:
        lens = host_array("kv_lens", kv_lens)
        if lens.size <= SMALL_DECODE:
            values = lens.tolist()
    if values is not None:
        batch, max_len = len(values), max(values, default=0)
        if batch and min(values) < 0:
            max_len = MAX_KV_LEN
    else:  # one pass for the check and the longest request: a negative length is a huge unsigned one
        batch, max_len = lens.size, int(np.maximum.reduce(lens.view(_UNSIGNED[lens.itemsize]), initial=0))
    if max_len >= MAX_KV_LEN:
        _raise_length(host_array("kv_lens", kv_lens))
    group_size = num_qo_heads // num_kv_heads
    sizes = _sizes(batch, batch, None, group_size, num_kv_heads, num_sms, tile_rows, max_batch_size, max_total_q,
                   capacity)
    options = (num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead, enable_split, False, None,
               DEFAULT_SPLIT_POLICY if split_policy is None else split_policy, host_buffer)
    if group_size <= sizes[2]:  # one qo tile per request (sizes[2]: tile_rows)
        if values is not None:
            return plan_decode_lists(new_request((None, values, None, 1, max_len) + sizes + options))
        return plan_decode_numpy(new_request((None, lens, None, 1, max_len) + sizes + options))
    lens = host_array("kv_lens", kv_lens) if lens is None else lens
    qo = iota(batch + 1)
    plan = plan_numpy(new_request((qo, lens, qo[1:] - qo[:-1], min(batch, 1), max_len) + sizes + options))
    if plan is None:  # past the fast path's bounds
        batch_inputs = (qo, lens, np.ones(batch, np.int64), min(batch, 1), max_len)
        plan = _plan_general(new_request(batch_inputs + sizes + options))
    return plan


def plan_prefill(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                 **options) -> Plan:
    """Split-KV plan for prefill / append: ``qo_indptr [batch + 1]``, ``kv_lens [batch]`` host ints. Requests
    are split only where the batch cannot fill the SMs twice over with its longest request's KV
    (``split_min_waves=2``, see ``plan_split_kv``, whose options it takes, ``split_policy`` included).

    >>> plan_prefill([0, 100, 101], [100, 5000], num_qo_heads=4, num_kv_heads=4).info.tile_rows
    128
    """
    options.setdefault("split_min_waves", 2.0)
    return plan_split_kv(qo_indptr, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, **options)


# ---------------------------------------------------------------------------------------------- validation


def _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead) -> None:
    # the planner's sizes: ints (a float or bool would size arrays or divide wrongly), >= 1 (item_overhead >= 0)
    if (type(num_qo_heads) is int and type(num_kv_heads) is int and type(kv_granularity) is int
            and type(num_sms) is int and type(item_overhead) is int and num_kv_heads > 0 and num_qo_heads > 0
            and kv_granularity > 0 and num_sms > 0 and item_overhead >= 0 and not num_qo_heads % num_kv_heads
            and (tile_rows is None or (type(tile_rows) is int and tile_rows > 0))):
        return
    for name, value, minimum in (("num_qo_heads", num_qo_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("tile_rows", tile_rows, 1), ("kv_granularity", kv_granularity, 1),
                                 ("num_sms", num_sms, 1), ("item_overhead", item_overhead, 0)):
        if value is not None or name != "tile_rows":  # tile_rows None: the default
            check_int(name, value, minimum)
    check_heads(num_qo_heads, num_kv_heads)


def _check_capacity(max_batch_size, max_total_q, capacity) -> None:
    for name, value in (("max_batch_size", max_batch_size), ("max_total_q", max_total_q), ("capacity", capacity)):
        check_int(name, value, 0, optional=True)


def _raise_length(lens: np.ndarray) -> None:
    b = int(np.argmin(lens))
    if lens[b] < 0:
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected >= 0")
    b = int(np.argmax(lens))
    raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected < 2**30 (plans hold int32 positions)")


def _batch_inputs(qo_indptr: object, kv_lens: object) -> tuple[np.ndarray, np.ndarray]:
    # (qo_indptr, kv_lens) as checked numpy arrays (cascade levels)
    return _checked_inputs(qo_indptr, kv_lens)[:2]


def _checked_inputs(qo_indptr: object, kv_lens: object):
    # (qo, lens, qo_len, longest query, longest KV): the checks and errors of validate_indptr and kv_lens >= 0,
    # with the query lengths and maxima they compute on the way (one pass each)
    qo, qo_len, longest_q = indptr_steps("qo_indptr", qo_indptr)
    lens = host_array("kv_lens", kv_lens)
    if lens.size != qo.size - 1:
        raise PlanError(f"kv_lens: has {lens.size} entries, expected batch_size = {qo.size - 1} (len(qo_indptr) - 1)")
    max_len = int(np.maximum.reduce(lens.view(_UNSIGNED[lens.itemsize]), initial=0))
    if max_len >= MAX_KV_LEN and lens.min() < 0:  # a negative length is a huge unsigned one
        b = int(np.argmin(lens))
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected >= 0")
    return qo, lens, qo_len, longest_q, max_len


def _sizes(batch, total_q, longest_q, group_size, num_kv_heads, num_sms, tile_rows, max_batch_size, max_total_q,
           capacity):
    # -> (max_batch_size, max_total_q, tile_rows, capacity, partial_capacity). longest_q: the longest query of a
    # prefill batch, None for decode (it sizes tile_rows when an exact plan must choose them)
    fixed = max_batch_size is not None
    if fixed:
        if type(max_batch_size) is not int or (max_total_q is not None and type(max_total_q) is not int) or \
                (capacity is not None and type(capacity) is not int) or max_batch_size < 0:
            _check_capacity(max_batch_size, max_total_q, capacity)
        max_total_q = max_batch_size if max_total_q is None else max_total_q
        if batch > max_batch_size:
            raise PlanError(f"qo_indptr: batch_size {batch} exceeds max_batch_size = {max_batch_size}")
        if total_q > max_total_q:
            raise PlanError(f"qo_indptr[-1] = {total_q} exceeds max_total_q = {max_total_q}")
        decode_shape = max_total_q == max_batch_size
    else:
        max_batch_size, max_total_q, decode_shape = batch, total_q, longest_q is None
    if tile_rows is None:
        longest = 1 if decode_shape else max_total_q if fixed else longest_q
        tile_rows = default_tile_rows(longest * group_size)
    partial_capacity = None
    if fixed:
        min_items = -(-(max_total_q * group_size) // tile_rows) + max_batch_size
        capacity = min_items + 2 * -(-num_sms // num_kv_heads) if capacity is None else capacity
        partial_capacity = capacity * -(-tile_rows // group_size)
    return max_batch_size, max_total_q, tile_rows, capacity, partial_capacity


def request_for(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132, item_overhead: int = 64,
                enable_split: bool = True, max_batch_size: int | None = None, max_total_q: int | None = None,
                capacity: int | None = None, host_buffer: torch.Tensor | None = None, balance_tail: bool = False,
                split_min_waves: float | None = None, split_policy: SplitPolicy | None = None) -> PlanRequest:
    """The ``PlanRequest`` (numpy arrays) of a ``plan_split_kv`` call, for a path to plan: the tests hold the
    fast paths to ``_plan_general(request_for(...))``."""
    _check_options(num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead)
    checked = _checked_inputs(qo_indptr, kv_lens)
    sizes = _sizes(checked[1].size, int(checked[0][-1]), checked[3], num_qo_heads // num_kv_heads, num_kv_heads,
                   num_sms, tile_rows, max_batch_size, max_total_q, capacity)
    return PlanRequest(*checked, *sizes, num_qo_heads, num_kv_heads, kv_granularity, num_sms, item_overhead,
                       enable_split, balance_tail, split_min_waves,
                       DEFAULT_SPLIT_POLICY if split_policy is None else split_policy, host_buffer)


# ---------------------------------------------------------------------------------------------- the reference


def _plan_general(request: PlanRequest) -> Plan:
    # the reference path: the policy (heuristics) on numpy arrays, then split_kv_arrays and Plan.pack; the fast
    # paths equal it field for field
    qo, lens, qo_len, _, _, max_batch_size, max_total_q, tile_rows, capacity, partial_capacity, num_qo_heads, \
        num_kv_heads, granularity, num_sms, item_overhead, enable_split, balance_tail, split_min_waves, policy, \
        host_buffer = request
    group_size = num_qo_heads // num_kv_heads
    tiles = -(-(qo_len * group_size) // tile_rows)
    chunks, tail = None, None
    max_len = int(lens.max(initial=0))
    # int64: tiles x tokens passes 2**31 at long context
    full = enable_split and fills_waves(int(tiles.astype(np.int64) @ lens), num_kv_heads, num_sms, max_len,
                                        split_min_waves)
    if enable_split and not full:
        kv_chunk, counts, num_items = choose_split(lens, tiles, num_kv_heads, num_sms, granularity, item_overhead,
                                                   capacity, candidates=policy.candidates)
        chunks = None if counts is None else counts.astype(np.int64)
    else:  # one chunk a request
        kv_chunk = max(granularity, -(-max_len // granularity) * granularity)
        counts, num_items = None, int(tiles.sum())
    unsplit = counts is None or bool((counts <= 1).all())
    if enable_split and balance_tail and unsplit and tile_rows % group_size == 0 and num_items:
        # the tail items are the list's first, the longest (the grid runs them last): their length
        longest = int(lens[tiles > 0].max(initial=0))
        tail = policy.tail_split(longest, num_items, num_kv_heads, num_sms=num_sms, granularity=granularity,
                                 item_overhead=item_overhead,
                                 max_extra=None if capacity is None else capacity - num_items)
    arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                   tile_rows=tile_rows, kv_chunk=kv_chunk, max_batch_size=max_batch_size,
                                   max_total_q=max_total_q, capacity=capacity, partial_capacity=partial_capacity,
                                   chunks=chunks, tail=tail, granularity=granularity)
    return Plan.pack("split_kv", arrays, info, host_buffer)


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


def split_kv_arrays(qo_indptr: np.ndarray, kv_lens: np.ndarray, *, num_qo_heads: int, num_kv_heads: int,
                    tile_rows: int, kv_chunk: int, max_batch_size: int, max_total_q: int,
                    capacity: int | None, partial_capacity: int | None = None, chunks: np.ndarray | None = None,
                    tail: tuple[int, int] | None = None, granularity: int = 1):
    """The fields of ``SPLIT_KV_SCHEMA`` for ``Plan.pack`` and the ``SplitKVInfo``: the reference path's plan.

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
    # on the portable prefill (+3 % on 1 x 8192 + 31 x 256 without a mask, -2-10 % with causal, within noise
    # elsewhere)
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
        ITEM_FIELDS: (items, cap, ITEM_PADS),
    }
    info = SplitKVInfo(
        batch_size=kv_lens.size, max_batch_size=max_batch_size, total_q=total_q, max_total_q=max_total_q,
        num_items=num_items, capacity=cap, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        group_size=group_size, tile_rows=tile_rows, kv_chunk=kv_chunk, partial_rows=partial_rows,
        partial_capacity=partial_rows if partial_capacity is None else partial_capacity,
        fixed_capacity=capacity is not None)
    return fields, info
