"""GPU tests of batch prefill against the fp64 reference: fresh random inputs, NaN-poisoned outputs and NaN
in every cache slot no request owns. Lengths straddle the 64-row q tiles and 32/64-token KV tiles.

The wrapper runs the portable kernel here (``backend="portable"``) on every GPU, the H200 included; a few
representative tests also run on the sm90 backend where it supports the spec (on a Hopper GPU).
tests/prefill/test_prefill_backend.py tests backend selection and the sm90 backend behind the wrapper."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import (ALiBi, AttentionSpec, Causal, CustomMask, Llama31Scaling, Paged, Ragged, RoPE, SlidingWindow,
                      YaRNScaling)
from flashgen.api.backends import kernels_for, select as _select_backend
from flashgen.kernels.prefill import prefill_ctas_per_sm, prefill_tile_q, prefill_tiles
from flashgen.plan import PlanError, csr_to_block_table, plan_prefill
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch
from flashgen.testing.reference import pack_custom_mask
from graph_replay import REPLAN_BATCHES, fill_pools, fresh_page_ids, reference_check, replay_after_replanning

pytestmark = pytest.mark.cuda

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5]
KV = [5, 1, 17, 300, 64, 0, 130, 0]

LAYOUT_MASKS = [
    AttentionSpec(128, kv_layout=Ragged()),
    AttentionSpec(128, kv_layout=Ragged(), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(1), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(5, "HND"), mask=SlidingWindow(20)),
    AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask()),
    AttentionSpec(128, kv_layout=Paged(64, "HND")),
    AttentionSpec(128, kv_layout=Paged(16), mask=Causal()),
]
OPTIONS = [
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE()), {}),
    (AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(500000.0, 8.0)), {"rope_theta": 1e6, "rope_scale": 2.0}),
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi()), {}),
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), soft_cap=30.0), {"soft_cap": 5.0}),
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal()), {"sm_scale": 0.3}),
    (AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(7)), {"window_left": 40}),
    (AttentionSpec(128, kv_layout=Ragged(), dtype="float16", mask=CustomMask(), pos_encoding=RoPE(), soft_cap=20.0), {}),
    # Llama-3.1 / YaRN frequencies for q and K, and a cache of rotated K (q alone turns)
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(scaling=Llama31Scaling())),
     {"rope_theta": 500000.0}),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(),
                   pos_encoding=RoPE(scaling=YaRNScaling(factor=8.0, original_max_position=64))), {}),
    (AttentionSpec(128, kv_layout=Paged(5, "HND"), mask=Causal(), pos_encoding=RoPE(k_rotated=True)), {}),
    (AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True, scaling=Llama31Scaling())),
     {"rope_scale": 2.0}),
]
HEADS = [
    (AttentionSpec(64, kv_layout=Ragged(), mask=Causal()), 7),
    (AttentionSpec(64, kv_layout=Paged(16)), 4),
    (AttentionSpec(256, kv_layout=Paged(16), mask=Causal()), 1),
    (AttentionSpec(256, kv_layout=Ragged(), pos_encoding=RoPE()), 4),
    (AttentionSpec(192, head_dim_vo=128, kv_layout=Ragged(), mask=Causal()), 7),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), 1),
]
ALL_SPECS = {s for s in LAYOUT_MASKS} | {s for s, _ in OPTIONS} | {s for s, _ in HEADS}
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SM90_SPECS = {s for s in ALL_SPECS if _select_backend(s, "auto", (9, 0)) == "sm90"}


def with_backends(cases, ids):
    """Each case (a tuple of arguments) on the portable backend, and on sm90 too where it runs the spec
    (skipped off Hopper)."""
    params = []
    for case in cases:
        params.append(pytest.param(*case, "portable", id=f"{ids(case)}-portable"))
        if case[0] in SM90_SPECS:
            params.append(pytest.param(*case, "sm90", id=f"{ids(case)}-sm90", marks=pytest.mark.skipif(
                not HOPPER, reason="the sm90 backend needs a Hopper GPU (sm_90a)")))
    return params


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every spec of this module in parallel up front (nvcc runs are the slow part)."""
    jobs = [(s, "prefill") for s in ALL_SPECS]
    for s in SM90_SPECS if HOPPER else ():  # RoPE on sm90: the rope_gather pre-pass and the ragged twin's kernel
        jobs += [(spec, op) for op, spec in kernels_for(s, "sm90")]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job), jobs))


