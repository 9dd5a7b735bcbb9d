"""GPU tests of the portable prefill (``backend="portable"``, mma.sync) with custom bit masks as planned tile
lists: fully masked KV tiles are never loaded, fully visible ones run without the element mask, partial ones
masked per element; split-KV items visit only their chunk's tiles. Against the fp64 reference on fresh random
inputs with NaN-poisoned outputs: random masks of low and high density, block masks (EMPTY, FULL and PARTIAL
tiles side by side), document masks, all-zero and all-one masks, rows that see nothing, GQA groups 1 / 4 / 7,
ragged and paged KV, head_dim 64 / 128 / 256, host and device masks, split vs unsplit plans, NaN in K / V of
fully masked tiles, and CUDA-graph replay after re-planning with other masks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import ALiBi, AttentionSpec, CustomMask, Paged, Ragged, RoPE
from flashgen.plan import PlanError
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch
from flashgen.testing.masks import as_form, doc_mask, make_masks
from flashgen.testing.reference import pack_custom_mask
from graph_replay import fill_pools, replay_after_replanning

pytestmark = pytest.mark.cuda

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, 32/64-key tile edges +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5, 129]
KV = [5, 1, 17, 300, 64, 0, 130, 0, 257]

SPECS = [AttentionSpec(d, dtype=dtype, kv_layout=layout, mask=CustomMask())
         for d, dtype, layout in ((128, "bfloat16", Ragged()), (128, "float16", Paged(16)), (64, "bfloat16", Ragged()),
                                  (256, "bfloat16", Ragged()), (256, "float16", Paged(16, "HND")))]
EXTRA = [AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask(), soft_cap=20.0, pos_encoding=ALiBi()),
         AttentionSpec(128, kv_layout=Ragged(), dtype="float16", mask=CustomMask(), pos_encoding=RoPE())]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every variant of this module in parallel up front."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda s: flashgen.ensure_compiled(s, "prefill"), SPECS + EXTRA))


def plan_and_run(spec, q, kv, table, qo_indptr, num_kv_heads, mask, *, ref_kv=None, ref_mask=None, enable_split=True,
                 **runtime):
    """Plan with ``mask`` (any form), run over ``kv`` into NaN-poisoned out / lse and check against the fp64
    reference over ``ref_kv`` and ``ref_mask`` (default: ``kv``, ``mask``). Returns out and lse on the CPU and
    the largest chunk count of a request."""
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="portable")
    assert wrapper.backend == "portable"
    pages = {k: (v.numpy() if k != "kv_indices" else v.cuda()) for k, v in table.items()}
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, custom_mask=mask,
                 enable_split=enable_split, **pages, **runtime)
    q_dev = q.cuda()
    kv_dev = kv.cuda() if isinstance(kv, torch.Tensor) else tuple(x.cuda() for x in kv)
    out, lse = check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out, return_lse=True), spec, q,
                               kv if ref_kv is None else ref_kv, qo_indptr=qo_indptr,
                               custom_mask=mask if ref_mask is None else ref_mask, **table, **runtime)
    plan = wrapper._impl.last_plan
    return out.cpu(), lse.cpu(), int(plan.numpy("num_chunks")[: len(qo_indptr) - 1].max(initial=0))


def check_blind_rows(masks, out, lse):
    """Rows that see nothing: out = 0, lse = -inf, whatever else their tiles held."""
    row = 0
    for m in masks:
        blind = ~m.any(dim=1)
        assert bool((out[row: row + m.shape[0]][blind] == 0).all())
        assert bool(torch.isneginf(lse[row: row + m.shape[0]][blind]).all())
        row += m.shape[0]


def run_and_check(spec, qo_lens, kv_lens, num_kv_heads=2, group=4, *, kind="random0.5", form="list", seed=0,
                  poison=(), enable_split=True, **runtime):
    """One plan and run against the reference; ``poison``: slices of ragged K / V rows set to NaN (rows no
    query may see: a kernel that loads and multiplies them by P = 0 gets NaN)."""
    gen = torch.Generator().manual_seed(seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, generator=gen)
    masks = make_masks(kind, qo_lens, kv_lens, gen)
    run_kv, ref_kv = kv, kv
    if poison:
        run_kv = tuple(x.clone() for x in kv)
        for x in run_kv:
            for rows in poison:
                x[rows] = float("nan")
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    out, lse, chunks = plan_and_run(spec, q, run_kv, table, qo_indptr, num_kv_heads, as_form(masks, form),
                                    ref_kv=ref_kv, ref_mask=masks, enable_split=enable_split, **runtime)
    return out, lse, masks, chunks


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.uri)
@pytest.mark.parametrize("kind", ["random0.5", "doc", "blocks"])
def test_layouts_and_head_dims(spec, kind):
    run_and_check(spec, QO, KV, kind=kind, seed=spec.head_dim)


@pytest.mark.parametrize("kind", ["random0.05", "random0.97", "blocks", "causal", "zeros", "ones", "empty_rows"])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_mask_kinds_and_groups(kind, group):
    out, lse, masks, _ = run_and_check(SPECS[0], QO, KV, group=group, kind=kind, seed=group)
    check_blind_rows(masks, out, lse)


@pytest.mark.parametrize("form", ["list", "host", "numpy", "device", "device_unaligned"])
@pytest.mark.parametrize("spec", [SPECS[1], SPECS[3]], ids=lambda s: s.uri)
def test_mask_forms(form, spec):
    """Host masks are classified (tiles skipped / unmasked); device masks are read in place, every tile partial."""
    run_and_check(spec, QO, KV, kind="blocks", form=form, seed=7)


@pytest.mark.parametrize("spec", EXTRA, ids=lambda s: s.uri)
def test_logits_transforms_and_rope(spec):
    """ALiBi and soft-cap on FULL tiles (no element mask) and PARTIAL ones; RoPE rotates K at the listed tiles'
    positions."""
    run_and_check(spec, QO, KV, group=7, kind="blocks", seed=9)


@pytest.mark.parametrize("kind", ["doc", "blocks", "random0.05", "empty_rows"])
@pytest.mark.parametrize("form", ["host", "device"])
def test_split_and_unsplit_agree(kind, form):
    """A long KV split into chunks: each chunk's items visit only their own listed tiles; the merged result
    matches the unsplit plan's and the reference."""
    spec, qo_lens, kv_lens = SPECS[1], [200, 7], [6000, 40]
    split = run_and_check(spec, qo_lens, kv_lens, 1, 4, kind=kind, form=form, seed=3)
    whole = run_and_check(spec, qo_lens, kv_lens, 1, 4, kind=kind, form=form, seed=3, enable_split=False)
    assert split[3] > 1 and whole[3] == 1, (split[3], whole[3])
    torch.testing.assert_close(split[0].float(), whole[0].float(), atol=2e-2, rtol=0)
    check_blind_rows(split[2], split[0], split[1])


