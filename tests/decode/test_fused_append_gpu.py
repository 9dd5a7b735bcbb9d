"""GPU tests of fused append + decode (``BatchDecodeWrapper(..., kernel_options={"append": True}).run(q, kv_cache,
k_new=..., v_new=...)``): against ``flashgen.append_kv`` then a plain decode, and against the fp64 reference over the
cache append_kv leaves; the cache's bytes equal append_kv's; outputs poisoned with NaN, and the new token's slot
NaN before the launch (so a read of it before the write would show). bf16 and fp8 caches, RoPE with K turned as
read, Llama-3.1 and YaRN scaling, caches holding rotated K, page sizes 1 / 16 / 17, NHD and HND, split-KV long
requests, GQA groups of more than 16 (several qo tiles share the new row), and a CUDA-graph replay. Run on an H200:

    python -m pytest -q tests/decode/test_fused_append_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Llama31Scaling, Paged, RoPE, YaRNScaling
from flashgen.testing import assert_cache_close
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch

pytestmark = pytest.mark.cuda
APPEND = {"append": True}
HEADS = 2
L31 = Llama31Scaling()


def _batch(spec: AttentionSpec, kv_lens, group: int, seed: int):
    """q, the 16-bit cache pair (CPU; NaN in slots no request owns) and the CSR table of requests whose lengths
    count the new token; the new rows k_new / v_new."""
    gen = torch.Generator().manual_seed(seed)
    plain = spec.replace(kv_dtype=spec.dtype, pos_encoding=None)
    q, kv, table = random_batch(plain, [1] * len(kv_lens), kv_lens, HEADS, group, generator=gen)
    dtype = getattr(torch, spec.dtype)
    k_new = torch.randn(len(kv_lens), HEADS, spec.head_dim, generator=gen).to(dtype)
    v_new = torch.randn(len(kv_lens), HEADS, spec.head_dim_vo, generator=gen).to(dtype)
    return q, kv, table, k_new, v_new


def _new_slots(table, kv_lens, page_size):
    """(page, offset) of each request's new token (place kv_len - 1)."""
    last = np.asarray(kv_lens) - 1
    entries = table["kv_indptr"].numpy()[:-1] + last // page_size
    return torch.from_numpy(table["kv_indices"].numpy()[entries]).long(), torch.from_numpy(last % page_size).long()


def _device_cache(spec, kv, scales, table, kv_lens):
    """The cache on the GPU in the spec's kv dtype (fp8: x / scale), the new tokens' slots NaN."""
    kv_dtype = getattr(torch, spec.kv_dtype)
    fp8 = spec.kv_dtype.startswith("float8")
    page, offset = _new_slots(table, kv_lens, spec.kv_layout.page_size)
    out = []
    for x, scale in zip(kv, scales):
        x = x.float() / scale if fp8 else x.clone()
        if spec.kv_layout.order == "NHD":
            x[page, offset] = float("nan")
        else:
            x[page, :, offset] = float("nan")
        out.append(x.to(kv_dtype).cuda())
    return tuple(out)


def _plan(wrapper, table, group, scales, fp8):
    extra = {"k_scale": scales[0], "v_scale": scales[1]} if fp8 else {}
    wrapper.plan(num_qo_heads=HEADS * group, num_kv_heads=HEADS, kv_indptr=table["kv_indptr"],
                 kv_indices=table["kv_indices"].cuda(), kv_last_page_len=table["kv_last_page_len"], **extra)


def _append(spec, k_new, v_new, cache, table, kv_lens, scales):
    """flashgen.append_kv of the new rows into ``cache`` (K rotated when the spec's cache holds rotated K)."""
    rope = spec.pos_encoding
    fp8 = spec.kv_dtype.startswith("float8")
    flashgen.append_kv(k_new.cuda(), v_new.cuda(), cache, kv_indptr=table["kv_indptr"].cuda(),
                       kv_indices=table["kv_indices"].cuda(),
                       batch_indices=torch.arange(len(kv_lens), dtype=torch.int32, device="cuda"),
                       positions=torch.tensor(kv_lens, dtype=torch.int32, device="cuda") - 1,
                       kv_layout=spec.kv_layout.order, rope=rope if isinstance(rope, RoPE) and rope.k_rotated else None,
                       k_scale=scales[0] if fp8 else None, v_scale=scales[1] if fp8 else None)


def _reference_kv(spec, cache, scales):
    """The cache as the reference reads it: fp8 dequantised (code * scale)."""
    if spec.kv_dtype.startswith("float8"):
        return tuple(x.cpu().double() * s for x, s in zip(cache, scales))
    return tuple(x.cpu() for x in cache)


