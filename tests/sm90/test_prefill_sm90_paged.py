"""GPU tests of the Hopper prefill over paged KV against the fp64 reference: fresh random inputs, shuffled pages
with NaN in every slot no request owns, NaN-poisoned outputs; page sizes from 8 (sixteen boxes a 128-token tile)
to 256 (a tile inside a page) loaded by TMA, and page sizes no box takes (1, 3, 5, 12, 24, 100, ...: rows gathered
by the producer warps into the swizzled tile), NHD and HND, K/V as a pair or one tensor, CSR and block-table page
tables, host and device page ids, masks, GQA groups, head dims and CUDA-graph replay after re-planning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Causal, NoMask, Paged
from flashgen.testing.check import check_attention
from flashgen.testing.layouts import random_batch
from graph_replay import REPLAN_BATCHES, fill_pools, fresh_page_ids, reference_check, replay_after_replanning

pytestmark = [pytest.mark.cuda, pytest.mark.hopper]

QO = [37, 0, 130, 1, 64, 200]
KV = [300, 9, 130, 1, 1000, 200]


def block_table_of(table, page_size):
    indptr, indices = table["kv_indptr"].numpy(), table["kv_indices"].numpy()
    width = max(int(np.diff(indptr).max(initial=1)), 1)
    bt = np.zeros((indptr.size - 1, width), np.int32)
    for b in range(indptr.size - 1):
        bt[b, : indptr[b + 1] - indptr[b]] = indices[indptr[b]: indptr[b + 1]]
    return torch.from_numpy(bt)


def run_and_check(spec, qo_lens, kv_lens, num_kv_heads=2, group=4, *, combined=False, form="csr", device_ids=False,
                  seed=0, **runtime):
    gen = torch.Generator().manual_seed(seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, combined=combined, generator=gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    if form == "csr":
        pages = {"kv_indptr": table["kv_indptr"].numpy(), "kv_indices": table["kv_indices"],
                 "kv_last_page_len": table["kv_last_page_len"].numpy()}
        ref_pages = dict(table)
    else:
        bt = block_table_of(table, spec.kv_layout.page_size)
        pages = {"block_table": bt, "seq_lens": np.asarray(kv_lens, np.int32)}
        ref_pages = {"block_table": bt, "seq_lens": np.asarray(kv_lens)}
    if device_ids:
        key = "kv_indices" if form == "csr" else "block_table"
        pages[key] = pages[key].to(torch.int32).cuda()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, **pages, **runtime)
    q_dev = q.cuda()
    kv_dev = kv.cuda() if isinstance(kv, torch.Tensor) else tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo_indptr, **ref_pages, **runtime)


@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_page_sizes(page_size, causal):
    run_and_check(AttentionSpec(128, kv_layout=Paged(page_size), mask=Causal() if causal else NoMask()), QO, KV)


@pytest.mark.parametrize("d,page_size", [(64, 16), (64, 256), (256, 32), (256, 128)])
def test_head_dims(d, page_size):
    run_and_check(AttentionSpec(d, kv_layout=Paged(page_size), mask=Causal()), QO, KV, group=7, seed=d)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_orders_and_combined_cache(order, combined):
    spec = AttentionSpec(128, dtype="float16", kv_layout=Paged(16, order), mask=Causal())
    run_and_check(spec, QO, KV, combined=combined, seed=3)


@pytest.mark.parametrize("form", ["csr", "block_table"])
@pytest.mark.parametrize("device_ids", [False, True])
def test_page_table_forms(form, device_ids):
    run_and_check(AttentionSpec(128, kv_layout=Paged(16, "HND"), mask=Causal()), QO, KV, form=form,
                  device_ids=device_ids, seed=4)


def test_ragged_rows_past_the_batch_hold_nan():
    """Rows of K / V past kv_indptr[-1] (a preallocated buffer) are NaN: the last tile's tail must not reach O."""
    from flashgen import Ragged

    spec = AttentionSpec(128, kv_layout=Ragged(), mask=NoMask())
    gen = torch.Generator().manual_seed(5)
    qo_lens, kv_lens = [70, 3], [100, 37]
    q, (k, v), table = random_batch(spec, qo_lens, kv_lens, 2, 4, generator=gen)
    pad = torch.full((200, *k.shape[1:]), float("nan"), dtype=k.dtype)
    k_buf, v_buf = torch.cat([k, pad]), torch.cat([v, pad])
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=8, num_kv_heads=2)
    q_dev, kv_dev = q.cuda(), (k_buf.cuda(), v_buf.cuda())
    check_attention(lambda out: wrapper.run(q_dev, kv_dev, out=out), spec, q, (k, v), lse=False,
                    qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"])


@pytest.mark.parametrize("layout", ["ragged", "paged16"])
@pytest.mark.parametrize("window_left", [0, 5, 100, 300])
def test_sliding_window(layout, window_left):
    """Tiles before the first row's window are skipped, the rest masked per row (window_left from plan())."""
    from flashgen import Ragged, SlidingWindow

    kv_layout = Ragged() if layout == "ragged" else Paged(16)
    spec = AttentionSpec(128, kv_layout=kv_layout, mask=SlidingWindow(64))
    if layout == "ragged":
        check_ragged(spec, QO, KV, window_left=window_left)
    else:
        run_and_check(spec, QO, KV, seed=window_left, window_left=window_left)


@pytest.mark.parametrize("case", ["alibi", "soft_cap", "alibi+soft_cap+window", "alibi+causal+d64", "soft_cap+d256"])
def test_logits_transforms(case):
    from flashgen import ALiBi, Ragged, SlidingWindow

    d = 64 if "d64" in case else 256 if "d256" in case else 128
    mask = SlidingWindow(50) if "window" in case else Causal() if "causal" in case else NoMask()
    spec = AttentionSpec(d, kv_layout=Ragged(), mask=mask, pos_encoding=ALiBi() if "alibi" in case else None,
                         soft_cap=20.0 if "soft_cap" in case else None)
    check_ragged(spec, QO, KV, group=7)
    if "soft_cap" in case:
        check_ragged(spec, QO, KV, group=7, soft_cap=5.0)  # a runtime soft-cap overrides the spec's


def check_ragged(spec, qo_lens, kv_lens, num_kv_heads=2, group=4, seed=0, **runtime):
    from test_prefill_sm90 import run_and_check as check  # the ragged check of the sm90 tests (tests/ is on sys.path)

    check(spec, qo_lens, kv_lens, num_kv_heads, group, seed=seed, **runtime)


def test_sm_scale_must_be_positive():
    from flashgen import Ragged
    from flashgen.plan import PlanError

    wrapper = flashgen.BatchPrefillWrapper(AttentionSpec(64, kv_layout=Ragged()), backend="sm90")
    with pytest.raises(PlanError, match="^sm_scale: got -0.1, expected a finite number > 0"):
        wrapper.plan(qo_indptr=[0, 4], kv_indptr=[0, 4], num_qo_heads=2, num_kv_heads=1, sm_scale=-0.1)


# ------------------------------------------------------------------ gathered page sizes (no TMA box: cp.async)
# Shuffled pages of a few tokens put neighbouring rows of a tile in unrelated pages, and every slot no request
# owns is NaN: a row copied to the wrong swizzled place, or from a wrong page, changes or poisons the output.
# (qo_len, kv_len): empty requests both ways, one token, appends (qo < kv), tile boundaries +- 1
GQO = [37, 0, 130, 1, 64, 5, 129, 3]
GKV = [300, 9, 130, 1, 1000, 0, 257, 700]


@pytest.mark.parametrize("page_size", [1, 3, 5, 12, 24, 100])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_gathered_page_sizes(page_size, mask):
    from flashgen import SlidingWindow

    kind = {"none": NoMask(), "causal": Causal(), "window": SlidingWindow(64)}[mask]
    run_and_check(AttentionSpec(128, kv_layout=Paged(page_size), mask=kind), GQO, GKV, seed=page_size,
                  **({"window_left": 90} if mask == "window" else {}))


@pytest.mark.parametrize("page_size", [1, 5, 24])
@pytest.mark.parametrize("form", ["csr", "block_table"])
@pytest.mark.parametrize("device_ids", [False, True])
def test_gathered_orders_and_page_table_forms(page_size, form, device_ids):
    for order, combined in (("NHD", False), ("HND", True), ("HND", False)):
        spec = AttentionSpec(128, dtype="float16", kv_layout=Paged(page_size, order), mask=Causal())
        run_and_check(spec, GQO, GKV, combined=combined, form=form, device_ids=device_ids, seed=page_size + 7)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("page_size", [1, 12])
def test_gathered_gqa_groups(group, page_size):
    run_and_check(AttentionSpec(128, kv_layout=Paged(page_size, "HND"), mask=Causal()), GQO, GKV, num_kv_heads=3,
                  group=group, seed=group)


@pytest.mark.parametrize("d,page_size", [(64, 1), (64, 3), (64, 24), (256, 1), (256, 12), (256, 96), (256, 5)])
def test_gathered_head_dims(d, page_size):
    run_and_check(AttentionSpec(d, kv_layout=Paged(page_size), mask=Causal()), GQO, GKV, group=7, seed=d + page_size)
    run_and_check(AttentionSpec(d, kv_layout=Paged(page_size, "HND"), mask=NoMask()), GQO, GKV, seed=d)


def test_gathered_logits_transforms():
    from flashgen import ALiBi, SlidingWindow

    spec = AttentionSpec(128, kv_layout=Paged(12), mask=SlidingWindow(100), pos_encoding=ALiBi(), soft_cap=20.0)
    run_and_check(spec, GQO, GKV, group=7, seed=11, window_left=100)


@pytest.mark.parametrize("page_size,order", [(1, "NHD"), (5, "HND"), (24, "NHD")])
@pytest.mark.parametrize("kind", ["random0.5", "doc"])
def test_gathered_custom_masks(page_size, order, kind):
    from flashgen import CustomMask
    from test_prefill_sm90_mask import KV as MASK_KV
    from test_prefill_sm90_mask import QO as MASK_QO
    from test_prefill_sm90_mask import run_and_check as check_masked  # tests/ is on sys.path

    spec = AttentionSpec(128, kv_layout=Paged(page_size, order), mask=CustomMask())
    check_masked(spec, MASK_QO, MASK_KV, kind=kind, seed=page_size)
    check_masked(spec, MASK_QO, MASK_KV, group=7, kind=kind, form="device", seed=page_size + 1)


@pytest.mark.parametrize("page_size", [1, 5])
def test_gathered_cuda_graph_replay_after_replanning(page_size):
    """The graph keeps the cache's addresses and strides (the kernel's params) and the plan buffer's; re-planning
    rewrites the page ids and lengths in place."""
    from flashgen.plan import PlanError

    spec = AttentionSpec(128, kv_layout=Paged(page_size), mask=Causal())
    max_batch, max_q, heads, group = 8, 700, 2, 4
    max_pages = -(-4000 // page_size) + 8
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q)
    assert wrapper.backend == "sm90"
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.zeros(max_pages, page_size, heads, 128, dtype=torch.bfloat16, device="cuda")
                    for _ in range(2))

    def load(qo_lens, kv_lens, seed):
        gen = torch.Generator().manual_seed(seed)
        q, kv, table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=gen)
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), kv_indices=table["kv_indices"],
                     kv_last_page_len=table["kv_last_page_len"].numpy(), num_qo_heads=heads * group,
                     num_kv_heads=heads)
        return q, kv, table, qo_indptr

    # host page ids travel with the plan, whose device buffer the first plan sizes: the first is the largest
    with pytest.raises(PlanError, match="most page ids"):
        small = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q)
        for qo_lens, kv_lens in (([1], [1]), ([300, 1, 0, 64, 5], [3000, 1, 7, 64, 900])):
            table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=torch.Generator())[2]
            small.plan(qo_indptr=np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32),
                       kv_indptr=table["kv_indptr"].numpy(), kv_indices=table["kv_indices"],
                       kv_last_page_len=table["kv_last_page_len"].numpy(), num_qo_heads=heads * group,
                       num_kv_heads=heads)
    check = reference_check(spec)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check,
                            (*REPLAN_BATCHES[0], 0), [(*b, seed) for seed, b in enumerate(REPLAN_BATCHES, start=1)])
    with pytest.raises(PlanError, match="max_batch_size"):
        load([1] * 9, [1] * 9, 0)


@pytest.mark.parametrize("form", ["csr", "block_table"])
def test_cuda_graph_replay_with_fresh_device_page_ids(form):
    """Each plan passes its page ids in a new device tensor (a new address, other pages; the old tensors zeroed):
    the wrapper copies them into its own buffer at plan time, and the captured graph reads that buffer."""
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    max_batch, max_q, heads, group, pool_pages = 8, 700, 2, 4, 400
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q,
                                           max_num_pages=pool_pages, max_pages_per_request=200)
    assert wrapper.backend == "sm90"
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.zeros(pool_pages, 16, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    held = []

    def load(qo_lens, kv_lens, seed):
        q, kv, table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=torch.Generator().manual_seed(seed))
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        pages, ref_pages = fresh_page_ids(table, form, 16, held)
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=heads * group, num_kv_heads=heads, **pages)
        return q, kv, ref_pages, qo_indptr

    check = reference_check(spec)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check,
                            (*REPLAN_BATCHES[0], 0), [(*b, seed) for seed, b in enumerate(REPLAN_BATCHES, start=1)])
