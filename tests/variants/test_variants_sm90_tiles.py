"""The Hopper prefill with a variant's tile predicate (the tile-list pre-pass) against the fp64 reference:
document masks whose boundaries fall inside and on tiles, prefix-LM over NoMask and causal, uneven batches,
ragged, paged by TMA boxes and gathered pages, GQA groups, a sliding window, and a CUDA-graph replay after
re-planning; fresh random inputs, NaN-poisoned outputs, dtype-aware tolerance (test_variants_gpu.py's checks)."""

from __future__ import annotations

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


def _run(name, spelling, layout, mask, qo_lens, kv_lens, group=4, args=None, seed=0):
    spec = AttentionSpec(128 if not isinstance(mask, SlidingWindow) else 64, kv_layout=layout, mask=mask,
                         variant=EXAMPLES[name][spelling])
    g = _generator("sm90_tiles", name, spelling, repr(layout), repr(mask), tuple(qo_lens), group, seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, group, generator=g)
    if args is None:
        args = example_args(name, heads=HEADS * group, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * group, num_kv_heads=HEADS, **_cuda_table(table))
    assert wrapper._impl.tile_lists
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


def test_cuda_graph_replay_after_replanning():
    """A captured run (pre-pass and prefill) replays new batches: the lists' buffer and tile_indptr stay put."""
    name, group = "document_tiled", 4
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=EXAMPLES[name][0])
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