def _same_cache(spec, got, want):
    """The fused launch's cache bytes against append_kv's: bit-identical, or (K rotated on the way in) within
    one unit in the last place (the rotation's fp32 math may contract differently in the two kernels)."""
    rope = spec.pos_encoding
    if isinstance(rope, RoPE) and rope.k_rotated:
        assert_cache_close(tuple(x.cpu() for x in got), tuple(x.cpu() for x in want))
    else:
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [  # (spec, kv_lens, group, scales)
    (AttentionSpec(128, kv_layout=Paged(16)), [1, 17, 300, 1000, 64, 2049, 5], 4, None),
    (AttentionSpec(128, kv_layout=Paged(1), pos_encoding=RoPE()), [1, 2, 33, 700], 4, None),
    (AttentionSpec(128, dtype="float16", kv_layout=Paged(17, "HND"), pos_encoding=RoPE(500000.0, scaling=L31)),
     [18, 17, 1, 400], 8, None),
    (AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(500000.0, scaling=L31, k_rotated=True)),
     [16, 17, 900, 3], 4, None),
    (AttentionSpec(128, kv_layout=Paged(16, "HND"), pos_encoding=RoPE(scaling=YaRNScaling(), k_rotated=True)),
     [5, 4097, 64], 4, None),
    (AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True)), [16000, 3, 900], 4, None),  # split
    (AttentionSpec(128, kv_layout=Paged(17), pos_encoding=RoPE()), [2000, 35], 32, None),  # two qo tiles
    (AttentionSpec(256, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True)), [900, 1, 64], 4, None),
    (AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16)), [1, 17, 300, 2049], 4, (0.37, 1.9)),
    (AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(17),
                   pos_encoding=RoPE(500000.0, scaling=L31, k_rotated=True)), [18, 700, 1], 4, (0.5, 2.0)),
    (AttentionSpec(128, dtype="float16", kv_dtype="float8_e5m2", kv_layout=Paged(1), pos_encoding=RoPE()),
     [3, 700], 8, (1.0, 1.0)),
    (AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True)),
     [16000, 3, 900], 4, (0.37, 1.9)),  # split
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_equals_append_then_decode(case):
    spec, kv_lens, group, scales = CASES[case]
    fp8 = spec.kv_dtype.startswith("float8")
    scales = scales or (1.0, 1.0)
    q, kv, table, k_new, v_new = _batch(spec, kv_lens, group, seed=case)
    q_gpu = q.cuda()

    sequential = _device_cache(spec, kv, scales, table, kv_lens)
    _append(spec, k_new, v_new, sequential, table, kv_lens, scales)
    plain = flashgen.BatchDecodeWrapper(spec)
    _plan(plain, table, group, scales, fp8)
    out_seq, lse_seq = plain.run(q_gpu, sequential, return_lse=True)

    fused_cache = _device_cache(spec, kv, scales, table, kv_lens)
    fused = flashgen.BatchDecodeWrapper(spec, kernel_options=APPEND)
    _plan(fused, table, group, scales, fp8)
    kv_ref = _reference_kv(spec, sequential, scales)
    out, lse = check_attention(
        lambda out: fused.run(q_gpu, fused_cache, out=out, return_lse=True, k_new=k_new.cuda(), v_new=v_new.cuda()),
        spec, q, kv_ref, kv_dtype=getattr(torch, spec.kv_dtype) if fp8 else None,
        qo_indptr=list(range(len(kv_lens) + 1)), **table)
    _same_cache(spec, fused_cache, sequential)
    torch.testing.assert_close(out.float(), out_seq.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_seq, atol=1e-3, rtol=1e-3)


def test_fused_with_strided_new_rows_from_a_qkv_projection():
    spec = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True))
    kv_lens, group = [40, 100, 1], 4
    q, kv, table, k_new, v_new = _batch(spec, kv_lens, group, seed=7)
    qkv = torch.cat([q, k_new, v_new], dim=1).cuda()  # [batch, 8 + 2 + 2, 128]
    q_gpu, k_gpu, v_gpu = qkv[:, :8].contiguous(), qkv[:, 8:10], qkv[:, 10:12]
    sequential = _device_cache(spec, kv, (1.0, 1.0), table, kv_lens)
    _append(spec, k_new, v_new, sequential, table, kv_lens, (1.0, 1.0))
    fused_cache = _device_cache(spec, kv, (1.0, 1.0), table, kv_lens)
    fused = flashgen.BatchDecodeWrapper(spec, kernel_options=APPEND)
    _plan(fused, table, group, (1.0, 1.0), False)
    out, lse = fused.run(q_gpu, fused_cache, return_lse=True, k_new=k_gpu, v_new=v_gpu)
    assert_matches_reference(spec, q, _reference_kv(spec, sequential, (1.0, 1.0)), out, lse,
                             qo_indptr=list(range(len(kv_lens) + 1)), **table)
    _same_cache(spec, fused_cache, sequential)


