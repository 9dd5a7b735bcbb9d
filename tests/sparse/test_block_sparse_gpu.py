"""GPU tests of BlockSparseWrapper and sparse page decode against the fp64 reference (NaN-poisoned outputs).

Block-sparse: the dense reference under the block mask (``bsr_mask``), densities 0 / 5 / 50 / 100 %, R and C in
{1, 16, 64, 128} with M and N not multiples of them (and N a multiple of C, where the Hopper kernel loads whole
pages by TMA), GQA groups 1 and 4, on the portable backend and, on a Hopper GPU, ``backend="auto"`` (the sm90
kernel wherever it may run the plan). K and V are views into buffers whose rows past N hold NaN, so a read past
the end shows. Variable blocks: each kv head's own pattern and block sizes, against the reference of each head
under its mask. Sparse decode: scattered kept pages (``select_pages``), the skipped pages NaN in the cache the
kernel reads, against the reference over the whole table with the skipped tokens masked.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, CustomMask, Paged, Ragged
from flashgen.api.backends import kernels_for
from flashgen.api.block_sparse import sm90_reads_whole_pages
from flashgen.spec import BlockSparse
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch

pytestmark = pytest.mark.cuda

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
BLOCKS = (1, 16, 64, 128)
DENSITIES = (0.0, 0.05, 0.5, 1.0)
ROWS = {1: 37, 16: 43, 64: 163, 128: 300}  # M of a block height: not a multiple (but for 1), a few block rows
COLS = {1: 41, 16: 42, 64: 154, 128: 290}
# (R, C, M, N): every R x C with M, N unaligned; and N a multiple of C (the sm90 kernel's TMA pages)
SHAPES = [(r, c, ROWS[r], COLS[c]) for r in BLOCKS for c in BLOCKS]
SHAPES += [(r, c, ROWS[r], 3 * c) for r in (1, 64) for c in (16, 64, 128)]
SPEC = AttentionSpec(128, kv_layout=Ragged())
OPTIONS = [(AttentionSpec(64, dtype="float16", kv_layout=Ragged(), soft_cap=20.0), {"soft_cap": 5.0, "sm_scale": 0.2}),
           (AttentionSpec(128, kv_layout=Ragged(), sm_scale=0.05), {})]
GATHERED = 48  # a page size the sm90 kernel gathers row by row at head_dim 128
DECODE_PAGES = (1, 16)


def backends():
    return [pytest.param("portable", id="portable"),
            pytest.param("auto", id="auto", marks=pytest.mark.skipif(not HOPPER, reason="sm90 needs a Hopper GPU"))]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every kernel of this module in parallel up front."""
    specs = [SPEC.replace(kv_layout=Paged(c)) for c in BLOCKS + (GATHERED,)]
    specs += [s.replace(kv_layout=Paged(32)) for s, _ in OPTIONS]
    jobs = [(s, "prefill") for s in specs] + [(AttentionSpec(128, kv_layout=Paged(p)), "decode") for p in DECODE_PAGES]
    if HOPPER:
        jobs += [(kernel_spec, op) for s in specs for op, kernel_spec in kernels_for(s, "sm90")]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job), jobs))


def random_pattern(rows: int, cols: int, density: float, rng: np.random.Generator):
    """About ``density`` of the blocks (none at 0, all at 1); in between block row 0 is empty (out 0, lse -inf)
    and every other row keeps at least one block."""
    present = rng.random((rows, cols)) < density
    if 0 < density < 1 and rows and cols:
        present[np.arange(1, rows), rng.integers(0, cols, rows - 1)] = True
        present[0] = False
    return np.concatenate([[0], np.cumsum(present.sum(1))]), np.flatnonzero(present.reshape(-1)) % max(cols, 1)


