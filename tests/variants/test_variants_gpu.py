"""Every shipped variant, both spellings, against its fp64 reference (flashgen.testing.variants.example_attention):
decode over a paged cache, the portable prefill (ragged and paged), the Hopper prefill; fresh random inputs,
NaN-poisoned outputs, split requests (long KV, small batches), a CUDA-graph replay in decode, runtime scalars.

The kernels (every example x 4 kernel families) compile in parallel at the module's start, so the tests run
in seconds once the cache is warm.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flashgen
from flashgen.api.backends import kernels_for
from flashgen.spec import AttentionSpec, Causal, NoMask, Paged, Ragged, SlidingWindow
from flashgen.testing import request_kv, runtime_params
from flashgen.testing.check import nan_out
from flashgen.testing.layouts import random_batch
from flashgen.testing.reference import visible_mask
from flashgen.testing.tolerance import assert_attention_close
from flashgen.testing.variants import example_args, example_attention
from flashgen.variants.examples import EXAMPLES

pytestmark = pytest.mark.cuda

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
HEADS, GROUP, D = 2, 2, 128  # kv heads, q heads a kv head, head_dim
CASES = [(name, i) for name, pair in EXAMPLES.items() for i, v in enumerate(pair) if v is not None]
IDS = [f"{name}-{'traced' if i == 0 else 'cuda'}" for name, i in CASES]
# (qo_lens, kv_lens): long KV in a small batch, so decode and the portable prefill split requests (merge path)
# (the tree's bits cover 64 positions; the T5 reference walks every (query, key) pair in Python)
DECODE_LENS = {"tree": [37, 1, 64], "t5_bias": [300, 1, 260]}
PREFILL_LENS = {"tree": ([1, 17, 40], [5, 30, 64]), "t5_bias": ([1, 70, 40], [5, 260, 40])}


def _spec(name: str, spelling: int, layout, op: str) -> AttentionSpec:
    mask = NoMask() if op == "decode" or name == "prefix_lm" else Causal()
    return AttentionSpec(D, kv_layout=layout, mask=mask, variant=EXAMPLES[name][spelling])


FAMILIES = {"decode": ("decode", Paged(16)), "ragged": ("prefill", Ragged()), "paged": ("prefill", Paged(16)),
            "sm90": ("prefill_sm90", Ragged())}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of the module, compiled in parallel into the default cache (nvcc is one thread a kernel)."""
    jobs = [job for name, i in CASES for key, (op, layout) in FAMILIES.items() if key != "sm90" or HOPPER
            for job in _kernels(_spec(name, i, layout, op), op)]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job), jobs))


def _kernels(spec: AttentionSpec, op: str) -> tuple:
    """The (spec, op) kernels behind ``op``: the Hopper backend's (its K pre-pass where it runs one), else ``op``."""
    return tuple((s, o) for o, s in kernels_for(spec, "sm90")) if op == "prefill_sm90" else ((spec, op),)


