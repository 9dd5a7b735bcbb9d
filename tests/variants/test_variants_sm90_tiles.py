"""The Hopper prefill with a variant's tile lists (the pre-pass) against the fp64 reference: by a tile predicate
(document masks whose boundaries fall inside and on tiles, prefix-LM over NoMask and causal) and by the mask hook
alone (the document example, its lists classified on and off, per kv head and shared), uneven batches, ragged,
paged by TMA boxes and gathered pages, GQA groups, a sliding window, and CUDA-graph replays after re-planning;
fresh random inputs, NaN-poisoned outputs, dtype-aware tolerance (test_variants_gpu.py's checks). The lists the
mask hook gives equal a CPU classification of the document mask (an item longer than the pre-pass's chunk of
tiles too) and refine the predicate's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import flashgen
from flashgen.plan.mask_tiles import tile_list_indptr
from flashgen.spec import AttentionSpec, Causal, NoMask, Paged, Ragged, SlidingWindow
from flashgen.testing.check import nan_out
from flashgen.testing.layouts import random_batch
from flashgen.testing.variants import example_args
from flashgen.variants.examples import EXAMPLES
from graph_replay import fill_pools
from test_variants_gpu import _check, _cuda_table, _generator, _gpu, _to_cuda

pytestmark = pytest.mark.cuda
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU", allow_module_level=True)

HEADS = 2
# (qo_lens, kv_lens): an uneven batch with a one-token request, a request longer than many tiles, an empty KV tail
LENS = [([1, 700, 40, 300], [5, 2100, 40, 300]), ([1000], [1000])]


def _doc_ids(lengths, total):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:total].int()


def _run(name, spelling, layout, mask, qo_lens, kv_lens, group=4, args=None, seed=0, variant=None):
    """``variant``: in place of the example's (checked against the example's reference)."""
    variant = variant or EXAMPLES[name][spelling]
    spec = AttentionSpec(128 if not isinstance(mask, SlidingWindow) else 64, kv_layout=layout, mask=mask,
                         variant=variant)
    g = _generator("sm90_tiles", name, spelling, repr(layout), repr(mask), tuple(qo_lens), group, seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, group, generator=g)
    if args is None:
        args = example_args(name, heads=HEADS * group, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * group, num_kv_heads=HEADS, **_cuda_table(table))
    assert wrapper._impl.tile_lists is variant.classify_tiles
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, qo_lens, out, lse)
    return wrapper


@pytest.mark.parametrize("layout", [Ragged(), Paged(16), Paged(128), Paged(5)], ids=repr)
@pytest.mark.parametrize("spelling", [0, 1])
@pytest.mark.parametrize("lens", LENS)
def test_document_tiled(layout, spelling, lens):
    """Random documents of 1 .. 150 tokens: boundaries inside tiles and whole tiles inside one document."""
    _run("document_tiled", spelling, layout, Causal(), *lens)


@pytest.mark.parametrize("doc_len", [128, 1024, 100])
def test_document_tiled_on_and_off_tile_boundaries(doc_len):
    qo_lens, kv_lens = [2048], [2048]
    lengths = [doc_len] * (2048 // doc_len + 1)
    _run("document_tiled", 0, Ragged(), Causal(), qo_lens, kv_lens, args={"doc_ids": _doc_ids(lengths, 2048)})


@pytest.mark.parametrize("group", [1, 3, 8])
def test_document_tiled_groups_and_a_window(group):
    _run("document_tiled", 1, Ragged(), Causal(), [1, 700, 40], [5, 2100, 40], group=group)
    _run("document_tiled", 0, Paged(16), SlidingWindow(300), [1, 700, 40], [5, 2100, 40], group=group)


@pytest.mark.parametrize("layout", [Ragged(), Paged(16), Paged(5)], ids=repr)
@pytest.mark.parametrize("mask", [NoMask(), Causal()], ids=repr)
@pytest.mark.parametrize("spelling", [0, 1])
def test_prefix_lm(layout, mask, spelling):
    for lens in LENS:
        _run("prefix_lm", spelling, layout, mask, *lens)
    qo_lens, kv_lens = [300, 1, 900], [300, 64, 900]  # prefixes 0, inside a tile, on a tile, the whole request
    for prefix in ([0, 1, 128], [37, 64, 900]):
        _run("prefix_lm", spelling, layout, mask, qo_lens, kv_lens, args={"prefix_len": torch.tensor(prefix).int()})


def test_the_lists_skip_empty_tiles():
    """1k-token documents at 4096: the pre-pass keeps far fewer tiles than the causal range has."""
    wrapper = _run("document_tiled", 0, Ragged(), Causal(), [4096], [4096],
                   args={"doc_ids": _doc_ids([1024] * 4, 4096)})
    torch.cuda.synchronize()
    impl, plan = wrapper._impl, wrapper._impl.last_plan
    lists = impl._tile_buffer.tensor.cpu().numpy()
    starts = tile_list_indptr(plan.numpy("kv_start"), plan.numpy("kv_end"), 128)
    items = np.flatnonzero(plan.numpy("request_idx") >= 0)
    kept = [int(lists[starts[i] * HEADS + h * (starts[i + 1] - starts[i])]) for i in items for h in range(HEADS)]
    # an item is 128 packed rows, 128 // group tokens of one document (group 4: 32 tokens); it keeps the 128-key
    # tiles from its document's first to its own last token (1 .. 8; the causal range would be 1 .. 32)
    rows = plan.numpy("qo_tile_idx")[items].astype(np.int64) * 128
    first, last = rows // 4, np.minimum((rows + 127) // 4, 4095)
    assert (first // 1024 == last // 1024).all()
    expected = last // 128 - (first // 1024) * 8 + 1
    assert kept == [int(n) for n in expected for _ in range(HEADS)]
    assert sum(kept) == HEADS * 4 * 4 * 36  # a document: 32 items keeping 4 x (1 + ... + 8) tiles


# the document mask by its hook alone: off, on (one list for every kv head: the hook names no head), and on per kv
# head (the same mask spelled with a head, so that the pre-pass classifies each kv head's rows)
DOC_OFF = dataclasses.replace(EXAMPLES["document"][0], classify_tiles=False)
DOC_HEADS = flashgen.Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx] || qo_head < 0;",
                             tensors=[("doc_ids", "int32", 1)])
DOC_HOOK = {"off": DOC_OFF, "traced": EXAMPLES["document"][0], "cuda": EXAMPLES["document"][1], "heads": DOC_HEADS}


@pytest.mark.parametrize("layout", [Ragged(), Paged(16), Paged(5)], ids=repr)
@pytest.mark.parametrize("mask", [NoMask(), Causal()], ids=repr)
@pytest.mark.parametrize("how", list(DOC_HOOK))
def test_document_classified_by_its_mask_hook(layout, mask, how):
    for lens in LENS:
        _run("document", 0, layout, mask, *lens, variant=DOC_HOOK[how])
    qo_lens, kv_lens = [2048], [2048]  # documents on and off tile boundaries
    for doc_len in (128, 100):
        args = {"doc_ids": _doc_ids([doc_len] * (2048 // doc_len + 1), 2048)}
        _run("document", 0, layout, mask, qo_lens, kv_lens, args=args, variant=DOC_HOOK[how])


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("how", ["traced", "heads"])
def test_document_by_its_hook_groups_and_a_window(group, how):
    _run("document", 0, Ragged(), Causal(), [1, 700, 40], [5, 2100, 40], group=group, variant=DOC_HOOK[how])
    _run("document", 0, Paged(16), SlidingWindow(300), [1, 700, 40], [5, 2100, 40], group=group,
         variant=DOC_HOOK[how])


def _lists(wrapper):
    """{(q tile, kv head): {tile: kind}} of the wrapper's last run of one request (after a sync)."""
    torch.cuda.synchronize()
    impl, plan = wrapper._impl, wrapper._impl.last_plan
    lists = impl._tile_buffer.tensor.cpu().numpy()
    starts = tile_list_indptr(plan.numpy("kv_start"), plan.numpy("kv_end"), 128)
    out = {}
    for i in np.flatnonzero(plan.numpy("request_idx") >= 0):
        for h in range(HEADS):
            at = starts[i] * HEADS + h * (starts[i + 1] - starts[i])
            out[int(plan.numpy("qo_tile_idx")[i]), h] = {int(e) >> 2: int(e) & 3
                                                         for e in lists[at + 1: at + 1 + lists[at]]}
    return out


