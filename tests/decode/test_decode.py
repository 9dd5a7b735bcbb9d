"""GPU tests of batch decode against the fp64 reference: fresh random inputs, NaN-poisoned outputs and
NaN in every cache slot no request owns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import ALiBi, AttentionSpec, Paged, Ragged, RoPE, SlidingWindow
from flashgen.plan import PlanError, csr_to_block_table
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import fp8_codes, random_batch
from graph_replay import fill_pools, fresh_page_ids, replay_after_replanning

pytestmark = pytest.mark.cuda


def make_batch(spec: AttentionSpec, kv_lens, num_kv_heads: int, group: int, *, combined=False, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    return random_batch(spec, [1] * len(kv_lens), kv_lens, num_kv_heads, group, combined=combined, generator=gen)


def to_cuda(kv):
    return tuple(x.cuda() for x in kv) if isinstance(kv, tuple) else kv.cuda()


def decode_indptr(q):
    """One query token a request."""
    return list(range(q.shape[0] + 1))


def run_and_check(spec, q, kv, table, num_kv_heads, *, device_pages=True, plan_kwargs=None, **runtime):
    """Plan, run into NaN-poisoned out / lse and check against the fp64 reference; returns (out, lse)."""
    wrapper = flashgen.BatchDecodeWrapper(spec)
    tab = dict(table)
    if device_pages and "kv_indices" in tab:
        tab["kv_indices"] = tab["kv_indices"].cuda()
    wrapper.plan(num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, **tab, **runtime, **(plan_kwargs or {}))
    q_gpu, kv_gpu = q.cuda(), to_cuda(kv)
    return check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                           qo_indptr=decode_indptr(q), **table, **runtime)


MIXED = [0, 1, 17, 300, 1000, 64, 2049, 5]


@pytest.mark.parametrize("page_size,group,order,combined", [
    (1, 4, "NHD", False), (3, 1, "HND", True), (16, 4, "NHD", True), (17, 7, "NHD", False),
    (64, 8, "HND", False), (256, 4, "NHD", False), (16, 1, "HND", False), (5, 8, "NHD", True),
])
def test_paged_csr(page_size, group, order, combined):
    spec = AttentionSpec(128, kv_layout=Paged(page_size, order))
    q, kv, table = make_batch(spec, MIXED, 2, group, combined=combined)
    run_and_check(spec, q, kv, table, 2)


@pytest.mark.parametrize("page_size", [1, 16, 33])
def test_paged_block_table(page_size):
    spec = AttentionSpec(128, kv_layout=Paged(page_size))
    q, kv, table = make_batch(spec, MIXED, 2, 4)
    page_size_ = spec.kv_layout.page_size
    block_table, seq_lens = csr_to_block_table(table["kv_indptr"], table["kv_indices"], table["kv_last_page_len"],
                                               page_size_)
    bt = {"block_table": block_table, "seq_lens": seq_lens}
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, block_table=block_table.cuda(), seq_lens=seq_lens)
    out = wrapper.run(q.cuda(), to_cuda(kv))  # the wrapper's own out
    assert_matches_reference(spec, q, kv, out, qo_indptr=decode_indptr(q), **bt)


@pytest.mark.parametrize("spec_kwargs,runtime", [
    ({"pos_encoding": RoPE(10000.0, 1.0)}, {}),
    ({"pos_encoding": RoPE(500000.0, 8.0)}, {"rope_theta": 1e6, "rope_scale": 2.0}),
    ({"pos_encoding": ALiBi()}, {}),
    ({"soft_cap": 30.0}, {}),
    ({"soft_cap": 5.0}, {"soft_cap": 2.0}),
    ({"mask": SlidingWindow(100)}, {}),
    ({"mask": SlidingWindow(7)}, {"window_left": 1500}),
    ({"sm_scale": 0.3}, {}),
    ({"dtype": "float16"}, {}),
    ({"dtype": "float16", "pos_encoding": RoPE(), "soft_cap": 20.0, "mask": SlidingWindow(64)}, {}),
])
def test_options(spec_kwargs, runtime):
    spec = AttentionSpec(128, kv_layout=Paged(16), **spec_kwargs)
    q, kv, table = make_batch(spec, MIXED, 2, 4)
    run_and_check(spec, q, kv, table, 2, **runtime)


@pytest.mark.parametrize("head_dim,group", [(64, 4), (256, 2), (64, 16), (128, 20)])
def test_head_dims_and_large_groups(head_dim, group):
    spec = AttentionSpec(head_dim, kv_layout=Paged(16))
    q, kv, table = make_batch(spec, [700, 3, 1], 1, group)
    run_and_check(spec, q, kv, table, 1)


@pytest.mark.parametrize("kv_dtype,dtype,page_size,head_dim,extra,kv_lens", [
    ("float8_e4m3fn", "bfloat16", 16, 128, {}, MIXED),
    ("float8_e5m2", "float16", 1, 128, {}, MIXED),
    ("float8_e4m3fn", "float16", 5, 128, {}, MIXED),
    ("float8_e4m3fn", "bfloat16", 16, 128, {"pos_encoding": RoPE(500000.0, 8.0)}, MIXED),
    ("float8_e5m2", "float16", 1, 128, {"pos_encoding": RoPE()}, [3, 700]),
    ("float8_e4m3fn", "bfloat16", 16, 256, {"pos_encoding": RoPE()}, [900, 1, 64]),
    ("float8_e5m2", "bfloat16", 16, 256, {"pos_encoding": ALiBi(), "soft_cap": 20.0}, [900, 1, 64]),
    ("float8_e4m3fn", "bfloat16", 16, 128, {"mask": SlidingWindow(300)}, [16000, 3, 900]),  # split requests
])
def test_fp8_kv_with_scales(kv_dtype, dtype, page_size, head_dim, extra, kv_lens):
    spec = AttentionSpec(head_dim, dtype=dtype, kv_dtype=kv_dtype, kv_layout=Paged(page_size), **extra)
    q, kv16, table = make_batch(spec.replace(kv_dtype=dtype), kv_lens, 2, 4)
    fp8 = getattr(torch, kv_dtype)
    k_scale, v_scale = 0.37, 1.9
    kv8 = tuple((x.float() / scale).to(fp8) for x, scale in zip(kv16, (k_scale, v_scale)))  # NaN spares stay NaN
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, k_scale=k_scale, v_scale=v_scale,
                 **dict(table, kv_indices=table["kv_indices"].cuda()))
    q_gpu, kv8_gpu = q.cuda(), to_cuda(kv8)
    kv_ref = (kv8[0].double() * k_scale, kv8[1].double() * v_scale)  # what the fp8 cache means
    check_attention(lambda out: wrapper.run(q_gpu, kv8_gpu, out=out, return_lse=True), spec, q, kv_ref,
                    kv_dtype=fp8, qo_indptr=decode_indptr(q), **table)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("subnormal_only", [False, True])
def test_fp8_every_code(kv_dtype, dtype, subnormal_only):
    """Every finite fp8 code converts exactly, subnormals included: K and V drawn from all finite codes (or only the
    subnormals, scaled up to order ten, so that a flushed subnormal fails loudly)."""
    spec = AttentionSpec(128, dtype=dtype, kv_dtype=kv_dtype, kv_layout=Paged(16))
    q, kv16, table = make_batch(spec.replace(kv_dtype=dtype), [300, 17, 1], 2, 4)
    fp8 = getattr(torch, kv_dtype)
    gen = torch.Generator().manual_seed(int(np.random.randint(1 << 30)))
    kv8 = tuple(fp8_codes(x, fp8, subnormal_only, gen) for x in kv16)
    top_k, top_v = (x.float().nan_to_num().abs().max().item() for x in kv8)
    k_scale, v_scale = 4.0 / top_k, 10.0 / top_v  # keys up to 4 (logits of order one), values up to 10
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, k_scale=k_scale, v_scale=v_scale,
                 **dict(table, kv_indices=table["kv_indices"].cuda()))
    q_gpu, kv8_gpu = q.cuda(), to_cuda(kv8)
    kv_ref = (kv8[0].double() * k_scale, kv8[1].double() * v_scale)
    check_attention(lambda out: wrapper.run(q_gpu, kv8_gpu, out=out, return_lse=True), spec, q, kv_ref,
                    kv_dtype=fp8, qo_indptr=decode_indptr(q), **table)


def test_ragged():
    spec = AttentionSpec(128, kv_layout=Ragged())
    q, kv, table = make_batch(spec, MIXED, 2, 4)
    run_and_check(spec, q, kv, table, 2)


def test_host_page_ids_are_validated_and_copied():
    spec = AttentionSpec(128, kv_layout=Paged(16))
    q, kv, table = make_batch(spec, [40, 100], 2, 4)
    run_and_check(spec, q, kv, table, 2, device_pages=False)


def test_split_and_unsplit_agree():
    spec = AttentionSpec(128, kv_layout=Paged(16))
    q, kv, table = make_batch(spec, [16000, 3, 900], 2, 4)
    split, _ = run_and_check(spec, q, kv, table, 2)
    whole, _ = run_and_check(spec, q, kv, table, 2, plan_kwargs={"enable_split": False})
    torch.testing.assert_close(split.float(), whole.float(), atol=2e-2, rtol=0)


def test_cuda_graph_replay_after_replanning():
    spec = AttentionSpec(128, kv_layout=Paged(16))
    max_batch, heads, group, pool_pages = 16, 2, 4, 1200
    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch)
    pool_q = torch.empty(max_batch, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    indices_buf = torch.zeros(pool_pages, dtype=torch.int32, device="cuda")

    def load(lens):
        """A fresh batch written into the same q, cache and page-id storage, then planned."""
        q, kv, table = make_batch(spec, lens, heads, group)
        fill_pools(pool_q, pool_kv, q, kv)
        indices_buf[: table["kv_indices"].numel()].copy_(table["kv_indices"])
        wrapper.plan(num_qo_heads=heads * group, num_kv_heads=heads, kv_indptr=table["kv_indptr"],
                     kv_indices=indices_buf, kv_last_page_len=table["kv_last_page_len"])
        return q, kv, table

    load([5000, 17, 1, 300])
    wrapper.run(pool_q, pool_kv)  # warm up (compile, load) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wrapper.run(pool_q, pool_kv, return_lse=True)
    for lens in ([9000, 2, 700, 33, 1, 64, 4000, 12, 5, 6, 7, 8], [1], [5000, 17, 1, 300], [0] * 16):
        q, kv, table = load(lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        n = len(lens)
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=decode_indptr(q), **table)


@pytest.mark.parametrize("form", ["csr", "block_table"])
def test_cuda_graph_replay_with_fresh_device_page_ids(form):
    """Each plan passes its page ids in a new device tensor (a new address, other pages; the old tensors zeroed):
    the wrapper copies them into its own buffer at plan time, and the captured graph reads that buffer."""
    spec = AttentionSpec(128, kv_layout=Paged(16))
    max_batch, heads, group, pool_pages = 16, 2, 4, 1200
    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch,
                                          max_num_pages=pool_pages, max_pages_per_request=600)
    pool_q = torch.empty(max_batch, heads * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_kv = tuple(torch.empty(pool_pages, 16, heads, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    held = []

    def load(lens):
        q, kv, table = make_batch(spec, lens, heads, group)
        fill_pools(pool_q, pool_kv, q, kv, nan_rest=True)
        pages, ref_pages = fresh_page_ids(table, form, 16, held)
        wrapper.plan(num_qo_heads=heads * group, num_kv_heads=heads, **pages)
        return q, kv, ref_pages

    def check(loaded, out, lse):
        q, kv, ref_pages = loaded
        n = q.shape[0]
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=decode_indptr(q), **ref_pages)

    replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check, ([5000, 17, 1, 300],),
                            [([9000, 2, 700, 33, 1, 64, 4000, 12, 5, 6, 7, 8],), ([1],), ([5000, 17, 1, 300],),
                             ([0] * 16,), ([33] * 16,)])


def test_bad_arguments_are_named():
    spec = AttentionSpec(128, kv_layout=Paged(16))
    q, kv, table = make_batch(spec, [40, 100], 2, 4)
    wrapper = flashgen.BatchDecodeWrapper(spec)
    bad = dict(table, kv_indices=table["kv_indices"] + 1000)
    with pytest.raises(PlanError, match=r"kv_indices\[0\] = \d+ is outside the page pool"):
        wrapper.plan(num_qo_heads=8, num_kv_heads=2, num_pages=kv[0].shape[0], **bad)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, **bad)  # pool size unknown: checked against the cache at run
    with pytest.raises(ValueError, match="kv_indices: page id .* outside kv_cache's"):
        wrapper.run(q.cuda(), to_cuda(kv))
    with pytest.raises(PlanError, match="kv_last_page_len"):
        wrapper.plan(num_qo_heads=8, num_kv_heads=2, **dict(table, kv_last_page_len=table["kv_last_page_len"] + 16))
    with pytest.raises(PlanError, match="kv_indptr: is a cuda tensor"):
        wrapper.plan(num_qo_heads=8, num_kv_heads=2, **dict(table, kv_indptr=table["kv_indptr"].cuda()))
    with pytest.raises(PlanError, match="num_qo_heads"):
        wrapper.plan(num_qo_heads=7, num_kv_heads=2, **table)
    wrapper.plan(num_qo_heads=8, num_kv_heads=2, **table)
    with pytest.raises(ValueError, match="^q: expected shape"):
        wrapper.run(q[:1].cuda(), to_cuda(kv))
    with pytest.raises(TypeError, match="^q: expected dtype"):
        wrapper.run(q.half().cuda(), to_cuda(kv))
    with pytest.raises(ValueError, match=r"^kv_cache \(k\): expected shape"):
        wrapper.run(q.cuda(), (kv[0][:, :8].cuda(), kv[1][:, :8].cuda()))
    with pytest.raises(TypeError, match=r"^kv_cache \(k\): expected dtype"):
        wrapper.run(q.cuda(), (kv[0].half().cuda(), kv[1].half().cuda()))
    with pytest.raises(flashgen.SpecError, match="kv_dtype"):
        flashgen.BatchDecodeWrapper(AttentionSpec(64, kv_dtype="float8_e4m3fn"))
    with pytest.raises(PlanError, match="k_scale"):
        wrapper.plan(num_qo_heads=8, num_kv_heads=2, k_scale=2.0, **table)
