"""GPU tests of the Hopper prefill (prefill_sm90) against the fp64 reference: fresh random inputs, NaN-poisoned
outputs; lengths straddle the 128-row q tiles (64 rows a consumer warpgroup) and the 64/128-token KV tiles."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Causal, NoMask, Ragged
from flashgen.testing.check import check_attention
from flashgen.testing.layouts import random_batch

pytestmark = [pytest.mark.cuda, pytest.mark.hopper]

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5, 129]
KV = [5, 1, 17, 300, 64, 0, 130, 0, 257]

SPECS = [AttentionSpec(d, dtype=dtype, kv_layout=Ragged(), mask=mask)
         for d in (64, 128, 256) for dtype in ("bfloat16", "float16") for mask in (NoMask(), Causal())]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every variant of this module in parallel up front."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda s: flashgen.ensure_compiled(s, "prefill_sm90"), SPECS))


def run_and_check(spec, qo_lens, kv_lens, num_kv_heads, group, seed=0, **runtime):
    gen = torch.Generator().manual_seed(seed)
    q, kv, table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, generator=gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    runner = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    runner.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=q.shape[1],
                num_kv_heads=num_kv_heads, **runtime)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    return check_attention(lambda out: runner.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                           qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"], **runtime)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.uri)
def test_lengths_and_masks(spec):
    run_and_check(spec, QO, KV, 2, 4)


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_groups(group, causal):
    """Q by TMA boxes where the group divides 128 (all but 7: cp.async), O by TMA stores where it divides 16 (1 ...
    16; 7 and 32 from registers). 33 and 97 tokens are no whole number of a warp's 16 / group tokens (groups 1
    ... 8): a warp straddles the request's end and stores from registers, the item's rows past it are the next
    request's tokens."""
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
    run_and_check(spec, [33, 0, 200, 1, 97], [90, 4, 200, 1, 97], 2, group)


@pytest.mark.parametrize("group", [2, 7])
def test_q_rows_past_the_batch_hold_nan(group):
    """With CUDA-graph capacity q has max_total_q rows: the last items' Q boxes (TMA) read rows past the batch,
    here NaN. A row's softmax and P V are its own and rows past a request are never written: out and lse
    match."""
    spec = AttentionSpec(64, kv_layout=Ragged(), mask=Causal())
    qo_lens, kv_lens, heads, max_q = [33, 70], [40, 100], 2, 300
    q, kv, table = random_batch(spec, qo_lens, kv_lens, heads, group, generator=torch.Generator().manual_seed(3))
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=4, max_total_q=max_q)
    assert wrapper.backend == "sm90"
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=heads * group,
                 num_kv_heads=heads)
    pool_q = torch.full((max_q, heads * group, 64), float("nan"), dtype=q.dtype, device="cuda")
    pool_q[: q.shape[0]] = q.cuda()
    kv_gpu = tuple(x.cuda() for x in kv)
    check_attention(lambda out: wrapper.run(pool_q, kv_gpu, out=out, return_lse=True), spec, q, kv, rows=max_q,
                    qo_indptr=qo_indptr, kv_indptr=table["kv_indptr"])


@pytest.mark.parametrize("causal", [False, True])
def test_long_single_request(causal):
    """Many KV tiles through the 2-stage rings (barrier phases wrap many times), qo == kv and qo < kv."""
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
    run_and_check(spec, [1000], [1000], 1, 4)
    run_and_check(spec, [300], [2000], 2, 2, seed=1)


def test_sm_scale_and_empty_batch():
    spec = SPECS[3]  # d64 bf16 causal
    run_and_check(spec, [70, 5], [70, 300], 2, 4, sm_scale=0.3)
    run_and_check(spec, [4, 0], [0, 0], 1, 2)  # no KV at all: out = 0, lse = -inf


def test_unsupported_specs_are_refused():
    from flashgen import Paged, RoPE, SpecError

    with pytest.raises(SpecError, match="head_dim"):
        flashgen.BatchPrefillWrapper(AttentionSpec(192, head_dim_vo=128, kv_layout=Paged(24)), backend="sm90")
    with pytest.raises(SpecError, match="RoPE over unrotated K on the sm90 backend turns K in a pre-pass that is not "
                       "CUDA-graph safe"):  # the pre-pass: not yet
        flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), pos_encoding=RoPE()), backend="sm90",
                                     use_cuda_graph=True, max_batch_size=4, max_total_q=64)


def test_q_and_out_tensor_maps_are_memoised():
    """run() encodes the q and out tensor maps once per (address, shape, strides, group), and refuses a q that is
    not 16-byte aligned (a TMA map's address)."""
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal())
    q, kv, table = random_batch(spec, [40], [40], 2, 4, generator=torch.Generator().manual_seed(4))
    runner = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    runner.plan(qo_indptr=[0, 40], kv_indptr=table["kv_indptr"].numpy(), num_qo_heads=8, num_kv_heads=2)
    q, kv = q.cuda(), tuple(x.cuda() for x in kv)
    out = torch.empty_like(q)
    first = runner.run(q, kv, out=out).clone()
    maps = runner._impl._maps
    assert len(maps) == 2  # q (box of 32 tokens) and out (4 tokens)
    again = runner.run(q, kv, out=out)
    assert len(maps) == 2 and torch.equal(first, again)
    runner.run(q, kv, out=torch.empty_like(q))
    assert len(maps) == 3
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    with pytest.raises(ValueError, match="aligned"):
        runner.run(shifted, kv)