def test_fused_cuda_graph_replay_after_replanning():
    """One captured fused launch replayed for batches re-planned into the same pools: each replay writes that
    batch's new rows and attends; out / lse poisoned before each replay."""
    spec = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(500000.0, scaling=L31, k_rotated=True))
    max_batch, group, pool_pages = 16, 4, 1400
    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, kernel_options=APPEND)
    pool_q = torch.zeros(max_batch, HEADS * group, 128, dtype=torch.bfloat16, device="cuda")
    pool_new = [torch.zeros(max_batch, HEADS, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    pool_kv = tuple(torch.empty(pool_pages, 16, HEADS, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    indices = torch.zeros(pool_pages, dtype=torch.int32, device="cuda")
    state = {}

    def load(lens, seed):
        q, kv, table, k_new, v_new = _batch(spec, lens, group, seed)
        cache = _device_cache(spec, kv, (1.0, 1.0), table, lens)
        for pool, part in zip(pool_kv, cache):
            pool.fill_(float("nan"))
            pool[: part.shape[0]].copy_(part)
        pool_q[: len(lens)].copy_(q)
        pool_new[0][: len(lens)].copy_(k_new)
        pool_new[1][: len(lens)].copy_(v_new)
        indices[: table["kv_indices"].numel()].copy_(table["kv_indices"])
        wrapper.plan(num_qo_heads=HEADS * group, num_kv_heads=HEADS, kv_indptr=table["kv_indptr"], kv_indices=indices,
                     kv_last_page_len=table["kv_last_page_len"])
        sequential = tuple(x.clone() for x in cache)
        _append(spec, k_new, v_new, sequential, table, lens, (1.0, 1.0))
        state.update(q=q, table=table, sequential=sequential, n=len(lens), pages=cache[0].shape[0])

    load([5000, 17, 1, 300], 0)
    wrapper.run(pool_q, pool_kv, k_new=pool_new[0], v_new=pool_new[1])  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = wrapper.run(pool_q, pool_kv, return_lse=True, k_new=pool_new[0], v_new=pool_new[1])
    for seed, lens in enumerate(([9000, 2, 700, 33, 1, 64, 4000, 12, 5, 6, 7, 8], [1], [5000, 17, 1, 300], [3] * 16)):
        load(lens, seed + 1)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        n, pages = state["n"], state["pages"]
        assert_matches_reference(spec, state["q"], _reference_kv(spec, state["sequential"], (1.0, 1.0)), out[:n],
                                 lse[:n], qo_indptr=list(range(n + 1)), **state["table"])
        _same_cache(spec, tuple(x[:pages] for x in pool_kv), state["sequential"])


@pytest.mark.parametrize("spec", [
    AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(500000.0, scaling=L31, k_rotated=True)),
    AttentionSpec(128, kv_layout=Paged(1), pos_encoding=RoPE(scaling=YaRNScaling(8.0, 2048))),
    AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(17), pos_encoding=RoPE(scaling=L31)),
], ids=lambda s: s.uri)
def test_plain_decode_with_scaled_rope_and_rotated_caches(spec):
    """Without the append: q (and K where it turns as read) scaled, against the fp64 reference."""
    kv_lens, group = [1, 17, 900, 4100], 4
    q, kv, table, _, _ = _batch(spec, kv_lens, group, seed=11)
    fp8 = spec.kv_dtype.startswith("float8")
    cache = tuple(x.to(getattr(torch, spec.kv_dtype)).cuda() for x in kv)
    wrapper = flashgen.BatchDecodeWrapper(spec)
    _plan(wrapper, table, group, (1.0, 1.0), fp8)
    check_attention(lambda out: wrapper.run(q.cuda(), cache, out=out, return_lse=True), spec, q,
                    _reference_kv(spec, cache, (1.0, 1.0)), kv_dtype=getattr(torch, spec.kv_dtype) if fp8 else None,
                    qo_indptr=list(range(len(kv_lens) + 1)), **table)


@pytest.mark.parametrize("backend", ["portable", "auto"])
def test_prefill_over_a_rotated_cache_turns_q_only(backend):
    """RoPE(k_rotated=True) in the prefill: the portable kernel turns q as it loads it; on Hopper auto picks the sm90
    kernel, which turns q in shared memory (no pre-pass)."""
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=flashgen.Causal(), pos_encoding=RoPE(500000.0, k_rotated=True))
    gen = torch.Generator().manual_seed(3)
    qo_lens, kv_lens = [5, 1, 300], [40, 17, 1000]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, 4, generator=gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend=backend)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert wrapper.backend == ("sm90" if backend == "auto" and hopper else "portable")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * 4, num_kv_heads=HEADS, **table)
    kv_gpu = tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(q.cuda(), kv_gpu, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo_indptr, **table)
