"""Custom masks as tile lists (flashgen.plan.mask_tiles) against a brute-force numpy classification, and the
sm90 runner's upload of them read back the way the kernel reads it (CPU only).

Classification cost on the 2-core build box (numpy 2.4): a 16k x 16k mask (32 MB of bits), 512 items of 128
packed rows (group 4), 128-key tiles: 0.09 s (prefix popcounts 0.02 s, 2.1M tile boundaries 0.06 s); packing
a 16k x 16k bool mask to bits (np.packbits) 0.02 s more."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flashgen.api.custom_mask import custom_mask_bits
from flashgen.api.staging import extra_offsets
from flashgen.plan import PlanError, plan_prefill
from flashgen.plan.mask_tiles import (
    ENTRY_BITS, ENTRY_CAUSAL, ENTRY_FULL, ENTRY_SHIFT, TILE_CAUSAL, TILE_FULL, TILE_PARTIAL, clip_to_chunks, dense_tile_lists, mask_bit_offsets, mask_tile_lists, plan_mask_tiles,
    reorder_tile_lists, split_plan_mask_tiles,
)


def pack(masks):
    bits = [np.asarray(m, bool).reshape(-1) for m in masks]
    return np.packbits(np.concatenate(bits) if bits else np.zeros(0, bool), bitorder="little")


def brute_lists(masks, request, qo_tile, group, tile_rows, tile_kv):
    """Per item: [(tile, class)] of its non-empty tiles, by looking at every bit (CAUSAL: a partial tile whose
    bits are key <= query position, queries aligned to the KV end)."""
    out = []
    for b, t in zip(request, qo_tile):
        if b < 0:
            out.append([])
            continue
        m = np.asarray(masks[b], bool)
        qo_len, kv_len = m.shape
        row0 = t * tile_rows
        last = min(row0 + tile_rows, qo_len * group) - 1
        rows = m[row0 // group: last // group + 1]
        causal = causal_bits(qo_len, kv_len)[row0 // group: last // group + 1]
        tiles = []
        for j in range(-(-kv_len // tile_kv)):
            block = rows[:, j * tile_kv: (j + 1) * tile_kv]
            if block.any():
                kind = TILE_FULL if block.all() else TILE_PARTIAL
                if kind == TILE_PARTIAL and np.array_equal(block, causal[:, j * tile_kv: (j + 1) * tile_kv]):
                    kind = TILE_CAUSAL
                tiles.append((j, kind))
        out.append(tiles)
    return out


KIND_CLASS = {ENTRY_FULL: TILE_FULL, ENTRY_BITS: TILE_PARTIAL, ENTRY_CAUSAL: TILE_CAUSAL}


def decode(indptr, entries):
    return [[(int(e) >> ENTRY_SHIFT, KIND_CLASS[int(e) & ((1 << ENTRY_SHIFT) - 1)])
             for e in entries[indptr[i]: indptr[i + 1]]] for i in range(indptr.size - 1)]


def doc_mask(n, docs):
    doc = np.arange(n) * docs // max(n, 1)
    return (doc[:, None] == doc[None, :]) & (np.arange(n)[None, :] <= np.arange(n)[:, None])


def causal_bits(qo_len, kv_len):
    return np.arange(kv_len)[None, :] <= (kv_len - qo_len + np.arange(qo_len))[:, None]


def make_masks(kind, qo_lens, kv_lens, rng):
    shapes = list(zip(qo_lens, kv_lens))
    if kind.startswith("random"):
        density = float(kind[6:])
        return [rng.random(s) < density for s in shapes]
    if kind == "zeros":
        return [np.zeros(s, bool) for s in shapes]
    if kind == "ones":
        return [np.ones(s, bool) for s in shapes]
    if kind == "causal":
        return [causal_bits(a, b) for a, b in shapes]
    if kind == "causal_flip":  # causal but for one bit a 50 rows, next to the diagonal: no tile may pass as CAUSAL
        masks = [causal_bits(a, b) for a, b in shapes]
        for (a, b), m in zip(shapes, masks):
            for r in range(0, a if b else 0, 50):
                m[r, min(max(b - a + r, 0), b - 1)] ^= True
        return masks
    if kind == "doc":  # documents over the KV, causal inside each, the queries being the KV's last tokens
        return [doc_mask(b, 3)[b - a:] if b >= a else np.zeros((a, b), bool) for a, b in shapes]
    if kind == "rows":  # random, with whole rows and whole tiles' columns masked
        masks = [rng.random(s) < 0.6 for s in shapes]
        for m in masks:
            m[::3] = False
            m[:, 64:192] = False
        return masks
    raise ValueError(kind)


QO = [0, 1, 37, 130, 200, 64, 5]
KV = [5, 1, 300, 130, 700, 0, 129]


def items_of(qo_lens, kv_lens, heads, group, tile_kv):
    plan = plan_prefill(np.concatenate([[0], np.cumsum(qo_lens)]), np.asarray(kv_lens), num_qo_heads=heads * group,
                        num_kv_heads=heads, tile_rows=128, kv_granularity=tile_kv, enable_split=False)
    n = plan.info.num_items
    return plan, plan.numpy("request_idx")[:n].copy(), plan.numpy("qo_tile_idx")[:n].copy()


@pytest.mark.parametrize("kind", ["random0.7", "random0.02", "random0.995", "zeros", "ones", "causal", "causal_flip",
                                  "doc", "rows"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("tile_kv", [64, 128])
def test_classification_matches_brute_force(kind, group, tile_kv):
    rng = np.random.default_rng(abs(hash((kind, group, tile_kv))) % 2**32)
    masks = make_masks(kind, QO, KV, rng)
    _, request, qo_tile = items_of(QO, KV, 2, group, tile_kv)
    indptr, entries = mask_tile_lists(pack(masks), mask_bit_offsets(QO, KV), QO, KV, request, qo_tile,
                                      group_size=group, tile_rows=128, tile_kv=tile_kv)
    assert indptr.size == request.size + 1 and entries.dtype == np.int32
    assert decode(indptr, entries) == brute_lists(masks, request, qo_tile, group, 128, tile_kv)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_offsets(seed):
    """Random lengths (not multiples of anything), a mask stream that starts mid-byte, padding items."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 6))
    qo_lens = rng.integers(0, 300, batch)
    kv_lens = rng.integers(0, 500, batch)
    group, tile_kv = int(rng.choice([1, 2, 3, 4, 7, 8])), int(rng.choice([64, 128]))
    masks = [rng.random((a, b)) < rng.choice([0.01, 0.5, 0.99]) for a, b in zip(qo_lens, kv_lens)]
    lead = int(rng.integers(0, 8))
    stream = np.concatenate([np.ones(lead, bool)] + [m.reshape(-1) for m in masks])
    packed = np.packbits(stream, bitorder="little")
    request = np.concatenate([np.repeat(np.arange(batch), -(-(qo_lens * group) // 128)), [-1, -1]])
    qo_tile = np.concatenate([np.concatenate([np.arange(-(-(a * group) // 128)) for a in qo_lens]), [0, 0]])
    indptr, entries = mask_tile_lists(packed, mask_bit_offsets(qo_lens, kv_lens) + lead, qo_lens, kv_lens, request,
                                      qo_tile, group_size=group, tile_rows=128, tile_kv=tile_kv)
    assert decode(indptr, entries) == brute_lists(masks, request, qo_tile, group, 128, tile_kv)


def test_short_mask_is_refused():
    with pytest.raises(PlanError, match="^custom_mask: 1 bytes hold 8 bits, the batch needs 9"):
        mask_tile_lists(np.zeros(1, np.uint8), [0], [3], [3], [0], [0], group_size=1, tile_rows=128, tile_kv=64)


def test_dense_lists_mark_every_tile_partial():
    indptr, entries = dense_tile_lists(np.array([300, 0, 64]), np.array([0, 1, 2, -1, 0]), tile_kv=128)
    assert decode(indptr, entries) == [[(0, 2), (1, 2), (2, 2)], [], [(0, 2)], [], [(0, 2), (1, 2), (2, 2)]]


def test_reorder_keeps_each_items_list():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, 9)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    entries = rng.integers(0, 100, indptr[-1]).astype(np.int32)
    perm = rng.permutation(9)
    new_ptr, new_entries = reorder_tile_lists(indptr, entries, perm)
    for k, i in enumerate(perm):
        assert new_entries[new_ptr[k]: new_ptr[k + 1]].tolist() == entries[indptr[i]: indptr[i + 1]].tolist()


def test_plan_items_are_reordered_longest_last():
    """The kernel takes items from the end of the list: ascending tile counts put the longest first."""
    qo_lens, kv_lens, group = [600, 3, 300], [600, 900, 300], 4
    masks = [causal_bits(a, b) for a, b in zip(qo_lens, kv_lens)]
    plan, request, qo_tile = items_of(qo_lens, kv_lens, 2, group, 128)
    before = brute_lists(masks, request, qo_tile, group, 128, 128)
    indptr, entries = plan_mask_tiles(plan, pack(masks), mask_bit_offsets(qo_lens, kv_lens), np.array(kv_lens),
                                      tile_kv=128)
    n = plan.info.num_items
    counts = np.diff(indptr)
    assert np.all(np.diff(counts[:n]) >= 0)
    after_request, after_tile = plan.numpy("request_idx")[:n], plan.numpy("qo_tile_idx")[:n]
    assert sorted(zip(after_request, after_tile)) == sorted(zip(request, qo_tile))
    assert decode(indptr, entries) == brute_lists(masks, after_request, after_tile, group, 128, 128)
    assert sorted(map(str, before)) == sorted(map(str, decode(indptr, entries)))
    ends = plan.numpy("kv_end")[:n]
    assert ends.tolist() == [kv_lens[b] for b in after_request]  # every item field moved with its item


def test_classification_16k():
    """A 16k x 16k document mask (8 causal documents): 32 MB of bits, classified without a partial tile (its
    time: ``benchmarks/plan_bench.py --mask-tiles``)."""
    n = 16384
    packed = np.packbits(doc_mask(n, 8).reshape(-1), bitorder="little")
    request, qo_tile = np.zeros(512, np.int64), np.arange(512)
    indptr, entries = mask_tile_lists(packed, [0], [n], [n], request, qo_tile, group_size=4, tile_rows=128,
                                      tile_kv=128)
    # per item of 32 tokens: the diagonal tile causal, the document's earlier tiles full: 1 .. 16 tiles
    kinds = entries & ((1 << ENTRY_SHIFT) - 1)
    assert entries.size == 512 * 8.5 and int((kinds == ENTRY_CAUSAL).sum()) == 512 and not (kinds == ENTRY_BITS).any()


# ------------------------------------------------------------------- split plans (the portable kernel)


def split_plan(qo_lens, kv_lens, heads, group, tile_kv, **options):
    return plan_prefill(np.concatenate([[0], np.cumsum(qo_lens)]), np.asarray(kv_lens), num_qo_heads=heads * group,
                        num_kv_heads=heads, tile_rows=128, kv_granularity=tile_kv, num_sms=264, **options)


@pytest.mark.parametrize("kind", ["random0.3", "random0.995", "doc", "causal", "rows", "zeros", "ones"])
@pytest.mark.parametrize("group,tile_kv", [(1, 64), (4, 64), (7, 32)])
def test_split_plan_lists_cover_each_chunk(kind, group, tile_kv):
    """Split-KV items (several chunks of one q tile) visit exactly the non-empty tiles of their own chunk,
    with the classes of the whole q tile; padding items (a CUDA-graph capacity) none."""
    qo_lens, kv_lens = [200, 7, 130, 0], [3000, 40, 1300, 9]
    rng = np.random.default_rng(abs(hash((kind, group))) % 2**32)
    masks = make_masks(kind, qo_lens, kv_lens, rng)
    plan = split_plan(qo_lens, kv_lens, 1, group, tile_kv, max_batch_size=6, max_total_q=400)
    n = plan.info.num_items
    assert plan.numpy("num_chunks")[0] > 1 and plan.info.capacity > n  # split, and padded
    indptr, entries = split_plan_mask_tiles(plan, pack(masks), mask_bit_offsets(qo_lens, kv_lens), np.array(kv_lens),
                                            tile_kv=tile_kv)
    assert indptr.dtype == entries.dtype == np.int32 and indptr.size == plan.info.capacity + 1
    request, qo_tile = plan.numpy("request_idx")[:n], plan.numpy("qo_tile_idx")[:n]
    start, end = plan.numpy("kv_start")[:n], plan.numpy("kv_end")[:n]
    whole = brute_lists(masks, request, qo_tile, group, 128, tile_kv)
    expected = [[(j, c) for j, c in tiles if start[i] <= j * tile_kv < end[i]] for i, tiles in enumerate(whole)]
    got = decode(indptr, entries)
    assert got[:n] == expected and got[n:] == [[]] * (plan.info.capacity - n)
    union = {}
    for i in range(n):  # the chunks of a q tile together list each of its tiles once
        union.setdefault((request[i], qo_tile[i]), []).extend(got[i])
    assert all(union[(request[i], qo_tile[i])] == whole[i] for i in range(n))


def test_split_plan_dense_lists_are_every_chunk_tile():
    """A device mask: every tile of every chunk, all partial, so the kernel skips nothing."""
    qo_lens, kv_lens = [200, 7], [3000, 40]
    plan = split_plan(qo_lens, kv_lens, 1, 4, 64)
    n = plan.info.num_items
    indptr, entries = split_plan_mask_tiles(plan, None, mask_bit_offsets(qo_lens, kv_lens), np.array(kv_lens),
                                            tile_kv=64)
    start, end = plan.numpy("kv_start")[:n], plan.numpy("kv_end")[:n]
    assert decode(indptr, entries) == [[(j, TILE_PARTIAL) for j in range(s // 64, -(-e // 64))]
                                       for s, e in zip(start, end)]


def test_chunks_must_start_on_a_tile():
    with pytest.raises(PlanError, match="^kv_start: chunk starts must be multiples of the KV tile"):
        clip_to_chunks(np.array([0, 1]), np.array([0], np.int32), np.array([32]), np.array([100]), tile_kv=64)


# ------------------------------------------------------------------------- the runner's upload, read back


def kernel_window(mem: np.ndarray, address: int, bit_row: int, t0: int, kv_len: int, tile_kv: int) -> np.ndarray:
    """MaskBits::load / select / visible (custom_mask.cuh) of one row, register by register, for the 4 threads
    of the row: bool [tile_kv], key t0 + k. ``mem``: the bytes from address 0."""
    first, kv_len = int(bit_row) + int(t0), int(kv_len)
    at = address + (first >> 3)
    last = address + ((bit_row + kv_len - 1) >> 3)
    aligned, shift = at & ~3, (at & 3) * 8 + (first & 7)
    words = tile_kv // 32
    raw = [int(mem[aligned + 4 * i: aligned + 4 * i + 4].view("<u4")[0]) if aligned + 4 * i <= last else 0
           for i in range(words + 1)]
    out = np.zeros(tile_kv, bool)
    for q in range(4):
        w = [((raw[i] | raw[i + 1] << 32) >> shift & 0xFFFFFFFF) >> (2 * q) for i in range(words)]
        for i in range(tile_kv // 2):
            if (i // 2) % 2:  # row h = 1 registers: the same bits of another row; one row is enough here
                continue
            key = 8 * (i // 4) + 2 * q + i % 2
            out[key] = (w[i // 16] >> (8 * ((i // 4) % 4) + i % 2)) & 1
    return out


class _Runner:
    """The attributes SM90Prefill._mask_extras reads."""

    def __init__(self, tile_kv, max_batch_size=None):
        self._tile_kv, self.max_batch_size, self._mask_held, self._masks = tile_kv, max_batch_size, None, None


def upload_image(plan, extras):
    """The device plan buffer as HostStaging.upload lays it out (int32)."""
    starts, end = extra_offsets(plan.numel, {k: v.size for k, v in extras.items()})
    image = np.zeros(end + 4, np.int32)  # + the slack a real buffer has after its last 16 bytes
    image[: plan.numel] = plan.host.numpy()
    for name, values in extras.items():
        image[starts[name]: starts[name] + values.size] = values
    return image, starts


def read_back(plan, image, starts, mem, mem_address, qo_lens, kv_lens, group, tile_kv):
    """What the kernel sees: per item, per packed row, the keys it treats as visible (bool [kv_len]); checks
    that list entries ascend and stay inside the request."""
    cap = plan.info.capacity
    tile_indptr = image[starts["tile_indptr"]: starts["tile_indptr"] + cap + 1]
    mask_offset = image[starts["mask_offset"]: starts["mask_offset"] + 2 * len(qo_lens)].view("<i8")
    seen = {}
    for item in range(cap):
        b = int(plan.numpy("request_idx")[item])
        if b < 0:
            assert tile_indptr[item] == tile_indptr[item + 1]
            continue
        qo_len, kv_len = int(qo_lens[b]), int(kv_lens[b])
        entries = image[tile_indptr[item]: tile_indptr[item + 1]]
        assert np.all(np.diff(entries >> ENTRY_SHIFT) > 0) and np.all((entries >> ENTRY_SHIFT) * tile_kv < kv_len)
        row0 = int(plan.numpy("qo_tile_idx")[item]) * 128
        for prow in range(row0, min(row0 + 128, qo_len * group)):
            token = prow // group
            visible = np.zeros(kv_len, bool)
            for e in entries:
                t0, keys = (e >> ENTRY_SHIFT) * tile_kv, min(tile_kv, kv_len - (e >> ENTRY_SHIFT) * tile_kv)
                kind = e & ((1 << ENTRY_SHIFT) - 1)
                if kind == ENTRY_BITS:
                    bits = kernel_window(mem, mem_address, int(mask_offset[b]) + token * kv_len, t0, kv_len, tile_kv)
                    visible[t0: t0 + keys] = bits[:keys]
                elif kind == ENTRY_CAUSAL:  # the kernels' arithmetic mask: key <= the query's position
                    visible[t0: t0 + keys] = np.arange(t0, t0 + keys) <= kv_len - qo_len + token
                else:
                    visible[t0: t0 + keys] = True
            seen[(b, prow)] = visible
    return seen


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("group,tile_kv", [(1, 128), (4, 128), (7, 64)])
def test_runner_upload_is_read_back_as_the_mask(monkeypatch, where, group, tile_kv):
    """SM90Prefill._mask_extras + HostStaging's layout + the kernel's reads give back exactly the mask, for
    host masks (classified, in the plan buffer) and device masks (every tile partial, read in place from an
    address that is not 4-byte aligned)."""
    import flashgen.api.sm90 as sm90
    from flashgen.api.sm90 import SM90Prefill

    rng = np.random.default_rng(group)
    qo_lens, kv_lens = np.array(QO), np.array(KV)
    masks = make_masks("rows", qo_lens, kv_lens, rng)
    masks[2] = doc_mask(300, 3)[300 - 37:]
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    plan = plan_prefill(qo, kv_lens, num_qo_heads=2 * group, num_kv_heads=2, tile_rows=128,
                        kv_granularity=tile_kv, enable_split=False)
    packed = pack(masks)
    custom = packed if where == "host" else None
    runner = _Runner(tile_kv)
    if where == "device":  # custom_mask_bits on a host array, then treated as the device tensor it stands for
        bits = custom_mask_bits(packed, qo, kv_lens)
        monkeypatch.setattr(sm90, "custom_mask_bits", lambda *a: bits._replace(host=None, device=object()))
        extras = SM90Prefill._mask_extras(runner, plan, qo, kv_lens, custom, {"kv_indptr": qo.astype(np.int32)}, None)
        address = 3
        mem = np.zeros(address + packed.size + 4, np.uint8)
        mem[address: address + packed.size] = packed
    else:
        extras = SM90Prefill._mask_extras(runner, plan, qo, kv_lens, custom, {"kv_indptr": qo.astype(np.int32)},
                                          np.arange(5, dtype=np.int32))  # host page ids sit before the lists
        assert list(extras) == ["kv_indptr", "mask_offset", "tile_indptr", "pages", "tiles", "mask"]
    image, starts = upload_image(plan, extras)
    if where == "host":
        mem, address = image.view(np.uint8), 0
    seen = read_back(plan, image, starts, mem, address, qo_lens, kv_lens, group, tile_kv)
    for b, (qo_len, m) in enumerate(zip(qo_lens, masks)):
        for prow in range(qo_len * group):
            assert np.array_equal(seen[(b, prow)], m[prow // group]), (b, prow)


def test_graph_mode_keeps_the_fixed_fields_in_place():
    """CUDA-graph mode: bit offsets and tile_indptr have fixed lengths and places, whatever the batch; the
    lists and bits after them may move (the kernel finds them through those fields)."""
    from flashgen.api.sm90 import SM90Prefill

    runner = _Runner(128, max_batch_size=4)
    layouts = []
    for qo_lens, kv_lens in (([100, 3], [900, 50]), ([1, 1, 1, 300], [1, 2, 3, 300])):
        qo = np.concatenate([[0], np.cumsum(qo_lens)])
        plan = plan_prefill(qo, np.array(kv_lens), num_qo_heads=8, num_kv_heads=2, tile_rows=128,
                            kv_granularity=128, enable_split=False, max_batch_size=4, max_total_q=512)
        masks = [np.random.default_rng(0).random((a, b)) < 0.5 for a, b in zip(qo_lens, kv_lens)]
        extras = SM90Prefill._mask_extras(runner, plan, qo, np.array(kv_lens), pack(masks),
                                          {"kv_indptr": np.zeros(5, np.int32)}, None)
        starts, _ = extra_offsets(plan.numel, {k: v.size for k, v in extras.items()})
        layouts.append({k: (starts[k], extras[k].size) for k in ("kv_indptr", "mask_offset", "tile_indptr")})
        assert starts["tiles"] >= starts["tile_indptr"] + extras["tile_indptr"].size
        image, starts = upload_image(plan, extras)
        seen = read_back(plan, image, starts, image.view(np.uint8), 0, qo_lens, kv_lens, 4, 128)
        for b, m in enumerate(masks):
            for prow in range(qo_lens[b] * 4):
                assert np.array_equal(seen[(b, prow)], m[prow // 4])
    assert layouts[0] == layouts[1]


def test_fixed_buffers_say_what_sized_them():
    """A CUDA-graph wrapper's buffers are sized by its first plan; a later plan that needs more gets an error
    naming the buffer and what to do (a mask's bits and tiles grow with the KV, not with max_batch_size)."""
    from flashgen.api.portable import HOST_ARRAYS_HINT
    import torch

    from flashgen.api.staging import DeviceBuffer

    buf = DeviceBuffer(torch.int32, torch.device("cpu"), fixed=True)
    first = buf.get(10, "plan", HOST_ARRAYS_HINT)
    assert buf.get(7, "plan") is first  # fits: the same memory (a captured graph keeps its address)
    with pytest.raises(PlanError, match=r"^plan: needs 11 elements, more than the 10 .* pass them on the device\)$"):
        buf.get(11, "plan", HOST_ARRAYS_HINT)
    with pytest.raises(PlanError, match=r"\(raise max_batch_size\)$"):
        buf.get(11, "kv_indptr")
    grows = DeviceBuffer(torch.int32, torch.device("cpu"), fixed=False)
    grows.get(10, "tiles")
    assert grows.get(11, "tiles").numel() == 11


def test_entry_encoding_matches_the_kernels_header():
    # the kernels decode entries with templates/include/flashgen/common/tile_entry.cuh: its constants are the planner's
    from flashgen.kernels.render import include_dir
    header = (include_dir() / "flashgen" / "common" / "tile_entry.cuh").read_text()
    line = re.search(r"constexpr int (ENTRY_SHIFT = \d+(?:, ENTRY_\w+ = \d+)*);", header).group(1)
    values = {name: int(v) for name, v in (item.split(" = ") for item in line.split(", "))}
    assert values == {"ENTRY_SHIFT": ENTRY_SHIFT, "ENTRY_FULL": ENTRY_FULL, "ENTRY_BITS": ENTRY_BITS,
                      "ENTRY_CAUSAL": ENTRY_CAUSAL}