def make_batch(spec, qo_lens, kv_lens, num_kv_heads, group, *, combined=False, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    q, kv, table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, combined=combined, generator=gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    mask = None
    if isinstance(spec.mask, CustomMask):
        mask = [torch.rand(a, b, generator=gen) < 0.7 for a, b in zip(qo_lens, kv_lens)]
    return q, kv, table, qo_indptr, mask


def to_cuda(kv):
    return tuple(x.cuda() for x in kv) if isinstance(kv, tuple) else kv.cuda()


def run_prefill(spec, q, kv, table, qo_indptr, num_kv_heads, *, custom_mask=None, plan_kwargs=None,
                backend="portable", **runtime):
    """Plan, run into NaN-poisoned out / lse and check against the fp64 reference; returns (out, lse)."""
    wrapper = flashgen.BatchPrefillWrapper(spec, backend=backend)
    assert wrapper.backend == backend
    tab = dict(table)
    if "kv_indices" in tab:
        tab["kv_indices"] = tab["kv_indices"].cuda()
    mask = pack_custom_mask(custom_mask) if custom_mask is not None else None
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, custom_mask=mask, **tab,
                 **runtime, **(plan_kwargs or {}))
    q_gpu, kv_gpu = q.cuda(), to_cuda(kv)
    return check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                           qo_indptr=qo_indptr, custom_mask=custom_mask, **table, **runtime)


def run_and_check(spec, qo_lens, kv_lens, heads, group, *, combined=False, plan_kwargs=None, backend="portable",
                  **runtime):
    q, kv, table, qo_indptr, mask = make_batch(spec, qo_lens, kv_lens, heads, group, combined=combined)
    return run_prefill(spec, q, kv, table, qo_indptr, heads, custom_mask=mask, plan_kwargs=plan_kwargs,
                       backend=backend, **runtime)


@pytest.mark.parametrize("spec,backend", with_backends([(s,) for s in LAYOUT_MASKS], lambda c: c[0].uri))
def test_layouts_and_masks(spec, backend):
    run_and_check(spec, QO, KV, 2, 4, combined=isinstance(spec.kv_layout, Paged) and spec.kv_layout.page_size == 5,
                  backend=backend)


@pytest.mark.parametrize("spec,runtime", OPTIONS, ids=lambda x: x.uri if isinstance(x, AttentionSpec) else str(x))
def test_options(spec, runtime):
    run_and_check(spec, QO, KV, 2, 4, **runtime)


@pytest.mark.parametrize("spec,group,backend", with_backends(HEADS, lambda c: f"{c[0].uri}-{c[1]}"))
def test_head_dims_and_groups(spec, group, backend):
    run_and_check(spec, [33, 0, 200, 1], [90, 4, 200, 1], 2, group, backend=backend)


@pytest.mark.parametrize("spec", [LAYOUT_MASKS[1], LAYOUT_MASKS[4], OPTIONS[5][0]], ids=lambda s: s.uri)
def test_split_and_unsplit_agree(spec):
    qo_lens, kv_lens = [200, 7], [6000, 40]
    q, kv, table, qo_indptr, mask = make_batch(spec, qo_lens, kv_lens, 1, 4)
    split, _ = run_prefill(spec, q, kv, table, qo_indptr, 1, custom_mask=mask)
    whole, _ = run_prefill(spec, q, kv, table, qo_indptr, 1, custom_mask=mask, plan_kwargs={"enable_split": False})
    torch.testing.assert_close(split.float(), whole.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_sms,qo_lens,kv_lens", [(3, [200, 130, 64], [1500, 900, 1100]), (4, [300] * 3, [700] * 3),
                                                      (6, [250, 250], [1100, 1100])])
@pytest.mark.parametrize("layout", [Ragged(), Paged(16)], ids=["ragged", "paged16"])
def test_last_wave_tiles_split(num_sms, qo_lens, kv_lens, layout):
    # a GPU of few SMs (num_sms) leaves a partly empty last wave: the plan splits those tiles into KV chunks
    # (balance_tail), each tile merging its own chunk count while the rest of its request is unsplit
    spec = AttentionSpec(128, kv_layout=layout)
    q, kv, table, qo_indptr, _ = make_batch(spec, qo_lens, kv_lens, 2, 4)
    d = spec.head_dim
    plan = plan_prefill(qo_indptr, kv_lens, num_qo_heads=8, num_kv_heads=2, tile_rows=prefill_tile_q(d, d),
                        kv_granularity=prefill_tiles(d, d)[2], num_sms=num_sms * prefill_ctas_per_sm(d, d),
                        balance_tail=True)
    n = plan.info.num_items
    assert (plan.numpy("chunk_idx")[:n] >= 0).any() and (plan.numpy("num_chunks")[: len(qo_lens)] == 1).all()
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="portable", num_sms=num_sms)
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, **table)
    q_gpu, kv_gpu = q.cuda(), to_cuda(kv)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo_indptr, **table)


