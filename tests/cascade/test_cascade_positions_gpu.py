"""GPU tests of CascadeWrapper with true positions across levels: Causal, SlidingWindow, RoPE and ALiBi give the
flat fp64 reference's answer over each whole sequence (1-3 levels, decode and prefill shapes, NaN-poisoned
outputs), and a CUDA graph replays after re-planning."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from cascade_batches import csr, last_page_lens, shared_cache, tree_pages
from flashgen import ALiBi, AttentionSpec, Causal, CascadePolicy, NoMask, Paged, RoPE, SlidingWindow
from flashgen.api.backends import kernels_for
from flashgen.testing.check import check_attention
from graph_replay import fill_pools, reference_check, replay_after_replanning

pytestmark = pytest.mark.cuda
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

HEADS, GROUP, PAGE = 2, 4, 16
NEVER = CascadePolicy(fold="never")  # every level with KV runs
SPECS = {
    "causal_rope": AttentionSpec(128, kv_layout=Paged(PAGE), mask=Causal(), pos_encoding=RoPE()),
    "window": AttentionSpec(128, kv_layout=Paged(PAGE), mask=SlidingWindow(24)),
    "causal_alibi": AttentionSpec(128, kv_layout=Paged(PAGE), mask=Causal(), pos_encoding=ALiBi()),
    "window_rope": AttentionSpec(128, kv_layout=Paged(PAGE), mask=SlidingWindow(40), pos_encoding=RoPE()),
    "nomask_alibi": AttentionSpec(128, kv_layout=Paged(PAGE), mask=NoMask(), pos_encoding=ALiBi()),
}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile the module's kernels (every level's, with explicit positions) in parallel up front."""
    specs = list(SPECS.values()) + [AttentionSpec(128, kv_layout=Paged(PAGE), mask=SlidingWindow(30),
                                                  pos_encoding=RoPE())]
    jobs = []
    for spec in specs:
        shared = spec if isinstance(spec.mask, SlidingWindow) else spec.replace(mask=NoMask())
        jobs += [(shared, "prefill"), (spec, "prefill"), (spec, "decode")]
        if HOPPER:  # the sm90 backend's kernels (RoPE: the pre-pass and the ragged twin)
            jobs += [(ks, op) for s in (shared, spec) for op, ks in kernels_for(s, "sm90")]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job, options={"positions": True}), jobs))


def tree_case(seed: int, batch: int, depth: int, qo_lens, spare_pages: int = 2):
    """(q, kv, table, qo_indptr) on the CPU, bf16: a random prefix-tree batch of ``depth`` shared levels."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lists = tree_pages(rng, batch, depth)
    last = last_page_lens(rng, lists, PAGE)
    kv = shared_cache(lists, last, PAGE, HEADS, 128, torch.bfloat16, spare_pages=spare_pages, generator=gen)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    q = torch.randn(int(qo[-1]), HEADS * GROUP, 128, generator=gen).to(torch.bfloat16)
    return q, kv, csr(lists, last), qo


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_levels_with_positions_match_flat_attention(name, shape):
    spec = SPECS[name]
    wrapper = flashgen.CascadeWrapper(spec)
    for seed, depth in ((10, 0), (11, 1), (12, 2)):  # 1, 2 and 3 levels
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(7, np.int64) if shape == "decode" else rng.integers(0, 6, 7)
        q, kv, table, qo = tree_case(seed, 7, depth, qo_lens)
        wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, policy=NEVER)
        q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
        check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                        qo_indptr=qo, **table)
        runs = [r.runs for r in wrapper.levels]
        assert runs[-1] == ("decode" if shape == "decode" else "portable")
        assert all(r in ("portable", "decode", "empty") for r in runs)


@pytest.mark.skipif(not HOPPER, reason="the sm90 backend needs a compute-capability 9.0 GPU")
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_levels_with_positions_on_sm90(name, shape):
    """Every prefill level on the Hopper kernel with explicit positions (its shared levels' keys start past the
    earlier levels', its queries at their places in the whole sequence)."""
    spec = SPECS[name]
    wrapper = flashgen.CascadeWrapper(spec, prefill_backend="sm90")
    for seed, depth in ((20, 0), (21, 1), (22, 2)):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(7, np.int64) if shape == "decode" else rng.integers(0, 40, 7)
        q, kv, table, qo = tree_case(seed, 7, depth, qo_lens)
        wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, policy=NEVER)
        q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
        check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                        qo_indptr=qo, **table)
        runs = [r.runs for r in wrapper.levels]
        assert runs[-1] == ("decode" if shape == "decode" else "sm90")
        assert all(r in ("sm90", "decode", "empty") for r in runs)


def test_runtime_window_and_rope_values_reach_every_level():
    spec = SPECS["window_rope"]
    wrapper = flashgen.CascadeWrapper(spec)
    q, kv, table, qo = tree_case(5, 6, 2, np.ones(6, np.int64))
    wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, policy=NEVER,
                 window_left=9, rope_theta=500.0)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv, qo_indptr=qo,
                    window_left=9, rope_theta=500.0, **table)


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_cuda_graph_replay_with_positions(shape):
    spec = AttentionSpec(128, kv_layout=Paged(PAGE), mask=SlidingWindow(30), pos_encoding=RoPE())
    max_batch, pool_pages = 10, 160
    max_total_q = max_batch if shape == "decode" else 40
    wrapper = flashgen.CascadeWrapper(spec, num_levels=3, use_cuda_graph=True, max_batch_size=max_batch,
                                      max_total_q=max_total_q, max_num_pages=256)
    pool_q = torch.empty(max_total_q, HEADS * GROUP, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, PAGE, HEADS, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def load(seed, batch, depth, fold):
        rng = np.random.default_rng(seed)
        qo_lens = np.ones(batch, np.int64) if shape == "decode" else rng.integers(0, 5, batch)
        q, kv, table, qo = tree_case(seed, batch, depth, qo_lens, spare_pages=0)
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        wrapper.plan(qo_indptr=qo, **table, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                     policy=CascadePolicy(fold=fold))
        return q, kv, table, qo

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, reference_check(spec),
                            (0, max_batch, 2, "never"),
                            [(1, 4, 1, "never"), (2, max_batch, 0, "never"), (3, 1, 1, "never"),
                             (4, max_batch, 2, "always"), (5, 7, 2, "never")])
