"""Custom bit masks as tile lists: which KV tiles of each work item a kernel must visit, and which of them
need the element mask.

A custom mask is a per-request row-major ``[qo_len, kv_len]`` bit matrix, requests concatenated, bits
little-endian (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``); request ``b`` starts at bit
``bit_offsets[b]``; a set bit is a visible (query, key) pair. A work item (request, q tile of ``tile_rows``
packed rows, packed row = token * group + q head) covers tokens ``row0 // group .. last_row // group``; KV
tile ``j`` covers keys ``[j * tile_kv, min((j + 1) * tile_kv, kv_len))``. Over those tokens and keys a tile
is EMPTY (no bit set: never loaded), FULL (every bit set: no element mask), CAUSAL (its bits are exactly the
causal pattern of the item's rows: key <= the query's position, queries aligned to the KV end, so the kernels
mask it arithmetically without reading bits; the diagonal tiles of document masks) or PARTIAL (bits read).

``mask_tile_lists`` returns each item's non-empty tiles as CSR: ``entries[indptr[i]:indptr[i + 1]]`` are
``tile << ENTRY_SHIFT | kind`` (kind ``ENTRY_FULL``, ``ENTRY_BITS`` or ``ENTRY_CAUSAL``), tiles ascending. Counting uses one prefix sum of popcounts over 64-bit words of the
whole mask and two word lookups per (token, tile) boundary, so it reads the mask once and touches
``qo_len * (kv_len / tile_kv + 1)`` boundaries a request: about 0.1 s for a 16k x 16k mask (32 MB) on a
2-core host (measured in tests/plan/test_mask_tiles.py's docstring).

A variant's tile predicate (``mask_tile``) has lists of the same entries, written on the device by the Hopper
prefill's pre-pass; ``tile_list_indptr`` sizes them.
"""

from __future__ import annotations

import numpy as np

from .host import PlanError
from .request import ITEM_FIELDS

TILE_EMPTY, TILE_FULL, TILE_PARTIAL, TILE_CAUSAL = 0, 1, 2, 3
# a list entry: the tile's index << ENTRY_SHIFT | its kind (how the kernels mask it)
ENTRY_SHIFT, ENTRY_FULL, ENTRY_BITS, ENTRY_CAUSAL = 2, 0, 1, 2
_ENTRY_KIND = np.array([0, ENTRY_FULL, ENTRY_BITS, ENTRY_CAUSAL], np.int64)  # by class