def _generator(*key) -> torch.Generator:
    """A fresh generator per test (seeded by its parameters: reproducible, different across tests)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _gpu(args: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _reference(name, spec, args, q, kv, table, qo_lens):
    """fp64 and same-dtype (out, lse) of the batch, one request at a time."""
    params = runtime_params(spec)
    outs = {False: ([], []), True: ([], [])}
    start = 0
    for b, (k, v) in enumerate(request_kv(spec, kv, **table)):
        nq, nk = qo_lens[b], k.shape[0]
        q_pos, k_pos = torch.arange(nk - nq, nk), torch.arange(nk)
        visible = visible_mask(spec, params, q_pos, k_pos)
        for low in (False, True):
            o, lse = example_attention(name, args, q[start:start + nq], k, v, q_pos, k_pos, visible, params.sm_scale,
                                       batch=b, low_precision=low)
            outs[low][0].append(o)
            outs[low][1].append(lse)
        start += nq
    return [(torch.cat(o), torch.cat(lse)) for o, lse in (outs[False], outs[True])]


def _check(name, spec, args, q, kv, table, qo_lens, out, lse):
    (ref, ref_lse), (low, low_lse) = _reference(name, spec, args, q, kv, table, qo_lens)
    assert_attention_close(out.cpu(), ref, low)
    assert_attention_close(lse.cpu(), ref_lse, low_lse, dtype=q.dtype, name="lse")


def _cuda_table(table: dict) -> dict:
    return {k: v.cuda() if k == "kv_indices" else v for k, v in table.items()}


def _to_cuda(kv):
    return tuple(x.cuda() for x in kv) if isinstance(kv, tuple) else kv.cuda()


@pytest.mark.parametrize("name,spelling", CASES, ids=IDS)
def test_decode_paged(name, spelling):
    spec = _spec(name, spelling, Paged(16), "decode")
    g = _generator("decode", name, spelling)
    kv_lens = DECODE_LENS.get(name, [700, 1, 2100])
    q, kv, table = random_batch(spec, [1] * len(kv_lens), kv_lens, HEADS, GROUP, generator=g)
    args = example_args(name, heads=HEADS * GROUP, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, [1] * len(kv_lens), out, lse)


@pytest.mark.parametrize("family", ["ragged", "paged", "sm90"])
@pytest.mark.parametrize("name,spelling", CASES, ids=IDS)
def test_prefill(name, spelling, family):
    if family == "sm90" and not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    op, layout = FAMILIES[family]
    spec = _spec(name, spelling, layout, op)
    g = _generator("prefill", name, spelling, family)
    qo_lens, kv_lens = PREFILL_LENS.get(name, ([1, 130, 40], [5, 900, 40]))
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = example_args(name, heads=HEADS * GROUP, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90" if family == "sm90" else "portable")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, qo_lens, out, lse)


@pytest.mark.parametrize("family", ["decode", "ragged", "paged", "sm90"])
def test_sinks_with_a_sliding_window(family):
    """gpt-oss's attention as `flashgen plan-from-config` plans it: the learned per-head sinks on windowed layers,
    head_dim 64, in every family."""
    if family == "sm90" and not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    op, layout = FAMILIES[family] if family != "decode" else ("decode", Paged(16))
    spec = AttentionSpec(64, kv_layout=layout, mask=SlidingWindow(100), variant=EXAMPLES["sink"][0])
    g = _generator("sinks-window", family)
    qo_lens, kv_lens = ([1, 1, 1], [700, 1, 300]) if op == "decode" else ([1, 130, 40], [5, 900, 40])
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = example_args("sink", heads=HEADS * GROUP, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    if op == "decode":
        wrapper = flashgen.BatchDecodeWrapper(spec)
        wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    else:
        wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90" if family == "sm90" else "portable")
        wrapper.plan(qo_indptr=[0] + torch.tensor(qo_lens).cumsum(0).tolist(), num_qo_heads=HEADS * GROUP,
                     num_kv_heads=HEADS, **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check("sink", spec, args, q, kv, table, qo_lens, out, lse)


def test_decode_cuda_graph_replays_the_variant_tensors_in_place():
    """A captured decode reads the variant's tensors at their captured addresses: new contents, same graph."""
    name = "alibi"
    spec = _spec(name, 1, Paged(16), "decode")
    g = _generator("graph")
    kv_lens = [300, 17, 1200]
    batch = len(kv_lens)
    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=batch)
    q, kv, table = random_batch(spec, [1] * batch, kv_lens, HEADS, GROUP, generator=g)
    q_buf, kv_buf = q.cuda(), _to_cuda(kv)
    slopes = torch.zeros(HEADS * GROUP, device="cuda")
    wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    wrapper.run(q_buf, kv_buf, slopes=slopes)  # warm-up: load the kernel outside the capture
    out = torch.empty(batch, HEADS * GROUP, D, dtype=q.dtype, device="cuda")
    lse = torch.empty(batch, HEADS * GROUP, dtype=torch.float32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, kv_buf, out=out, return_lse=False, slopes=slopes)
    for _ in range(2):
        args = example_args(name, heads=HEADS * GROUP, max_kv=max(kv_lens), batch=batch, generator=g)
        q_new = torch.randn(q.shape, generator=g).to(q.dtype)
        q_buf.copy_(q_new)
        slopes.copy_(args["slopes"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        (ref, _), (low, _) = _reference(name, spec, args, q_new, kv, table, [1] * batch)
        assert_attention_close(out.cpu(), ref, low)


def test_scalars_are_runtime_values():
    """sigmoid's bias: two values, two right answers, one kernel."""
    name = "sigmoid"
    spec = _spec(name, 0, Ragged(), "prefill")
    g = _generator("scalars")
    qo_lens, kv_lens = [3, 70], [3, 300]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="portable")
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **table)
    kernels = set()
    for bias in (-4.0, 1.5):
        out, lse = wrapper.run(q.cuda(), _to_cuda(kv), out=nan_out(spec, q), return_lse=True, bias=bias)
        kernels.add(id(wrapper._impl._kernel))
        _check(name, spec, {"bias": bias}, q, kv, table, qo_lens, out, lse)
    assert len(kernels) == 1


def test_attention_takes_the_variant_arguments():
    name = "document"
    spec = _spec(name, 0, Ragged(), "prefill")
    g = _generator("attention")
    q, kv, table = random_batch(spec, [50], [80], HEADS, GROUP, generator=g)
    args = example_args(name, heads=HEADS * GROUP, max_kv=80, batch=1, generator=g)
    out, lse = flashgen.attention(q.cuda(), kv[0].cuda(), kv[1].cuda(), spec, return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, [50], out, lse)


@pytest.mark.parametrize("name", sorted({name for name, _ in CASES}))
def test_prefill_sm90_over_fp8_pages(name):
    """Each example over an fp8 (e4m3) paged cache on the Hopper backend: its K pre-pass dequantises the pages into
    16-bit ragged scratch and the 16-bit kernel runs the hooks; against the fp64 reference of the dequantised
    cache (fp8 values are exact in bf16)."""
    if not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    spec = _spec(name, 0, Paged(16), "prefill_sm90")
    g = _generator("prefill_fp8", name)
    qo_lens, kv_lens = PREFILL_LENS.get(name, ([1, 130, 40], [5, 900, 40]))
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    e4m3 = torch.float8_e4m3fn
    kv8 = tuple(x.to(e4m3) for x in kv) if isinstance(kv, tuple) else kv.to(e4m3)
    kv_ref = tuple(x.to(q.dtype) for x in kv8) if isinstance(kv8, tuple) else kv8.to(q.dtype)
    args = example_args(name, heads=HEADS * GROUP, max_kv=max(kv_lens), batch=len(kv_lens), generator=g)
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper = flashgen.BatchPrefillWrapper(spec.replace(kv_dtype="float8_e4m3fn"), backend="sm90")
    assert wrapper._impl.prepass
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **_cuda_table(table))
    out, lse = wrapper.run(q.cuda(), _to_cuda(kv8), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv_ref, table, qo_lens, out, lse)
