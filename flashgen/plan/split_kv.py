"""Split-KV planning for decode and prefill: work items that fill the GPU's SMs evenly.

A work item is (request, qo tile, kv chunk); kv heads are the second grid dimension, so the grid is
``(capacity, num_kv_heads)``. With GQA the ``group_size = num_qo_heads // num_kv_heads`` q heads of one kv
head are packed into the rows of a qo tile: packed row ``p`` of a request is its token ``p // group_size``
and q head ``kv_head * group_size + p % group_size``; tile ``t`` covers packed rows
``[t * tile_rows, min((t + 1) * tile_rows, qo_len * group_size))``.

Every request is cut into ``num_chunks = ceil(kv_len / kv_chunk)`` chunks (one global ``kv_chunk``, so long
requests split more than short ones). An unsplit request's items write the output directly; a split
request's items write partial states that a merge combines (see ``SPLIT_KV_SCHEMA``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .host import PlanError, host_array
from .page_table import validate_indptr
from .plan import Plan

SPLIT_KV_SCHEMA = {
    # per request (length max_batch_size [+ 1]); padded requests have qo_len = kv_len = num_chunks = 0
    "qo_indptr": "[max_batch_size + 1] token offsets of each request's queries (padded with the last value)",
    "kv_len": "[max_batch_size] KV length in tokens",
    "num_chunks": "[max_batch_size] kv chunks (items per qo tile); 1 = unsplit; 0 = no queries or padding",
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


@dataclass(frozen=True)
class SplitKVInfo:
    """Host-side sizes of a split-KV plan. ``grid = (capacity, num_kv_heads)``.

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