def dense_inputs(spec: AttentionSpec, m: int, n: int, hq: int, hkv: int, seed: int):
    """q [M, Hq, D]; k, v [N, Hkv, D] as views of CUDA buffers whose rows past N are NaN; CPU copies of all."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    q = torch.randn(m, hq, spec.head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(n, hkv, spec.head_dim, generator=gen).to(dtype) for _ in range(2))
    bufs = [torch.full((n + 130, hkv, spec.head_dim), float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
    for buf, x in zip(bufs, (k, v)):
        buf[:n].copy_(x)
    return q, (k, v), q.cuda(), bufs[0][:n], bufs[1][:n]


def expected_backend(backend: str, n: int, c: int, spec: AttentionSpec) -> str:
    if backend == "portable":
        return "portable"
    paged = spec.replace(kv_layout=Paged(c))
    return "portable" if n % c and sm90_reads_whole_pages(paged) else "sm90"


def check_block_sparse(spec, backend, r, c, m, n, density, group, seed, **runtime):
    indptr, indices = random_pattern(-(-m // r), -(-n // c), density, np.random.default_rng(seed))
    q, kv, q_gpu, k_gpu, v_gpu = dense_inputs(spec, m, n, 2 * group, 2, seed)
    wrapper = flashgen.BlockSparseWrapper(spec, backend=backend)
    wrapper.plan(indptr, indices, m, n, r, c, 2 * group, 2, **runtime)
    assert wrapper.backend == expected_backend(backend, n, c, spec)
    check_attention(lambda out: wrapper.run(q_gpu, k_gpu, v_gpu, out=out, return_lse=True),
                    spec.replace(kv_layout=BlockSparse(r, c)), q_gpu, tuple(x.cuda() for x in kv),
                    bsr=(indptr, indices), **runtime)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("r, c, m, n", SHAPES)
def test_block_sparse_matches_reference(r, c, m, n, density, backend):
    group = 4 if DENSITIES.index(density) % 2 else 1
    check_block_sparse(SPEC, backend, r, c, m, n, density, group, seed=r * 7919 + c * 31 + m + n + int(density * 100))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("spec, runtime", OPTIONS, ids=["d64-fp16-softcap", "spec-sm-scale"])
def test_position_free_options(spec, runtime, backend):
    check_block_sparse(spec, backend, 32, 32, 100, 96, 0.5, 4, seed=5, **runtime)
    check_block_sparse(spec, backend, 32, 32, 100, 90, 0.5, 1, seed=6, **runtime)


@pytest.mark.parametrize("backend", backends())
def test_gathered_page_size_with_a_partial_last_block(backend):
    """C = 48: the sm90 kernel gathers rows below each request's length, so it runs N % C != 0 too."""
    check_block_sparse(SPEC, backend, 64, GATHERED, 150, 5 * GATHERED + 7, 1.0, 4, seed=7)
    check_block_sparse(SPEC, backend, 64, GATHERED, 150, 5 * GATHERED + 7, 0.5, 1, seed=8)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("n", [290, 256], ids=["partial-last-block", "whole-blocks"])