def mask_bit_offsets(qo_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """int64 ``[batch]``: the bit where request ``b``'s ``[qo_len, kv_len]`` mask starts.

    >>> mask_bit_offsets(np.array([2, 3, 1]), np.array([5, 4, 7])).tolist()
    [0, 10, 22]
    """
    sizes = np.asarray(qo_lens, np.int64) * np.asarray(kv_lens, np.int64)
    offsets = np.zeros(sizes.size, np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    return offsets


class _BitCounter:
    """Set bits of a packed little-endian bit stream before any bit position, by a prefix sum of the
    popcounts of its 64-bit words (8 bytes of prefix a word: 32 MB of bits -> 32 MB of prefix)."""

    def __init__(self, packed: np.ndarray):
        self.words = np.zeros(packed.size // 8 + 2, dtype="<u8")  # a spare word: position == end is valid
        self.words.view(np.uint8)[: packed.size] = packed
        self.prefix = np.zeros(self.words.size + 1, np.int64)
        np.cumsum(np.bitwise_count(self.words), out=self.prefix[1:])

    def before(self, x: np.ndarray) -> np.ndarray:
        """Set bits in ``[0, x)`` for an int64 array of positions ``x``."""
        w = x >> 6
        low = self.words[w] & ((np.uint64(1) << (x & 63).astype(np.uint64)) - np.uint64(1))
        return self.prefix[w] + np.bitwise_count(low)


def _item_tokens(rows_total: np.ndarray, qo_tile: np.ndarray, group_size: int, tile_rows: int):
    # first and one-past-last token of each item's packed rows
    row0 = qo_tile.astype(np.int64) * tile_rows
    last = np.minimum(row0 + tile_rows, rows_total) - 1
    return row0 // group_size, last // group_size + 1


def _request_classes(counter: _BitCounter, bit0: int, qo_len: int, kv_len: int, tok_lo: np.ndarray,
                     tok_hi: np.ndarray, tile_kv: int) -> np.ndarray:
    """int8 ``[items, tiles]``: the class of each KV tile of one request's items."""
    tiles = -(-kv_len // tile_kv)
    bounds = np.minimum(np.arange(tiles + 1, dtype=np.int64) * tile_kv, kv_len)
    rows = bit0 + np.arange(qo_len, dtype=np.int64) * kv_len
    counts = np.diff(counter.before(rows[:, None] + bounds[None, :]), axis=1)  # [qo_len, tiles] set bits
    prefix = np.zeros((qo_len + 1, tiles), np.int64)
    np.cumsum(counts, axis=0, out=prefix[1:])
    visible = prefix[tok_hi] - prefix[tok_lo]  # [items, tiles]
    full = (tok_hi - tok_lo)[:, None] * np.diff(bounds)[None, :]
    classes = np.where(visible == 0, TILE_EMPTY, np.where(visible == full, TILE_FULL, TILE_PARTIAL)).astype(np.int8)
    _mark_causal(classes, counter, rows, bounds, kv_len - qo_len, tok_lo, tok_hi)
    return classes


def _mark_causal(classes: np.ndarray, counter: _BitCounter, rows: np.ndarray, bounds: np.ndarray, q_base: int,
                 tok_lo: np.ndarray, tok_hi: np.ndarray) -> None:
    """PARTIAL tiles whose bits are the causal pattern of their item's tokens become CAUSAL. Only tiles the
    item's diagonal crosses can be (elsewhere the pattern is all or nothing: FULL or EMPTY); a candidate's token
    t (query position q_base + t) must see exactly keys [k0, c) of the tile [k0, k1), c = clip(q_base + t + 1,
    k0, k1): three prefix lookups a (token, candidate)."""
    k0, k1 = bounds[:-1], bounds[1:]
    cand_i, cand_j = np.nonzero((classes == TILE_PARTIAL) & (k0[None, :] < q_base + tok_hi[:, None])
                                & (q_base + tok_lo[:, None] + 1 < k1[None, :]))
    if cand_i.size == 0:
        return
    ntok = tok_hi[cand_i] - tok_lo[cand_i]
    pair = np.repeat(np.arange(cand_i.size), ntok)
    t = np.arange(int(ntok.sum())) - np.repeat(np.cumsum(ntok) - ntok, ntok) + tok_lo[cand_i][pair]
    lo, hi = k0[cand_j][pair], k1[cand_j][pair]
    c = np.clip(q_base + t + 1, lo, hi)
    row = rows[t]
    at_lo, at_c, at_hi = counter.before(row + lo), counter.before(row + c), counter.before(row + hi)
    wrong = (at_c - at_lo != c - lo) | (at_hi != at_c)
    causal = np.bincount(pair, weights=wrong, minlength=cand_i.size) == 0
    classes[cand_i[causal], cand_j[causal]] = TILE_CAUSAL


def _csr(item: np.ndarray, entry: np.ndarray, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(item, kind="stable")  # each item's tiles were produced ascending
    indptr = np.zeros(num_items + 1, np.int64)
    np.cumsum(np.bincount(item, minlength=num_items), out=indptr[1:])
    return indptr, entry[order].astype(np.int32)


def mask_tile_lists(packed: np.ndarray, bit_offsets: np.ndarray, qo_lens: np.ndarray, kv_lens: np.ndarray,
                    request_idx: np.ndarray, qo_tile_idx: np.ndarray, *, group_size: int, tile_rows: int,
                    tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's non-empty KV tiles under a host mask: ``(indptr int64 [items + 1], entries int32)``, entry
    ``tile << ENTRY_SHIFT | kind`` (``ENTRY_FULL``, ``ENTRY_BITS`` for PARTIAL, ``ENTRY_CAUSAL``). Items are ``(request_idx, qo_tile_idx)`` over the whole KV of their
    request (unsplit plans); ``request_idx < 0`` is a padding item (no tiles). ``packed``: uint8 bits;
    ``bit_offsets``: int64 ``[batch]`` (``mask_bit_offsets``).

    >>> bits = np.packbits(np.tril(np.ones((4, 4), bool)).ravel(), bitorder="little")  # causal as bits
    >>> mask_tile_lists(bits, [0], [4], [4], [0, 0], [0, 1], group_size=2, tile_rows=4, tile_kv=2)
    (array([0, 1, 3]), array([2, 0, 6], dtype=int32))
    >>> bits = np.packbits((np.tril(np.ones((4, 4), bool)) ^ np.eye(4, k=-1, dtype=bool)).ravel(), bitorder="little")
    >>> mask_tile_lists(bits, [0], [4], [4], [0, 0], [0, 1], group_size=2, tile_rows=4, tile_kv=2)  # not causal
    (array([0, 1, 3]), array([1, 1, 5], dtype=int32))
    """
    packed = np.asarray(packed, np.uint8).reshape(-1)
    offsets = np.asarray(bit_offsets, np.int64)
    qo_lens, kv_lens = np.asarray(qo_lens, np.int64), np.asarray(kv_lens, np.int64)
    request, qo_tile = np.asarray(request_idx, np.int64), np.asarray(qo_tile_idx, np.int64)
    need = int((offsets + qo_lens * kv_lens).max(initial=0))
    if need > packed.size * 8:
        raise PlanError(f"custom_mask: {packed.size} bytes hold {packed.size * 8} bits, the batch needs {need}")
    counter = _BitCounter(packed)
    by_request = np.argsort(request, kind="stable")
    starts = np.searchsorted(request[by_request], np.arange(qo_lens.size + 1))
    items, entries = [], []
    for b in np.flatnonzero(np.diff(starts) * (qo_lens > 0) * (kv_lens > 0)):
        idx = by_request[starts[b]: starts[b + 1]]
        tok_lo, tok_hi = _item_tokens(qo_lens[b] * group_size, qo_tile[idx], group_size, tile_rows)
        classes = _request_classes(counter, int(offsets[b]), int(qo_lens[b]), int(kv_lens[b]), tok_lo, tok_hi,
                                   tile_kv)
        i, j = np.nonzero(classes)
        items.append(idx[i])
        entries.append(j.astype(np.int64) << ENTRY_SHIFT | _ENTRY_KIND[classes[i, j]])
    if not items:
        return np.zeros(request.size + 1, np.int64), np.zeros(0, np.int32)
    return _csr(np.concatenate(items), np.concatenate(entries), request.size)


def dense_tile_lists(kv_lens: np.ndarray, request_idx: np.ndarray, *, tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """Every KV tile of every item, all PARTIAL: the tile lists of a mask the host cannot read (a device mask).

    >>> dense_tile_lists(np.array([130, 0]), np.array([0, 1, -1]), tile_kv=128)
    (array([0, 2, 2, 2]), array([1, 5], dtype=int32))
    """
    request = np.asarray(request_idx, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    counts = np.where(request >= 0, -(-kv[np.maximum(request, 0)] // tile_kv), 0)
    indptr = np.zeros(request.size + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    local = np.arange(indptr[-1]) - np.repeat(indptr[:-1], counts)
    return indptr, (local << ENTRY_SHIFT | ENTRY_BITS).astype(np.int32)


def reorder_tile_lists(indptr: np.ndarray, entries: np.ndarray, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR of items taken in the order ``perm`` (item ``perm[k]`` becomes item ``k``).

    >>> reorder_tile_lists(np.array([0, 1, 3]), np.array([5, 6, 7]), np.array([1, 0]))
    (array([0, 2, 3]), array([6, 7, 5]))
    """
    counts = np.diff(indptr)[perm]
    new = np.zeros(perm.size + 1, np.int64)
    np.cumsum(counts, out=new[1:])
    src = np.repeat(indptr[:-1][perm] - new[:-1], counts) + np.arange(new[-1])
    return new, entries[src]


def _plan_tile_lists(plan, packed: np.ndarray | None, bit_offsets: np.ndarray, kv_lens: np.ndarray,
                     tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile lists of ``plan``'s items over their requests' whole KV: classified under a host mask
    ``packed``, or every tile PARTIAL for a device mask (None)."""
    info, n = plan.info, plan.info.num_items
    request, qo_tile = plan.numpy("request_idx")[:n], plan.numpy("qo_tile_idx")[:n]
    if packed is None:
        return dense_tile_lists(kv_lens, request, tile_kv=tile_kv)
    qo_indptr = plan.numpy("qo_indptr")[: info.batch_size + 1].astype(np.int64)
    return mask_tile_lists(packed, bit_offsets, np.diff(qo_indptr), kv_lens, request, qo_tile,
                           group_size=info.group_size, tile_rows=info.tile_rows, tile_kv=tile_kv)


def plan_mask_tiles(plan, packed: np.ndarray | None, bit_offsets: np.ndarray, kv_lens: np.ndarray, *,
                    tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile lists of an unsplit prefill ``plan``'s items (``plan_prefill(..., enable_split=False)``) under a
    host mask ``packed`` (None: a device mask, every tile PARTIAL), as ``(indptr [capacity + 1], entries)``.

    Re-orders the plan's items in place (host buffer, before its upload) by ascending number of tiles: the
    sm90 kernel takes items from the end of the list, so the longest start first (LPT); padding items stay
    last. Example: a document mask's items have 1 .. 16 tiles (2048-token documents, 128-token tiles).
    """
    info, n = plan.info, plan.info.num_items
    indptr, entries = _plan_tile_lists(plan, packed, bit_offsets, kv_lens, tile_kv)
    order = np.argsort(np.diff(indptr), kind="stable")
    for name in ITEM_FIELDS:
        field = plan.numpy(name)
        field[:n] = field[:n][order]
    indptr, entries = reorder_tile_lists(indptr, entries, order)
    return np.concatenate([indptr, np.full(info.capacity - n, indptr[-1], np.int64)]), entries


def clip_to_chunks(indptr: np.ndarray, entries: np.ndarray, kv_start: np.ndarray, kv_end: np.ndarray, *,
                   tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's list cut to the tiles of its KV chunk ``[kv_start, kv_end)`` (a split-KV plan's items share
    their q tile's classification; each visits only its chunk). Chunk starts are multiples of ``tile_kv``, so
    a tile lies in one chunk.

    >>> clip_to_chunks(np.array([0, 3, 6]), np.array([0, 5, 8, 0, 5, 8]), np.array([0, 128]), np.array([128, 150]),
    ...                tile_kv=64)
    (array([0, 2, 3]), array([0, 5, 8]))
    """
    kv_start, kv_end = np.asarray(kv_start, np.int64), np.asarray(kv_end, np.int64)
    if np.any(kv_start % tile_kv):
        raise PlanError(f"kv_start: chunk starts must be multiples of the KV tile ({tile_kv} tokens)")
    counts = np.diff(indptr)
    item = np.repeat(np.arange(counts.size), counts)
    first = entries.astype(np.int64) >> ENTRY_SHIFT
    keep = (first * tile_kv >= kv_start[item]) & (first * tile_kv < kv_end[item])
    new = np.zeros(counts.size + 1, np.int64)
    np.cumsum(np.bincount(item[keep], minlength=counts.size), out=new[1:])
    return new, entries[keep]


def split_plan_mask_tiles(plan, packed: np.ndarray | None, bit_offsets: np.ndarray, kv_lens: np.ndarray, *,
                          tile_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The tile lists of a (possibly split) prefill ``plan``'s items, each cut to its KV chunk, under a host
    mask ``packed`` (None: a device mask, every tile PARTIAL): ``(indptr int32 [capacity + 1], entries int32)``.
    Items keep their order (the portable kernel's block x runs item ``capacity - 1 - x / H``; padding items get no
    tiles).

    Example: a 16k-token request of 8 causal documents, 32-token q tiles (128 packed rows, group 4) and 64-key
    tiles: an item visits the 1 .. 32 tiles of its own document, one of them PARTIAL (the diagonal).
    """
    info, n = plan.info, plan.info.num_items
    request = plan.numpy("request_idx")[:n]
    indptr, entries = _plan_tile_lists(plan, packed, bit_offsets, kv_lens, tile_kv)
    real = request >= 0
    indptr, entries = clip_to_chunks(indptr, entries, np.where(real, plan.numpy("kv_start")[:n], 0),
                                     np.where(real, plan.numpy("kv_end")[:n], 0), tile_kv=tile_kv)
    padded = np.concatenate([indptr, np.full(info.capacity - n, indptr[-1], np.int64)])
    return padded.astype(np.int32), entries.astype(np.int32)


def tile_list_indptr(kv_start: np.ndarray, kv_end: np.ndarray, tile_kv: int) -> np.ndarray:
    """int32 ``[items + 1]``: where each item's tile lists start in the buffer a tile predicate's pre-pass fills
    (the Hopper prefill with a variant's ``mask_tile``), in units of ``num_kv_heads`` ints. Item ``i`` gets one
    int a kv head more than its KV range ``[kv_start[i], kv_end[i])`` has tiles: the count, then at most that
    many entries (the kernel's range, clipped by causal or a window, never has more). The buffer holds
    ``num_kv_heads * indptr[-1]`` ints; padding items (an empty range) get one a head, never written.

    >>> tile_list_indptr(np.array([0, 0, 0]), np.array([300, 128, 0]), 128).tolist()
    [0, 4, 6, 7]
    """
    sizes = (np.maximum(kv_end - kv_start, 0) + (tile_kv - 1)) // tile_kv + 1
    indptr = np.zeros(sizes.size + 1, np.int64)
    np.cumsum(sizes, out=indptr[1:])
    if indptr[-1] > np.iinfo(np.int32).max:
        raise PlanError(f"kv lengths: the tile lists need {int(indptr[-1])} ints a kv head, more than int32 offsets "
                        "reach; plan fewer or shorter requests at a time")
    return indptr.astype(np.int32)