@pytest.mark.parametrize("layout", ["ragged", "paged16"])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_document_mask_long(layout, group):
    """Long requests of 8 causal documents: most items run FULL tiles of their own document and one PARTIAL
    diagonal tile; the other documents' tiles are skipped."""
    spec = AttentionSpec(128, kv_layout=Ragged() if layout == "ragged" else Paged(16), mask=CustomMask())
    gen = torch.Generator().manual_seed(11 + group)
    qo_lens, kv_lens = [2048, 1500, 700], [2048, 1700, 700]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, 2, group, generator=gen)
    masks = [doc_mask(a, b, 8) for a, b in zip(qo_lens, kv_lens)]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    plan_and_run(spec, q, kv, table, qo_indptr, 2, masks)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("enable_split", [False, True])
def test_fully_masked_tiles_are_never_read(group, enable_split):
    """K and V of KV spans no row sees hold NaN (128-key aligned spans: whole tiles of 32 or 64 keys): a tile
    that were loaded and multiplied (P = 0 times NaN) would poison every row of its item. The long request
    splits into chunks (enable_split): a hidden span fills whole chunks and parts of others."""
    spec = SPECS[0]
    qo_lens, kv_lens = [300, 40], [6000, 600]
    starts = np.concatenate([[0], np.cumsum(kv_lens)])
    hidden = [(0, 128, 256), (0, 1024, 2048), (0, 2304, 2432), (0, 5888, 6000), (1, 128, 256)]
    poison = [slice(int(starts[b] + lo), int(starts[b] + hi)) for b, lo, hi in hidden]
    gen = torch.Generator().manual_seed(group)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, 2, group, generator=gen)
    masks = make_masks("random0.5", qo_lens, kv_lens, gen)
    for b, lo, hi in hidden:
        masks[b][:, lo:hi] = False
    masks[0][::5] = False  # and rows that see nothing
    nan_kv = tuple(x.clone() for x in kv)
    for x in nan_kv:
        for rows in poison:
            x[rows] = float("nan")
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    out, lse, chunks = plan_and_run(spec, q, nan_kv, table, qo_indptr, 2, masks, ref_kv=kv, enable_split=enable_split)
    assert (chunks > 1) == enable_split
    check_blind_rows(masks, out, lse)