def test_cuda_graph_replay_after_replanning(n, backend):
    m, r, c, hkv, group = 300, 64, 64, 2, 4
    rows, cols = -(-m // r), -(-n // c)
    q, kv, q_gpu, k_gpu, v_gpu = dense_inputs(SPEC, m, n, hkv * group, hkv, seed=11)
    wrapper = flashgen.BlockSparseWrapper(SPEC, backend=backend, use_cuda_graph=True, max_num_blocks=rows * cols)
    rng = np.random.default_rng(3)
    patterns = [random_pattern(rows, cols, d, rng) for d in (0.5, 0.0, 1.0, 0.05, 0.5)]
    wrapper.plan(*patterns[0], m, n, r, c, hkv * group, hkv)
    out = torch.empty(m, hkv * group, 128, dtype=torch.bfloat16, device="cuda")
    wrapper.run(q_gpu, k_gpu, v_gpu, out=out)  # build, load, tensor maps: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = wrapper.run(q_gpu, k_gpu, v_gpu, out=out, return_lse=True)
    for indptr, indices in patterns[1:]:
        wrapper.plan(indptr, indices, m, n, r, c, hkv * group, hkv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(SPEC.replace(kv_layout=BlockSparse(r, c)), q_gpu, tuple(x.cuda() for x in kv), out,
                                 lse, bsr=(indptr, indices))


# ---------------------------------------------------------------------------------------------- variable blocks

# (name, row sizes, column sizes) of 2 kv heads: M = 63 (empty row blocks too), column sizes whose gcd (the page
# size) is a TMA page size (portable on every GPU) or one the sm90 kernel gathers (sm90 under "auto" on Hopper)
VARIABLE = [
    ("gcd64", [[20, 0, 43], [30, 33, 0]], [[64, 128, 64], [128, 64, 64]]),
    ("gcd16", [[20, 0, 43], [1, 32, 30]], [[16, 48, 96], [80, 16, 64]]),
    ("gcd1", [[63, 0, 0], [30, 33, 0]], [[37, 60, 60], [100, 50, 7]]),
    ("gcd48", [[20, 0, 43], [30, 33, 0]], [[48, 144, 48], [96, 96, 48]]),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name, row_sz, col_sz", VARIABLE, ids=[case[0] for case in VARIABLE])
def test_variable_blocks_match_reference(name, row_sz, col_sz, group, backend):
    hkv, m, n = 2, 63, sum(col_sz[0])
    rng = np.random.default_rng(group * 10 + len(name))
    mask = rng.random((hkv, 3, 3)) < 0.5
    mask[1, 1] = False  # a block row of head 1 keeps nothing: out 0, lse -inf
    mask[0, 0, 0] = True
    q, kv, q_gpu, k_gpu, v_gpu = dense_inputs(SPEC, m, n, hkv * group, hkv, seed=group)
    wrapper = flashgen.VariableBlockSparseWrapper(SPEC, backend=backend)
    wrapper.plan(mask, row_sz, col_sz, hkv * group, hkv)
    page = int(np.gcd.reduce(np.ravel(col_sz)))
    expected = "portable" if backend == "portable" or sm90_reads_whole_pages(SPEC.replace(kv_layout=Paged(page))) \
        else "sm90"
    assert wrapper.backend == expected
    out = torch.full((m, hkv * group, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = wrapper.run(q_gpu, k_gpu, v_gpu, out=out, return_lse=True)
    k, v = (x.cuda() for x in kv)
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        token_mask = np.repeat(np.repeat(mask[h], row_sz[h], 0), col_sz[h], 1)
        assert_matches_reference(SPEC.replace(mask=CustomMask()), q_gpu[:, heads].contiguous(),
                                 (k[:, h:h + 1], v[:, h:h + 1]), out[:, heads], lse[:, heads], qo_indptr=[0, m],
                                 kv_indptr=[0, n], custom_mask=[torch.from_numpy(token_mask)])


# ---------------------------------------------------------------------------------------------- sparse decode


@pytest.mark.parametrize("page_size", DECODE_PAGES)
@pytest.mark.parametrize("group", [1, 4])
def test_sparse_decode_reads_only_the_kept_pages(page_size, group):
    spec = AttentionSpec(128, kv_layout=Paged(page_size))
    kv_lens = [700, 1, 0, 333, 64, 2000]
    gen = torch.Generator().manual_seed(page_size * 10 + group)
    q, kv, table = random_batch(spec, [1] * len(kv_lens), kv_lens, 2, group, generator=gen)
    indptr = table["kv_indptr"].numpy()
    npages = np.diff(indptr)
    rng = np.random.default_rng(group)
    k = 8  # a top-k of page scores: up to 8 pages a request, any order, -1 past a request's own pages
    keep = np.full((len(kv_lens), k), -1)
    for b, p in enumerate(npages):
        chosen = rng.permutation(p)[:k]
        keep[b, : chosen.size] = chosen
    keep[3, 0] = npages[3] - 1  # one request keeps its partial last page, another (0) may not
    keep[3, 1:] = np.where(keep[3, 1:] == npages[3] - 1, -1, keep[3, 1:])
    device_ids = table["kv_indices"].cuda()
    sparse = flashgen.select_pages(spec, table["kv_indptr"], device_ids, table["kv_last_page_len"], keep=keep)
    assert sparse["kv_indices"].is_cuda
    # the kernel's cache: every page no request keeps is NaN, so a read of a skipped page shows
    kept_ids = sparse["kv_indices"].long()
    poisoned = tuple(torch.full_like(x, float("nan")).cuda() for x in kv)
    for cache, x in zip(poisoned, kv):
        cache[kept_ids] = x.cuda()[kept_ids]
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(**sparse, num_qo_heads=2 * group, num_kv_heads=2)
    masks = []
    for b, n in enumerate(kv_lens):
        kept = np.zeros(npages[b], bool)
        kept[keep[b][keep[b] >= 0]] = True
        masks.append(torch.from_numpy(np.repeat(kept, page_size)[:n])[None])
    q_gpu = q.cuda()
    full = dict(kv_indptr=table["kv_indptr"], kv_indices=table["kv_indices"], kv_last_page_len=table["kv_last_page_len"])
    out, lse = check_attention(lambda out: wrapper.run(q_gpu, poisoned, out=out, return_lse=True),
                               spec.replace(mask=CustomMask()), q_gpu, tuple(x.cuda() for x in kv),
                               qo_indptr=np.arange(len(kv_lens) + 1), custom_mask=masks, **full)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()  # the empty request