def _document_classes(ids, first, last, n, causal):
    """{tile: kind} of the document mask's tiles of 128 keys for queries first .. last of one request of n tokens,
    over the pairs the prefill visits (keys <= the query under causal): ENTRY_FULL (0) where every pair is kept,
    ENTRY_BITS (1) where some are, none where no pair is kept."""
    expected = {}
    kv_hi = last + 1 if causal else n
    for t in range(-(-kv_hi // 128)):
        keys = np.arange(t * 128, min(t * 128 + 128, kv_hi))
        q = np.arange(first, last + 1)[:, None]
        seen = (keys[None, :] <= q) if causal else np.ones((q.size, keys.size), bool)
        keep = ids[q] == ids[keys][None, :]
        if (keep & seen).any():
            expected[t] = 0 if keep[seen].all() else 1
    return expected


@pytest.mark.parametrize("how", ["traced", "heads"])
@pytest.mark.parametrize("mask", [NoMask(), Causal()], ids=repr)
def test_the_hook_lists_are_exact_and_refine_the_predicate(how, mask):
    """One request of random documents (1 .. 150 tokens) and of 1k-token ones: each item's list from the mask hook
    equals a CPU classification of the pairs the prefill visits; against document_tiled's predicate it keeps
    no tile the predicate skips, calls full every tile the predicate does, and may call full or skip a tile the
    predicate calls partial (the predicate sees the whole rectangle, the hook the pairs under the causal mask)."""
    group, n = 4, 3000
    g = _generator("hook_lists", how, repr(mask))
    for doc_ids in (example_args("document_tiled", heads=HEADS * group, max_kv=n, batch=1, generator=g)["doc_ids"],
                    _doc_ids([1024] * 3, n)):
        args = {"doc_ids": doc_ids}
        hook = _lists(_run("document", 0, Ragged(), mask, [n], [n], args=args, variant=DOC_HOOK[how]))
        pred = _lists(_run("document_tiled", 0, Ragged(), mask, [n], [n], args=args))
        assert hook.keys() == pred.keys()
        ids = doc_ids.numpy()
        for (item, h), tiles in hook.items():  # item: the q tile, 128 packed rows of 128 // group tokens
            first, last = item * 128 // group, min((item * 128 + 127) // group, n - 1)
            assert tiles == _document_classes(ids, first, last, n, isinstance(mask, Causal)), (item, h)
            for t, kind in pred[item, h].items():
                assert t in tiles or kind == 1
                assert kind == 1 or tiles[t] == 0
            assert tiles.keys() <= pred[item, h].keys()


@pytest.mark.parametrize("how", ["traced", "heads"])
def test_the_hook_lists_of_an_item_longer_than_a_chunk(how):
    """One query against 140k keys of 300-token runs of three document ids: the pre-pass's CTA classifies the item's
    1094 tiles in two chunks (HOOK_CHUNK_TILES = 1024), full, partial and empty ones in each; its lists equal a
    CPU classification, its output the reference."""
    n = 140_000
    doc_ids = (torch.arange(n) // 300 % 3).int()
    hook = _lists(_run("document", 0, Ragged(), Causal(), [1], [n], args={"doc_ids": doc_ids}, variant=DOC_HOOK[how]))
    expected = _document_classes(doc_ids.numpy(), n - 1, n - 1, n, causal=True)
    assert len(expected) > 1024 // 3 and set(expected.values()) == {0, 1} and max(expected) > 1024
    assert hook == {(0, h): expected for h in range(HEADS)}


def test_cuda_graph_replay_after_replanning():
    """A captured run (pre-pass and prefill) replays new batches: the lists' buffer and tile_indptr stay put."""
    _replay("document_tiled", EXAMPLES["document_tiled"][0])


@pytest.mark.parametrize("how", ["off", "traced", "heads"])
def test_cuda_graph_replay_of_the_hook_lists(how):
    _replay("document", DOC_HOOK[how])


def _replay(name, variant):
    group = 4
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=variant)
    max_batch, max_q, max_kv = 4, 2400, 2400
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q)
    assert wrapper.backend == "sm90"
    pool_q = torch.zeros(max_q, HEADS * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.zeros(max_kv, HEADS, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    doc_ids = torch.zeros(max_kv, dtype=torch.int32, device="cuda")
    g = _generator("sm90_tiles_graph")

    def load(qo_lens, kv_lens):
        q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, group, generator=g)
        args = example_args(name, heads=HEADS * group, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
        fill_pools(pool_q, pool_kv, q, kv)
        doc_ids[: args["doc_ids"].numel()].copy_(args["doc_ids"])
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=HEADS * group,
                     num_kv_heads=HEADS)
        return q, kv, table, args, qo_lens

    load([2000, 400], [2000, 400])  # the most KV tiles first: it sizes the lists' buffer
    run = lambda: wrapper.run(pool_q, pool_kv, return_lse=True, doc_ids=doc_ids)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for lens in (([1, 700, 40, 300], [5, 1200, 40, 300]), ([1], [1]), ([1000, 1000], [1000, 1000])):
        q, kv, table, args, qo_lens = load(*lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = q.shape[0]
        _check(name, spec, args, q, kv, table, qo_lens, out[:n], lse[:n])
