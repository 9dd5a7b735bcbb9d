"""GPU tests of the Hopper prefill with custom bit masks (planned tile lists: fully masked KV tiles skipped,
fully visible ones unmasked, partial ones masked per element) against the fp64 reference: fresh random inputs,
NaN-poisoned outputs; random, document, causal-as-bits, all-zero and all-one masks, rows that see nothing,
ragged and paged KV, GQA groups 1 / 4 / 7, head_dim 64 / 128 / 256, masks given as bool lists, packed host
bits or packed device bits (read in place, every tile partial), and CUDA-graph replay after re-planning."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, CustomMask, Paged, Ragged
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch
from flashgen.testing.masks import as_form, doc_mask, make_masks
from flashgen.testing.reference import pack_custom_mask
from graph_replay import fill_pools, replay_after_replanning

pytestmark = [pytest.mark.cuda, pytest.mark.hopper]

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5, 129]
KV = [5, 1, 17, 300, 64, 0, 130, 0, 257]

SPECS = [AttentionSpec(d, dtype=dtype, kv_layout=layout, mask=CustomMask())
         for d, dtype, layout in ((128, "bfloat16", Ragged()), (128, "float16", Paged(16)), (64, "bfloat16", Ragged()),
                                  (256, "bfloat16", Ragged()), (256, "float16", Paged(32, "HND")),
                                  (128, "bfloat16", Paged(16, "HND")))]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every variant of this module in parallel up front."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda s: flashgen.ensure_compiled(s, "prefill_sm90"), SPECS))


def run_and_check(spec, qo_lens, kv_lens, num_kv_heads=2, group=4, *, kind="random0.5", form="list", seed=0,
                  poison=None, **runtime):
    gen = torch.Generator().manual_seed(seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, generator=gen)
    if poison is not None:  # K / V rows no row may read (ragged only): NaN shows if a skipped tile is read
        kv = tuple(x.clone() for x in kv)
        for x in kv:
            x[poison] = float("nan")
    masks = make_masks(kind, qo_lens, kv_lens, gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    pages = {k: (v.numpy() if k != "kv_indices" else v) for k, v in table.items()}
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
                 custom_mask=as_form(masks, form), **pages, **runtime)
    q_dev = q.cuda()
    kv_dev = kv.cuda() if isinstance(kv, torch.Tensor) else tuple(x.cuda() for x in kv)
    ref_kv = kv
    if poison is not None:
        ref_kv = tuple(torch.nan_to_num(x, nan=0.0) for x in kv)  # the reference multiplies 0 by every row
    out, lse = check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out, return_lse=True), spec, q, ref_kv,
                               qo_indptr=qo_indptr, custom_mask=masks, **table, **runtime)
    return out.cpu(), lse.cpu(), masks


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.uri)
@pytest.mark.parametrize("kind", ["random0.5", "doc"])
def test_layouts_and_head_dims(spec, kind):
    run_and_check(spec, QO, KV, kind=kind, seed=spec.head_dim)


@pytest.mark.parametrize("kind", ["random0.05", "random0.97", "causal", "zeros", "ones", "empty_rows"])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_mask_kinds_and_groups(kind, group):
    spec = SPECS[0]
    out, lse, masks = run_and_check(spec, QO, KV, group=group, kind=kind, seed=group)
    row = 0
    for m in masks:  # rows that see nothing: out = 0, lse = -inf, whatever else the tile held
        blind = ~m.any(dim=1)
        assert bool((out[row: row + m.shape[0]][blind] == 0).all())
        assert bool(torch.isneginf(lse[row: row + m.shape[0]][blind]).all())
        row += m.shape[0]


@pytest.mark.parametrize("form", ["list", "host", "numpy", "device", "device_unaligned"])
def test_mask_forms(form):
    """Host masks are classified (tiles skipped / unmasked); device masks are read in place, every tile partial."""
    run_and_check(SPECS[1], QO, KV, kind="doc", form=form, seed=7)


@pytest.mark.parametrize("layout", ["ragged", "paged16"])
def test_document_mask_long(layout):
    """Two long requests of 8 causal documents: most items run full tiles and one partial diagonal tile."""
    spec = AttentionSpec(128, kv_layout=Ragged() if layout == "ragged" else Paged(16), mask=CustomMask())
    gen = torch.Generator().manual_seed(11)
    qo_lens, kv_lens = [2048, 1500], [2048, 1700]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, 2, 4, generator=gen)
    masks = [doc_mask(a, b, 8) for a, b in zip(qo_lens, kv_lens)]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    pages = {k: (v.numpy() if k != "kv_indices" else v) for k, v in table.items()}
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, custom_mask=masks, **pages)
    q_dev = q.cuda()
    kv_dev = kv.cuda() if isinstance(kv, torch.Tensor) else tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo_indptr, custom_mask=masks, **table)


def test_fully_masked_tiles_are_never_read():
    """K and V of a KV tile no row sees hold NaN: a tile that were loaded and multiplied (P = 0 times NaN) would
    poison every row of its item."""
    qo_lens, kv_lens = [300], [600]
    poison = slice(128, 256)  # keys 128 .. 255 of the only request: masked for every row by "empty_rows"
    run_and_check(SPECS[0], qo_lens, kv_lens, kind="empty_rows", poison=poison, seed=3)


def test_ragged_rows_past_the_batch_hold_nan():
    """The last tile of a request is FULL (an all-ones mask) but crosses kv_len: rows past it hold NaN."""
    spec = SPECS[0]
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = [70, 3], [100, 37]
    q, (k, v), table = random_batch(spec, qo_lens, kv_lens, 2, 4, generator=gen)
    pad = torch.full((200, *k.shape[1:]), float("nan"), dtype=k.dtype)
    masks = make_masks("ones", qo_lens, kv_lens, gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=8, num_kv_heads=2,
                 custom_mask=masks)
    q_dev, kv_dev = q.cuda(), (torch.cat([k, pad]).cuda(), torch.cat([v, pad]).cuda())
    check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out), spec, q, (k, v), lse=False,
                    qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"], custom_mask=masks)


@pytest.mark.parametrize("case", ["soft_cap", "alibi+soft_cap"])
def test_logits_transforms(case):
    from flashgen import ALiBi

    spec = AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask(), soft_cap=20.0,
                         pos_encoding=ALiBi() if "alibi" in case else None)
    run_and_check(spec, QO, KV, group=7, kind="doc", seed=9)


@pytest.mark.parametrize("form", ["list", "device_fresh"])
def test_cuda_graph_replay_after_replanning(form):
    """Re-planning moves the tile lists and the host bits inside the plan buffer; the graph finds them through
    tile_indptr and the bit offsets, which keep their places. ``device_fresh``: each plan's packed bits come in a
    new device tensor (the last one zeroed); the wrapper copies them into its own buffer, which the graph reads."""
    spec = SPECS[0]
    max_batch, max_q, max_kv, heads, group = 8, 700, 4000, 2, 4
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q)
    assert wrapper.backend == "sm90"
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.zeros(max_kv, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    fresh: list[torch.Tensor] = []  # device_fresh: every plan's mask tensor, kept alive

    def load(qo_lens, kv_lens, seed, kind):
        gen = torch.Generator().manual_seed(seed)
        q, kv, table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=gen)
        masks = make_masks(kind, qo_lens, kv_lens, gen)
        fill_pools(pool_q, pool_kv, q, kv)
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        argument = masks
        if form == "device_fresh":
            for old in fresh:
                old.zero_()  # a mask read in place from an earlier plan's tensor would show
            fresh.append(pack_custom_mask(masks).cuda())
            argument = fresh[-1]
        wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=heads * group,
                     num_kv_heads=heads, custom_mask=argument)
        return q, kv, qo_indptr, table["kv_indptr"], masks

    def check(loaded, out, lse):
        q, kv, qo_indptr, kv_indptr, masks = loaded
        n = q.shape[0]
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                 custom_mask=masks)

    batches = (([300, 1, 0, 64, 5], [3000, 1, 7, 64, 900], "doc"), ([1], [1], "ones"),
               ([100, 3], [2000, 50], "empty_rows"), ([75] * 8, [75] * 8, "random0.05"))
    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check,
                            ([600, 50], [3000, 900], 0, "random0.5"),  # the largest plan first: it sizes the buffers
                            [(qo, kv, seed, kind) for seed, (qo, kv, kind) in enumerate(batches, start=1)])
