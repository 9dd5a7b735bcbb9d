"""The split-KV policy: how long a KV chunk is, and when the last wave's items are split.

Small pure functions, each with a worked example that runs as a doctest. The planning paths
(``split_kv._plan_general``, the reference, and the fast paths) apply them; ``SplitPolicy`` bundles the two
choices a caller may replace (``plan_split_kv(..., split_policy=SplitPolicy(candidates=...))``).

The cost model: an item (one qo tile's KV chunk, run once per kv head) costs its KV length plus
``item_overhead`` tokens (its start, prologue, partial write and merge). CTAs run in waves of ``num_sms``
slots; a schedule whose items are at most ``longest`` tokens takes about ``waves * longest``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .host import PlanError


def default_tile_rows(max_packed_rows: int) -> int:
    """Packed q rows per tile: 16 (decode, one m16 mma tile), 64, or 128 for long prefill.

    >>> default_tile_rows(7), default_tile_rows(40), default_tile_rows(1000)
    (16, 64, 128)
    """
    return 16 if max_packed_rows <= 16 else 64 if max_packed_rows <= 64 else 128


def split_candidates(max_len: int, work: int, num_kv_heads: int, num_sms: int, granularity: int) -> list[int]:
    """Chunk lengths to try (multiples of ``granularity``, longest first) for a batch whose longest request
    has ``max_len`` KV tokens and whose tiles hold ``work`` KV tokens in all (per kv head).

    ``s0`` splits make the longest request's chunks as long as a perfectly balanced SM's share of the work;
    the candidates split it 1, ``s0 - 2 .. s0 + 2``, and ``2, 4, 8 x s0`` times (for batches whose short items
    already fill waves, finer chunks of the long ones pack better).

    48 qo tiles of one 4096-token request on 108 SMs: a balanced SM's share is 48 * 4096 // 108 = 1820 tokens,
    so s0 = 3, and the splits 1, 1-5, 6, 12, 24 give:

    >>> split_candidates(4096, 48 * 4096, 1, 108, 16)
    [4096, 2048, 1376, 1024, 832, 688, 352, 176]
    """
    per_sm = work * num_kv_heads // num_sms
    s0 = -(-max_len // (per_sm if per_sm > granularity else granularity))
    # s splits: chunks of ceil(max_len / s) = -(max_len // -s) tokens, rounded up to a multiple of granularity
    return sorted({max_len // -s // granularity * -granularity
                   for s in (1, s0 - 2, s0 - 1, s0, s0 + 1, s0 + 2, 2 * s0, 4 * s0, 8 * s0) if s > 0}, reverse=True)


def pick_chunk(chunk: list[int], counted: list, empty: int, max_len: int, work: int, num_kv_heads: int,
               num_sms: int, item_overhead: int, max_items: int | None) -> tuple[int, int]:
    """``(index, items)`` of the candidate chunk with the smallest estimated time.

    ``counted[i]``: the items (qo tiles x chunks) of candidate ``chunk[i]`` but ``empty`` more. The estimate
    is ``waves * longest`` with ``longest = min(chunk, max_len) + item_overhead`` and ``waves =
    ceil((work + items * item_overhead) * num_kv_heads / (num_sms * longest))``; a candidate within 1 % of the
    best so far loses to it (the longer chunk: fewer items, less merging). ``max_items`` (a CUDA-graph plan's
    capacity) rules out candidates with more items; when it rules out all of them, ``PlanError``.

    48 tiles of 4096 tokens on 108 SMs (see ``split_candidates``): unsplit, 48 items take one wave of 4160;
    2 splits, 96 items take one wave of 2112 (96 / 108 = 0.89 of the SMs busy); 3 splits, 144 items take two
    waves of 1440 = 2880 (144 / 216 = 0.67); 4 splits, 192 items two waves of 1088 = 2176. 2 splits win:

    >>> pick_chunk([4096, 2048, 1376, 1024], [48, 96, 144, 192], 0, 4096, 48 * 4096, 1, 108, 64, None)
    (1, 96)
    >>> pick_chunk([4096, 2048, 1376, 1024], [48, 96, 144, 192], 0, 4096, 48 * 4096, 1, 108, 64, 64)
    (0, 48)
    """
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


def choose_kv_chunk(kv_lens: np.ndarray, qo_tiles: np.ndarray, num_kv_heads: int, *, num_sms: int = 132,
                    granularity: int = 16, item_overhead: int = 64, max_items: int | None = None) -> int:
    """The KV chunk length (tokens, a multiple of ``granularity``) for a batch: of the ``split_candidates``,
    the one ``pick_chunk`` estimates fastest. ``kv_lens [batch]`` and ``qo_tiles [batch]`` (qo tiles per
    request) are int numpy arrays; ``max_items`` caps the number of items (a CUDA-graph plan's capacity).

    FA3's example, 48 qo tiles of one 4096-token request, 1 kv head, 108 SMs: 2 splits (see ``pick_chunk``).
    A mixed decode batch, 255 requests of 100 tokens and one of 8000, 8 kv heads, 132 SMs: only the long
    request splits, into 8 chunks of 1008 tokens, and the estimate drops from 8064 (unsplit) to 3216.

    >>> choose_kv_chunk(np.array([4096]), np.array([48]), 1, num_sms=108)
    2048
    >>> choose_kv_chunk(np.array([100] * 255 + [8000]), np.ones(256, int), 8)
    1008
    """
    return choose_split(kv_lens, qo_tiles, num_kv_heads, num_sms, granularity, item_overhead, max_items)[0]


def choose_split(kv_lens, qo_tiles, num_kv_heads, num_sms, granularity, item_overhead, max_items, max_len=None,
                 candidates=split_candidates):
    """``choose_kv_chunk`` with what a plan needs besides: ``(kv_chunk, chunks, items)``, ``chunks`` the
    chunk count of every request (float64, requests without queries counted too) or None when no request is
    longer than ``granularity``. ``qo_tiles`` None: one tile a request (decode), whose caller may pass
    ``max_len = kv_lens.max()``. ``candidates``: the policy's ``split_candidates``.

    Decode requests of 100 and 3000 tokens, 8 kv heads, 132 SMs: the long one splits into 16 chunks of 192
    tokens (17 items, 136 CTAs: one wave), the short one stays whole:

    >>> choose_split(np.array([100, 3000]), None, 8, 132, 16, 64, None)
    (192, array([ 1., 16.]), 17)
    """
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
    chunk = candidates(max_len, work, num_kv_heads, num_sms, granularity)
    nchunks = lens / np.array(chunk, np.float64)[:, None]
    np.ceil(nchunks, out=nchunks)
    if qo_tiles is None:
        counted = np.add.reduce(nchunks, axis=1).tolist()
        # chunk[0] >= max_len counts the non-empty requests; an empty one still has a chunk
        empty = kv_lens.size - int(counted[0])
    else:
        counted, empty = (nchunks @ qo_tiles).tolist(), 0
    at, n = pick_chunk(chunk, counted, empty, max_len, work, num_kv_heads, num_sms, item_overhead, max_items)
    counts = nchunks[at]
    return chunk[at], (np.maximum(counts, 1) if empty else counts), n


def fills_waves(work: int, num_kv_heads: int, num_sms: int, max_len: int, split_min_waves: float | None) -> bool:
    """Whether a batch is left unsplit because its ``work`` (KV tokens over its tiles) fills the ``num_sms``
    slots ``split_min_waves`` times over with its longest request's KV (``max_len``): there, chunks' partial
    writes, merges and extra CTA starts cost more than the balance gains (the portable prefill on 1 x 8192 +
    31 x 256 tokens, 8 such waves: unsplit ran 1.08x the 3-chunk split without a mask, 1.17x causal, whose
    chunks past the diagonal still start, write and merge). ``None``: never.

    That batch with 32 q / 8 kv heads and 128-row tiles (32 tokens): 256 tiles of 8192 KV tokens and 31 x 8
    of 256, 8 waves of 8192 on 264 slots; one request of 512 tokens (16 tiles) fills half of one:

    >>> fills_waves(256 * 8192 + 31 * 8 * 256, 8, 264, 8192, 2.0), fills_waves(16 * 512, 8, 264, 512, 2.0)
    (True, False)
    """
    return split_min_waves is not None and work * num_kv_heads >= split_min_waves * num_sms * max_len


# A CTA alone on an SM runs this much faster than one of two sharing it (the portable prefill at 4 x 4096,
# clock64 stamps: 124 against 172 us): what a half-empty last wave still gets done
ALONE_SPEEDUP = 1.39


def wave_time(pieces: int, work: float, slots: int) -> float:
    """Time of ``pieces`` of ``work`` each, started together on ``slots`` (two an SM): full rounds, then a last
    round that runs at shared speed when it fills more than half the slots, else mostly alone.

    136 CTAs of 4160 tokens on 264 slots fill more than half of them (shared speed); 100 CTAs run mostly
    alone; 5 chunks of each of the 136 (680 CTAs of 960 tokens) take two full rounds and a shared third:

    >>> wave_time(136, 4160, 264), round(wave_time(100, 4160, 264)), wave_time(680, 4160 / 5 + 128, 264)
    (4160, 2993, 2880.0)
    """
    rounds, left = divmod(pieces, slots)
    return rounds * work + (0.0 if left == 0 else work if 2 * left > slots else work / ALONE_SPEEDUP)


def choose_tail_split(item_len: float, num_items: int, num_kv_heads: int, *, num_sms: int, granularity: int,
                      item_overhead: int = 64, max_extra: int | None = None) -> tuple[int, int] | None:
    """``(m, k)``: split the ``m`` items the grid runs last into ``k`` KV chunks each, or None.

    For an unsplit plan of ``num_items`` items of about ``item_len`` KV tokens, run once for each kv head on
    ``num_sms`` slots (CTAs that run at once): the full waves leave ``r = num_items * num_kv_heads % num_sms``
    CTAs for a last wave that runs partly empty (the CTAs of a tile are its kv heads, so ``m = ceil(r /
    num_kv_heads)`` items). Splitting those items into ``k`` chunks (each paying ``2 * item_overhead`` tokens:
    its start and its partial's write and merge) spreads that wave over every slot. ``k`` minimises the wave's
    time (``wave_time``); the split is taken when it saves at least 3 % of it and its chunks keep
    ``granularity`` tokens. ``max_extra`` caps the items added (a fixed-capacity plan's spare slots).

    4 x 4096 tokens, 32 / 8 heads, d128 (128-row tiles, 264 slots): 512 items are 4096 CTAs, 15 full waves and
    136 CTAs left, 17 items. Unsplit, that wave takes 4160 (more than half the slots: shared speed); its items
    in 2 chunks take 3796, in 3 chunks 3029, in 5 chunks 2880, the least of k = 2 .. 8:

    >>> choose_tail_split(4096, 512, 8, num_sms=264, granularity=64)
    (17, 5)
    >>> choose_tail_split(4096, 528, 8, num_sms=264, granularity=64) is None  # whole waves
    True
    >>> choose_tail_split(4096, 512, 8, num_sms=264, granularity=64, max_extra=40)  # 2 spare slots an item
    (17, 3)
    """
    ctas = num_items * num_kv_heads
    if ctas <= num_sms or item_len < 2 * granularity:
        return None
    r = ctas % num_sms
    if r == 0:
        return None
    m = -(-r // num_kv_heads)
    work = item_len + item_overhead
    best, best_time = None, wave_time(m * num_kv_heads, work, num_sms)
    for k in range(2, 9):
        if item_len / k < granularity or (max_extra is not None and m * (k - 1) > max_extra):
            break
        t = wave_time(m * num_kv_heads * k, work / k + 2 * item_overhead, num_sms)
        if t < 0.97 * best_time:
            best, best_time = (m, k), t
    return best


@dataclass(frozen=True)
class SplitPolicy:
    """The replaceable parts of the split policy, for experiments: ``candidates(max_len, work, num_kv_heads,
    num_sms, granularity) -> [chunk, ...]`` (as ``split_candidates``; ``pick_chunk`` chooses among them) and
    ``tail_split(item_len, num_items, num_kv_heads, *, num_sms, granularity, item_overhead, max_extra) ->
    (m, k) | None`` (as ``choose_tail_split``). Pass one as ``split_policy=`` to the planners.

    >>> from flashgen.plan import plan_prefill
    >>> forced = SplitPolicy(candidates=lambda *args: [2048])
    >>> plan_prefill([0, 512], [8192], num_qo_heads=8, num_kv_heads=8, split_policy=forced).info.kv_chunk
    2048
    """

    candidates: Callable[[int, int, int, int, int], list[int]] = split_candidates
    tail_split: Callable[..., tuple[int, int] | None] = choose_tail_split


DEFAULT_SPLIT_POLICY = SplitPolicy()
