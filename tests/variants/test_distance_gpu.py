"""The pair hooks' float ``distance`` (kv_idx - qo_idx) against the fp64 reference: a CUDA score hook and a mask hook
that read it (ALiBi's bias and a band |distance| <= reach), in decode, the portable prefill (ragged and paged) and the
Hopper prefill (ragged and paged, its mask hook's tile lists on, and at explicit positions whose keys are two apart,
so that a distance taken from places instead of positions fails); NoMask, so that keys lie on both sides of a query;
fresh random inputs, NaN-poisoned outputs, split requests."""

from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.spec import AttentionSpec, NoMask, Paged, Ragged, Scalar, Tensor, Variant
from flashgen.testing import request_kv, runtime_params
from flashgen.testing.check import nan_out
from flashgen.testing.layouts import random_batch
from flashgen.testing.reference import visible_mask
from flashgen.testing.tolerance import assert_attention_close
from flashgen.testing.variants import example_attention
from test_variants_gpu import _cuda_table, _generator, _gpu, _to_cuda

pytestmark = pytest.mark.cuda

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
HEADS, GROUP, D = 2, 2, 128
BAND = Variant(score="return logit + slopes[qo_head] * distance;",
               mask="return fabsf(distance) <= static_cast<float>(reach);",
               tensors=[Tensor("slopes", "float32", 1)], scalars=[Scalar("reach", "int32")])
FAMILIES = {"decode": ("decode", Paged(16)), "ragged": ("prefill", Ragged()), "paged": ("prefill", Paged(16)),
            "sm90_ragged": ("prefill_sm90", Ragged()), "sm90_paged": ("prefill_sm90", Paged(16))}


def _args(g: torch.Generator, reach: int) -> dict:
    return {"slopes": torch.rand(HEADS * GROUP, generator=g) * 0.5, "reach": reach}


def _check(spec, args, q, kv, table, qo_lens, out, lse, positions):
    """``positions``: per request, its (query, key) true positions."""
    params = runtime_params(spec)
    refs = {False: ([], []), True: ([], [])}
    start = 0
    for b, (k, v) in enumerate(request_kv(spec, kv, **table)):
        nq = qo_lens[b]
        q_pos, k_pos = positions[b]
        visible = visible_mask(spec, params, q_pos, k_pos)
        visible &= (k_pos[None, :] - q_pos[:, None]).abs() <= args["reach"]
        for low in (False, True):
            o, s = example_attention("alibi", args, q[start:start + nq], k, v, q_pos, k_pos, visible,
                                     params.sm_scale, batch=b, low_precision=low)
            refs[low][0].append(o)
            refs[low][1].append(s)
        start += nq
    (ref, ref_lse), (low, low_lse) = [(torch.cat(o), torch.cat(s)) for o, s in (refs[False], refs[True])]
    assert_attention_close(out.cpu(), ref, low)
    assert_attention_close(lse.cpu(), ref_lse, low_lse, dtype=q.dtype, name="lse")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_cuda_hook_reads_the_distance(family):
    op, layout = FAMILIES[family]
    if op == "prefill_sm90" and not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    spec = AttentionSpec(D, kv_layout=layout, mask=NoMask(), variant=BAND)
    g = _generator("distance", family)
    if op == "decode":
        qo_lens, kv_lens = [1, 1, 1], [700, 1, 2100]
    else:
        qo_lens, kv_lens = [1, 130, 40, 300], [5, 900, 40, 300]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = _args(g, reach=173)
    if op == "decode":
        wrapper = flashgen.BatchDecodeWrapper(spec)
        wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    else:
        wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90" if op == "prefill_sm90" else "portable")
        qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
        wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    positions = [(torch.arange(nk - nq, nk), torch.arange(nk)) for nq, nk in zip(qo_lens, kv_lens)]
    _check(spec, args, q, kv, table, qo_lens, out, lse, positions)


def test_the_distance_at_explicit_positions():
    """The Hopper prefill with explicit positions: keys at even positions, queries at odd ones, so that the
    distance of places (one apart) differs from that of positions (two apart)."""
    if not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    spec = AttentionSpec(D, kv_layout=Ragged(), mask=NoMask(), variant=BAND)
    g = _generator("distance_positions")
    qo_lens, kv_lens = [3, 150, 64], [300, 700, 64]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = _args(g, reach=301)
    positions = [(2 * torch.arange(nk - nq, nk) + 1 + s, 2 * torch.arange(nk) + s)
                 for nq, nk, s in zip(qo_lens, kv_lens, (0, 40, 7))]
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90", kernel_options={"positions": True})
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                 kv_page_pos=torch.cat([k for _, k in positions]).int().numpy(),
                 q_pos=torch.cat([p for p, _ in positions]).int().numpy(), **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(spec, args, q, kv, table, qo_lens, out, lse, positions)