def _split_candidates(max_len: int, granularity: int) -> np.ndarray:
    # chunk lengths for 1..16 splits of the longest request, then ~15 % steps up to 1024 splits
    most = max(1, -(-max_len // granularity))
    splits = np.unique(np.concatenate([np.arange(1, 17), np.geomspace(17, 1024, 30).astype(np.int64)]))
    splits = splits[splits <= most]
    chunks = -(-(-(-max_len // splits)) // granularity) * granularity
    return np.unique(chunks)[::-1]  # descending: fewest splits first


def choose_kv_chunk(kv_lens: np.ndarray, qo_tiles: np.ndarray, num_kv_heads: int, *, num_sms: int = 132,
                    granularity: int = 16, item_overhead: int = 64, max_items: int | None = None) -> int:
    """Choose the KV chunk length (tokens, a multiple of ``granularity``) for a batch.

    ``kv_lens [batch]`` and ``qo_tiles [batch]`` (qo tiles per request) are int numpy arrays. Model: an item
    costs its KV length plus ``item_overhead`` tokens (launch, prologue, partial write and merge); CTAs run
    in waves of ``num_sms``; a schedule of items no longer than ``longest`` takes about
    ``waves * longest`` with ``waves = ceil(total_cost * num_kv_heads / (num_sms * longest))``. The
    chunk with the smallest estimate wins; ties (within 1 %) go to the longer chunk (fewer items, less
    merging). ``max_items`` caps the number of items (the fixed capacity of a CUDA-graph plan).

    Worked example (FA3's): 48 qo tiles of one request, 1 kv head, kv_len 4096, 108 SMs, overhead 64.
    Unsplit: 48 items, 1 wave of 4160. 2 splits: chunk 2048, 96 items, 1 wave -> 2112 (96/108 = 0.89 of
    the SMs busy). 3 splits: chunk 1376, 144 items, 2 waves -> 2880 (144/216 = 0.67). 4 splits: 2 waves of
    1088 -> 2176. 9 splits: 4 waves of 528 -> 2112, a tie that goes to 2 splits (fewer items): chunk 2048.
    A mixed decode batch (255 requests of 100 tokens, one of 8000, 8 kv heads, 132 SMs) gets chunk 288:
    only the long request splits (28 chunks), and its chunks are no longer than the wave of short items.
    """
    live = qo_tiles > 0
    lens, tiles = kv_lens[live], qo_tiles[live]
    max_len = int(lens.max(initial=0))
    if max_len <= granularity:
        return granularity
    chunk = _split_candidates(max_len, granularity)
    nchunks = np.maximum(1, -(-lens[None, :] // chunk[:, None]))
    items = nchunks @ tiles
    total = int(tiles @ lens) + item_overhead * items
    longest = np.minimum(chunk, max_len) + item_overhead
    waves = -(-(total * num_kv_heads) // (num_sms * longest))
    estimate = (waves * longest).astype(np.float64)
    if max_items is not None:
        estimate[items > max_items] = np.inf
        if not np.isfinite(estimate).any():
            raise PlanError(f"capacity: {int(items[0])} work items are needed even unsplit, more than the "
                            f"capacity of {max_items}")
    good = np.flatnonzero(estimate <= estimate.min() * 1.01)
    return int(chunk[good[0]])


# ---------------------------------------------------------------------------------------------- builder


def _items(qo_len: np.ndarray, kv_lens: np.ndarray, group_size: int, tile_rows: int, kv_chunk: int):
    tiles = -(-(qo_len * group_size) // tile_rows)
    chunks = np.where(tiles > 0, np.maximum(1, -(-kv_lens // kv_chunk)), 0)
    per_request = tiles * chunks
    first = np.cumsum(per_request) - per_request
    request = np.repeat(np.arange(qo_len.size), per_request)
    local = np.arange(request.size) - first[request]
    c = chunks[request]
    tile = local // c
    chunk = local - tile * c
    kv_start = chunk * kv_chunk
    kv_end = np.minimum(kv_start + kv_chunk, kv_lens[request])
    order = np.argsort(kv_start - kv_end, kind="stable")  # longest items first (LPT order)
    items = {"request_idx": request, "qo_tile_idx": tile, "chunk_idx": np.where(c > 1, chunk, -1),
             "kv_start": kv_start, "kv_end": kv_end}
    return {k: v[order] for k, v in items.items()}, chunks


def _padded(values: np.ndarray, length: int, pad: int) -> np.ndarray:
    out = np.full(length, pad, dtype=np.int64)
    out[: values.size] = values
    return out


def split_kv_arrays(qo_indptr: np.ndarray, kv_lens: np.ndarray, *, num_qo_heads: int, num_kv_heads: int,
                    tile_rows: int, kv_chunk: int, max_batch_size: int, max_total_q: int,
                    capacity: int | None, partial_capacity: int | None = None):
    """The arrays of ``SPLIT_KV_SCHEMA`` (int64 numpy, schema order) and the ``SplitKVInfo``; internal."""
    group_size = num_qo_heads // num_kv_heads
    qo_len = np.diff(qo_indptr)
    items, chunks = _items(qo_len, kv_lens, group_size, tile_rows, kv_chunk)
    num_items = items["request_idx"].size
    cap = num_items if capacity is None else capacity
    if num_items > cap:
        raise PlanError(f"capacity: the batch needs {num_items} work items, more than the capacity of {cap}")
    merge_count = np.repeat(np.where(chunks > 1, chunks, 0), qo_len)
    merge_indptr = np.zeros(qo_len.sum() + 1, dtype=np.int64)
    np.cumsum(merge_count, out=merge_indptr[1:])
    partial_rows = int(merge_indptr[-1])
    arrays = {
        "qo_indptr": _padded(qo_indptr, max_batch_size + 1, int(qo_indptr[-1])),
        "kv_len": _padded(kv_lens, max_batch_size, 0),
        "num_chunks": _padded(chunks, max_batch_size, 0),
        "merge_indptr": _padded(merge_indptr, max_total_q + 1, partial_rows),
    }
    for name, values in items.items():
        arrays[name] = _padded(values, cap, -1 if name == "request_idx" else 0)
    info = SplitKVInfo(
        batch_size=qo_len.size, max_batch_size=max_batch_size, total_q=int(qo_indptr[-1]),
        max_total_q=max_total_q, num_items=num_items, capacity=cap, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, group_size=group_size, tile_rows=tile_rows, kv_chunk=kv_chunk,
        partial_rows=partial_rows, partial_capacity=partial_rows if partial_capacity is None else partial_capacity,
        fixed_capacity=capacity is not None)
    return arrays, info


def _check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise PlanError(f"num_qo_heads: {num_qo_heads} is not a positive multiple of num_kv_heads = {num_kv_heads}")


def _batch_inputs(qo_indptr: object, kv_lens: object) -> tuple[np.ndarray, np.ndarray]:
    qo = validate_indptr("qo_indptr", qo_indptr)
    lens = host_array("kv_lens", kv_lens)
    if lens.size != qo.size - 1:
        raise PlanError(f"kv_lens: has {lens.size} entries, expected batch_size = {qo.size - 1} (len(qo_indptr) - 1)")
    if lens.size and lens.min() < 0:
        b = int(np.argmin(lens))
        raise PlanError(f"kv_lens[{b}] = {int(lens[b])}, expected >= 0")
    return qo, lens


def plan_split_kv(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                  tile_rows: int | None = None, kv_granularity: int = 16, num_sms: int = 132,
                  item_overhead: int = 64, enable_split: bool = True, max_batch_size: int | None = None,
                  max_total_q: int | None = None, capacity: int | None = None,
                  host_buffer: torch.Tensor | None = None) -> Plan:
    """Plan a batch of attention requests (prefill or decode) as split-KV work items.

    ``qo_indptr [batch + 1]`` and ``kv_lens [batch]`` are host integer arrays (numpy, lists or CPU
    tensors; a CUDA tensor is refused, never synchronised on). ``tile_rows``: packed q rows per CTA tile
    (default from ``default_tile_rows``); ``kv_granularity``: chunks are multiples of it (the kernel's KV
    tile, or the page size); ``num_sms``: SMs to fill. ``enable_split=False`` plans one chunk per request.

    Fixed-capacity mode (CUDA graphs): give ``max_batch_size`` (and for prefill ``max_total_q``, which
    defaults to ``max_batch_size``, i.e. decode) and optionally ``capacity`` (item slots). Every array then
    has a length that depends only on those maxima, the grid is ``(capacity, num_kv_heads)`` and items
    past the batch's own are no-ops (``request_idx = -1``, ``kv_start = kv_end = 0``), so one captured
    graph replays for any smaller batch. ``info.partial_capacity`` is then a batch-independent bound too.

    Returns a ``Plan`` of kind ``"split_kv"`` with fields ``SPLIT_KV_SCHEMA`` and a ``SplitKVInfo``.

    >>> plan = plan_split_kv([0, 1, 2], [100, 40000], num_qo_heads=8, num_kv_heads=8)
    >>> plan.info.kv_chunk, plan["num_chunks"].tolist()
    (2512, [1, 16])
    """
    _check_heads(num_qo_heads, num_kv_heads)
    qo, lens = _batch_inputs(qo_indptr, kv_lens)
    group_size = num_qo_heads // num_kv_heads
    fixed = max_batch_size is not None
    if fixed:
        max_total_q = max_batch_size if max_total_q is None else max_total_q
        if qo.size - 1 > max_batch_size:
            raise PlanError(f"qo_indptr: batch_size {qo.size - 1} exceeds max_batch_size = {max_batch_size}")
        if qo[-1] > max_total_q:
            raise PlanError(f"qo_indptr[-1] = {int(qo[-1])} exceeds max_total_q = {max_total_q}")
        packed_bound = max_total_q * group_size
    else:
        max_batch_size, max_total_q = qo.size - 1, int(qo[-1])
        packed_bound = int(np.diff(qo).max(initial=0)) * group_size
    if tile_rows is None:
        tile_rows = default_tile_rows(group_size if fixed and max_total_q == max_batch_size else packed_bound)
    tiles = -(-(np.diff(qo) * group_size) // tile_rows)
    partial_capacity = None
    if fixed:
        min_items = -(-(max_total_q * group_size) // tile_rows) + max_batch_size
        capacity = min_items + 2 * -(-num_sms // num_kv_heads) if capacity is None else capacity
        partial_capacity = capacity * -(-tile_rows // group_size)
    if enable_split:
        kv_chunk = choose_kv_chunk(lens, tiles, num_kv_heads, num_sms=num_sms, granularity=kv_granularity,
                                   item_overhead=item_overhead, max_items=capacity)
    else:
        kv_chunk = max(kv_granularity, -(-int(lens.max(initial=0)) // kv_granularity) * kv_granularity)
    arrays, info = split_kv_arrays(qo, lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                   tile_rows=tile_rows, kv_chunk=kv_chunk, max_batch_size=max_batch_size,
                                   max_total_q=max_total_q, capacity=capacity, partial_capacity=partial_capacity)
    return Plan.pack("split_kv", arrays, info, host_buffer)


def plan_decode(kv_lens: object, *, num_qo_heads: int, num_kv_heads: int, **options) -> Plan:
    """Split-KV plan for decode: one query token per request. ``kv_lens [batch]`` host ints.

    Options as for ``plan_split_kv`` (``max_batch_size`` for a CUDA-graph plan).

    >>> plan_decode([300, 9000, 12], num_qo_heads=32, num_kv_heads=8).info.grid[1]
    8
    """
    lens = host_array("kv_lens", kv_lens)
    return plan_split_kv(np.arange(lens.size + 1), lens, num_qo_heads=num_qo_heads,
                         num_kv_heads=num_kv_heads, **options)


def plan_prefill(qo_indptr: object, kv_lens: object, *, num_qo_heads: int, num_kv_heads: int,
                 **options) -> Plan:
    """Split-KV plan for prefill / append: ``qo_indptr [batch + 1]``, ``kv_lens [batch]`` host ints.

    >>> plan_prefill([0, 100, 101], [100, 5000], num_qo_heads=4, num_kv_heads=4).info.tile_rows
    128
    """
    return plan_split_kv(qo_indptr, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, **options)
