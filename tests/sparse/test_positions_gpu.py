"""GPU tests of true positions in sparse attention: block-sparse (fixed and variable blocks) with Causal,
SlidingWindow, RoPE and ALiBi inside the kept blocks, and sparse page decode (``select_pages(positions=True)``)
with RoPE, ALiBi and a window over scattered kept pages; each against the fp64 reference at the same true
positions, NaN-poisoned outputs, and a CUDA-graph replay after re-planning."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import ALiBi, AttentionSpec, Causal, NoMask, Paged, Ragged, RoPE, SlidingWindow
from flashgen.api.backends import kernels_for
from flashgen.spec import BlockSparse
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch

pytestmark = pytest.mark.cuda
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SM90_BLOCKS = (1, 16, 24, 64)  # C: gathered (1, 24) and TMA pages (16, 64)

BSR_SPECS = {
    "causal_rope": AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), pos_encoding=RoPE()),
    "window_alibi": AttentionSpec(128, kv_layout=Ragged(), mask=SlidingWindow(50), pos_encoding=ALiBi()),
    "causal": AttentionSpec(64, dtype="float16", kv_layout=Ragged(), mask=Causal(), soft_cap=20.0),
}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile the module's kernels (explicit positions) in parallel up front."""
    jobs = [(s.replace(kv_layout=Paged(c)), "prefill") for s in BSR_SPECS.values() for c in (1, 8, 16, 64)]
    jobs += [(AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE()), "prefill")]
    jobs += [(s, "decode") for s in DECODE_SPECS.values()]
    if HOPPER:  # the sm90 backend's kernels (RoPE: the pre-pass and the ragged twin)
        jobs += [(ks, op) for s in BSR_SPECS.values() for c in SM90_BLOCKS
                 for op, ks in kernels_for(s.replace(kv_layout=Paged(c)), "sm90")]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job, options={"positions": True}), jobs))


def pattern(rows: int, cols: int, density: float, rng: np.random.Generator):
    present = rng.random((rows, cols)) < density
    present[np.arange(rows), rng.integers(0, cols, rows)] = True
    return np.concatenate([[0], np.cumsum(present.sum(1))]), np.flatnonzero(present.reshape(-1)) % cols