def test_block_table():
    spec = LAYOUT_MASKS[-1]
    q, kv, table, qo_indptr, _ = make_batch(spec, QO, KV, 2, 4)
    block_table, seq_lens = csr_to_block_table(table["kv_indptr"], table["kv_indices"], table["kv_last_page_len"], 16)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="portable")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, block_table=block_table.cuda(), seq_lens=seq_lens)
    out = wrapper.run(q.cuda(), to_cuda(kv))  # the wrapper's own out
    assert_matches_reference(spec, q, kv, out, qo_indptr=qo_indptr, block_table=block_table, seq_lens=seq_lens)


def test_cuda_graph_replay_after_replanning():
    spec = LAYOUT_MASKS[-1]
    max_batch, max_q, heads, group, pool_pages = 8, 600, 2, 4, 400
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q,
                                           backend="portable")
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    indices_buf = torch.zeros(pool_pages, dtype=torch.int32, device="cuda")

    def load(qo_lens, kv_lens):
        q, kv, table, qo_indptr, _ = make_batch(spec, qo_lens, kv_lens, heads, group)
        fill_pools(pool_q, pool_kv, q, kv)
        indices_buf[: table["kv_indices"].numel()].copy_(table["kv_indices"])
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=heads * group, num_kv_heads=heads, kv_indptr=table["kv_indptr"],
                     kv_indices=indices_buf, kv_last_page_len=table["kv_last_page_len"])
        return q, kv, table, qo_indptr

    check_replay = reference_check(spec)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check_replay,
                            ([100, 3], [2000, 50]), REPLAN_BATCHES[:4])


@pytest.mark.parametrize("form", ["csr", "block_table"])
def test_cuda_graph_replay_with_fresh_device_page_ids(form):
    """Each plan passes its page ids in a new device tensor (a new address, other pages; the old tensors zeroed):
    the wrapper copies them into its own buffer at plan time, and the captured graph reads that buffer."""
    spec = LAYOUT_MASKS[-1]
    max_batch, max_q, heads, group, pool_pages = 8, 600, 2, 4, 400
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q,
                                           backend="portable", max_num_pages=pool_pages, max_pages_per_request=200)
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    held = []

    def load(qo_lens, kv_lens):
        q, kv, table, qo_indptr, _ = make_batch(spec, qo_lens, kv_lens, heads, group)
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        pages, ref_pages = fresh_page_ids(table, form, 16, held)
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=heads * group, num_kv_heads=heads, **pages)
        return q, kv, ref_pages, qo_indptr

    check_replay = reference_check(spec)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check_replay,
                            ([100, 3], [2000, 50]), REPLAN_BATCHES[:4])


@pytest.mark.parametrize("head_dim", [128, 192])
def test_attention_one_shot(head_dim):
    """head_dim 128: the backend auto picks (sm90 on Hopper); 192 (head_dim_vo 128): portable everywhere."""
    q = torch.randn(300, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(700, 2, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(700, 2, 128, dtype=torch.bfloat16, device="cuda")
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    spec = AttentionSpec(head_dim, head_dim_vo=128, kv_layout=Ragged(), mask=Causal())
    assert_matches_reference(spec, q.cpu(), (k.cpu(), v.cpu()), out, lse, qo_indptr=[0, 300], kv_indptr=[0, 700])


def test_bad_arguments_are_named():
    spec = LAYOUT_MASKS[-1]
    q, kv, table, qo_indptr, _ = make_batch(spec, [10, 20], [40, 100], 2, 4)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="portable")
    with pytest.raises(PlanError, match="qo_indptr"):
        wrapper.plan(qo_indptr=[0, 10], num_qo_heads=8, num_kv_heads=2, **table)
    with pytest.raises(PlanError, match="num_qo_heads"):
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=7, num_kv_heads=2, **table)
    with pytest.raises(PlanError, match="custom_mask"):
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, custom_mask=torch.zeros(4, dtype=torch.uint8),
                     **table)
    with pytest.raises(PlanError, match="custom_mask: required"):
        flashgen.BatchPrefillWrapper(LAYOUT_MASKS[4]).plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, **table)
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=8, num_kv_heads=2, **table)
    with pytest.raises(ValueError, match="^q: expected shape"):
        wrapper.run(q[:5].cuda(), to_cuda(kv))
    with pytest.raises(TypeError, match="^q: expected dtype"):
        wrapper.run(q.half().cuda(), to_cuda(kv))
    with pytest.raises(ValueError, match=r"^kv_cache \(k\): expected shape"):
        wrapper.run(q.cuda(), (kv[0][:, :8].cuda(), kv[1][:, :8].cuda()))
    with pytest.raises(flashgen.SpecError, match="kv_dtype"):
        flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_dtype="float16"))
    with pytest.raises(flashgen.SpecError, match="head_dim"):
        flashgen.BatchPrefillWrapper(AttentionSpec(96))