def test_full_tiles_crossing_the_kv_end():
    """An all-ones mask: the last tile of a request is FULL but crosses kv_len, and the ragged rows past it
    hold NaN; its keys past kv_len must still be masked (zero-filled keys would get weight exp(0 - m))."""
    spec = SPECS[0]
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = [70, 3, 33], [100, 37, 161]
    q, (k, v), table = random_batch(spec, qo_lens, kv_lens, 2, 4, generator=gen)
    masks = make_masks("ones", qo_lens, kv_lens, gen)
    pad = torch.full((200, *k.shape[1:]), float("nan"), dtype=k.dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    plan_and_run(spec, q, (torch.cat([k, pad]), torch.cat([v, pad])), table, qo_indptr, 2, masks, ref_kv=(k, v))


@pytest.mark.parametrize("form", ["host", "device", "device_fresh"])
def test_cuda_graph_replay_after_replanning(form):
    """Re-planning rewrites the tile lists (other lengths, other masks, other splits) in buffers that keep
    their addresses; the captured graph reads the new lists. A device mask lives in one persistent buffer, or
    (``device_fresh``) comes in a new tensor each plan, the last one zeroed: the wrapper copies it into its own
    buffer, which the captured graph reads."""
    spec = SPECS[1]
    max_batch, max_q, heads, group, pool_pages = 8, 700, 2, 4, 400
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q,
                                           backend="portable")
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.float16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, heads, 128, dtype=torch.float16, device="cuda") for _ in range(2))
    indices_buf = torch.zeros(pool_pages, dtype=torch.int32, device="cuda")
    mask_buf = torch.zeros(600 * 3000 // 8 + 50 * 900 // 8 + 8, dtype=torch.uint8, device="cuda")
    fresh: list[torch.Tensor] = []  # device_fresh: every plan's mask tensor, kept alive

    def load(qo_lens, kv_lens, seed, kind):
        gen = torch.Generator().manual_seed(seed)
        q, kv, table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=gen)
        masks = make_masks(kind, qo_lens, kv_lens, gen)
        fill_pools(pool_q, pool_kv, q, kv)
        indices_buf[: table["kv_indices"].numel()].copy_(table["kv_indices"])
        packed = pack_custom_mask(masks)
        if form == "device":
            mask_buf[: packed.numel()].copy_(packed)
        elif form == "device_fresh":
            for old in fresh:
                old.zero_()  # a mask read in place from an earlier plan's tensor would show
            fresh.append(packed.cuda())
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=heads * group, num_kv_heads=heads,
                     kv_indptr=table["kv_indptr"].numpy(), kv_indices=indices_buf,
                     kv_last_page_len=table["kv_last_page_len"].numpy(),
                     custom_mask={"device": mask_buf, "device_fresh": fresh[-1] if fresh else None}.get(form, packed))
        return q, kv, table, qo_indptr, masks

    def check_replay(loaded, out, lse):
        q, kv, table, qo_indptr, masks = loaded
        n = q.shape[0]
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=qo_indptr, custom_mask=masks, **table)

    batches = (([300, 1, 0, 64, 5], [3000, 1, 7, 64, 900], "doc"), ([1], [1], "ones"),
               ([100, 3], [2000, 50], "empty_rows"), ([75] * 8, [75] * 8, "random0.05"),
               ([600, 50], [3000, 900], "blocks"), ([20, 30], [3000, 100], "zeros"))
    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check_replay,
                            ([600, 50], [3000, 900], 0, "random0.5"),  # the largest plan first: it sizes the buffers
                            [(qo, kv, seed, kind) for seed, (qo, kv, kind) in enumerate(batches, start=1)])


@pytest.mark.parametrize("backend", ["portable", pytest.param("sm90", marks=pytest.mark.hopper)])
def test_mask_is_checked(backend):
    """The custom-mask intake both backends share (flashgen.api.custom_mask) names the argument."""
    wrapper = flashgen.BatchPrefillWrapper(SPECS[0], backend=backend)
    table = dict(qo_indptr=[0, 4], kv_indptr=[0, 9], num_qo_heads=4, num_kv_heads=2)
    with pytest.raises(PlanError, match="^custom_mask: required"):
        wrapper.plan(**table)
    with pytest.raises(PlanError, match=r"^custom_mask: expected uint8 \[5\]"):
        wrapper.plan(custom_mask=torch.zeros(4, dtype=torch.uint8), **table)
    with pytest.raises(PlanError, match=r"^custom_mask\[0\]: shape \(4, 8\)"):
        wrapper.plan(custom_mask=[torch.ones(4, 8, dtype=torch.bool)], **table)
    with pytest.raises(PlanError, match="^custom_mask: 4 bytes, expected 5"):
        wrapper.plan(custom_mask=torch.zeros(4, dtype=torch.uint8, device="cuda"), **table)