def dense(spec: AttentionSpec, m: int, n: int, hq: int, hkv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    q = torch.randn(m, hq, spec.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(n, hkv, spec.head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def bsr_reference_kwargs(indptr, indices, m: int, n: int, **runtime) -> dict:
    """The reference's arguments: the BSR mask, queries at rows 0 .. M-1 and keys at 0 .. N-1."""
    return dict(bsr=(indptr, indices), q_pos=np.arange(m), kv_page_pos=np.arange(n), kv_indptr=[0, n], **runtime)


@pytest.mark.parametrize("name", sorted(BSR_SPECS))
@pytest.mark.parametrize("r, c, m, n", [(16, 16, 100, 130), (64, 16, 150, 90), (1, 64, 37, 200), (32, 1, 70, 41)])
def test_block_sparse_with_positions(name, r, c, m, n):
    spec = BSR_SPECS[name]
    indptr, indices = pattern(-(-m // r), -(-n // c), 0.4, np.random.default_rng(r + c + m))
    q, k, v = dense(spec, m, n, 8, 2, r * c + n)
    wrapper = flashgen.BlockSparseWrapper(spec, backend="portable")
    wrapper.plan(indptr, indices, m, n, r, c, 8, 2)
    assert wrapper.backend == "portable"
    qg, kg, vg = q.cuda(), k.cuda(), v.cuda()
    check_attention(lambda out: wrapper.run(qg, kg, vg, out=out, return_lse=True),
                    spec.replace(kv_layout=BlockSparse(r, c)), qg, (kg, vg),
                    **bsr_reference_kwargs(indptr, indices, m, n))


@pytest.mark.skipif(not HOPPER, reason="the sm90 backend needs a compute-capability 9.0 GPU")
@pytest.mark.parametrize("name", sorted(BSR_SPECS))
@pytest.mark.parametrize("r, c, m, n", [(16, 16, 100, 128), (64, 64, 150, 256), (1, 64, 37, 192), (32, 1, 70, 41),
                                        (128, 24, 300, 100), (16, 16, 400, 512)])
def test_block_sparse_with_positions_on_sm90(name, r, c, m, n):
    """The Hopper kernel with explicit positions: TMA pages (N a multiple of C) and gathered ones, key tiles of
    non-contiguous kept blocks, several q tiles a block row."""
    spec = BSR_SPECS[name]
    indptr, indices = pattern(-(-m // r), -(-n // c), 0.4, np.random.default_rng(r + c + m + 1))
    q, k, v = dense(spec, m, n, 8, 2, r * c + n + 1)
    wrapper = flashgen.BlockSparseWrapper(spec, backend="sm90")
    wrapper.plan(indptr, indices, m, n, r, c, 8, 2)
    assert wrapper.backend == "sm90"
    qg, kg, vg = q.cuda(), k.cuda(), v.cuda()
    check_attention(lambda out: wrapper.run(qg, kg, vg, out=out, return_lse=True),
                    spec.replace(kv_layout=BlockSparse(r, c)), qg, (kg, vg),
                    **bsr_reference_kwargs(indptr, indices, m, n))


def test_variable_blocks_with_causal_rope():
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), pos_encoding=RoPE())
    rng = np.random.default_rng(3)
    rows, cols = np.array([[40, 24, 36], [30, 50, 20]]), np.array([[32, 16, 48], [48, 32, 16]])
    mask = rng.random((2, 3, 3)) < 0.6
    mask[:, :, 0] = True
    m, n = 100, 96
    q, k, v = dense(spec, m, n, 8, 2, 7)
    wrapper = flashgen.VariableBlockSparseWrapper(spec)
    wrapper.plan(mask, rows, cols, 8, 2)
    out, lse = wrapper.run(q.cuda(), k.cuda(), v.cuda(), return_lse=True)
    for h in range(2):  # each kv head under its own pattern: the dense mask of its blocks
        row_of = np.repeat(np.arange(3), rows[h])
        col_of = np.repeat(np.arange(3), cols[h])
        block = torch.from_numpy(mask[h][row_of][:, col_of])
        heads = slice(4 * h, 4 * h + 4)
        ref_spec = spec.replace(kv_layout=BlockSparse(1, 1))
        idx = [np.flatnonzero(row) for row in block.numpy()]
        indptr = np.concatenate([[0], np.cumsum([i.size for i in idx])])
        assert_matches_reference(ref_spec, q[:, heads].cuda(), (k[:, h: h + 1].cuda(), v[:, h: h + 1].cuda()),
                                 out[:, heads], lse[:, heads],
                                 **bsr_reference_kwargs(indptr, np.concatenate(idx), m, n))


def test_block_sparse_graph_replay_with_positions():
    spec = BSR_SPECS["causal_rope"]
    m, n, r, c = 96, 120, 16, 8
    q, k, v = dense(spec, m, n, 8, 2, 1)
    qg, kg, vg = q.cuda(), k.cuda(), v.cuda()
    wrapper = flashgen.BlockSparseWrapper(spec, use_cuda_graph=True, max_num_blocks=-(-m // r) * -(-n // c))
    patterns = [pattern(-(-m // r), -(-n // c), d, np.random.default_rng(i)) for i, d in enumerate((1.0, 0.3, 0.7))]
    wrapper.plan(*patterns[0], m, n, r, c, 8, 2)
    wrapper.run(qg, kg, vg, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wrapper.run(qg, kg, vg, return_lse=True)
    for indptr, indices in patterns[1:]:
        wrapper.plan(indptr, indices, m, n, r, c, 8, 2)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(spec.replace(kv_layout=BlockSparse(r, c)), qg, (kg, vg), out, lse,
                                 **bsr_reference_kwargs(indptr, indices, m, n))


DECODE_SPECS = {
    "rope": AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE()),
    "alibi": AttentionSpec(128, kv_layout=Paged(16), pos_encoding=ALiBi()),
    "window": AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(100)),
    "window_rope_page5": AttentionSpec(128, kv_layout=Paged(5), mask=SlidingWindow(40), pos_encoding=RoPE()),
}


def kept_batch(spec: AttentionSpec, seed: int, kv_lens):
    """A decode batch, a random top-k selection of its pages, the kept table (device ids) and a cache whose
    skipped pages are NaN; the expected positions computed here from the selection."""
    page = spec.kv_layout.page_size
    gen = torch.Generator().manual_seed(seed)
    q, kv, table = random_batch(spec.replace(mask=NoMask(), pos_encoding=None), [1] * len(kv_lens), kv_lens, 2, 4,
                                generator=gen)
    npages = np.diff(table["kv_indptr"].numpy())
    rng = np.random.default_rng(seed)
    keep = np.full((len(kv_lens), 6), -1)
    for b, p in enumerate(npages):
        chosen = rng.permutation(p)[:6]
        keep[b, : chosen.size] = chosen
    sparse = flashgen.select_pages(spec, table["kv_indptr"], table["kv_indices"].cuda(), table["kv_last_page_len"],
                                   keep=keep, positions=True)
    expected = np.concatenate([np.sort(row[row >= 0]) * page for row in keep])
    assert np.array_equal(sparse["kv_page_pos"], expected)
    assert np.array_equal(sparse["q_pos"], np.maximum(np.asarray(kv_lens) - 1, 0))
    kept_ids = sparse["kv_indices"].long()
    poisoned = tuple(torch.full_like(x, float("nan")).cuda() for x in kv)
    for cache, x in zip(poisoned, kv):
        cache[kept_ids] = x.cuda()[kept_ids]
    host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sparse.items()}
    return q, kv, poisoned, sparse, host


@pytest.mark.parametrize("name", sorted(DECODE_SPECS))
def test_sparse_decode_with_true_positions(name):
    spec = DECODE_SPECS[name]
    q, kv, poisoned, sparse, host = kept_batch(spec, 3, [700, 1, 0, 333, 64, 250])
    wrapper = flashgen.BatchDecodeWrapper(spec, kernel_options={"positions": True})
    wrapper.plan(**sparse, num_qo_heads=8, num_kv_heads=2)
    q_gpu = q.cuda()
    check_attention(lambda out: wrapper.run(q_gpu, poisoned, out=out, return_lse=True), spec, q_gpu,
                    tuple(x.cuda() for x in kv), qo_indptr=np.arange(7), **host)


def test_sparse_decode_graph_replay_with_positions():
    spec = DECODE_SPECS["window_rope_page5"]
    wrapper = flashgen.BatchDecodeWrapper(spec, kernel_options={"positions": True}, use_cuda_graph=True,
                                          max_batch_size=6, max_num_pages=64)
    batches = [kept_batch(spec, seed, lens) for seed, lens in
               ((0, [300, 40, 7, 90, 1, 160]), (1, [20, 260]), (2, [5, 0, 200, 33, 120, 64]))]
    pool_q = torch.zeros(6, 8, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.full((400,) + x.shape[1:], float("nan"), dtype=x.dtype, device="cuda")
                    for x in batches[0][2])

    def load(i):
        q, kv, poisoned, sparse, host = batches[i]
        for pool, part in zip(pool_kv, poisoned):
            pool.fill_(float("nan"))
            pool[: part.shape[0]].copy_(part)
        pool_q[: q.shape[0]].copy_(q)
        wrapper.plan(**sparse, num_qo_heads=8, num_kv_heads=2)

    load(0)
    wrapper.run(pool_q, pool_kv, return_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wrapper.run(pool_q, pool_kv, return_lse=True)
    for i in (1, 2, 0):
        load(i)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        q, kv, _, _, host = batches[i]
        n = q.shape[0]
        assert_matches_reference(spec, q.cuda(), tuple(x.cuda() for x in kv), out[:n], lse[:n],
                                 qo_indptr=np.arange(n + 1), **host)
