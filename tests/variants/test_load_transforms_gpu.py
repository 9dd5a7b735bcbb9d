"""q_transform / k_transform against the fp64 reference: the raw element through the hook, then the spec's RoPE
(flashgen.testing.reference.attend over the transformed q and k). Decode (paged, RoPE, fp8 K with a k_scale the
hook sees applied, CUDA-graph replay), the portable prefill (ragged and paged, RoPE, fp8 K), the Hopper prefill
(both, run by its K pre-pass, also under RoPE: ragged, TMA pages and gathered pages, head_dim 64 / 128 / 256,
explicit positions); fresh random inputs,
NaN-poisoned outputs, split requests. POS_GAIN reads the true positions: a gain per query position and per key
position, so a key transformed at a wrong position fails."""

from __future__ import annotations

import zlib

import pytest
import torch

import flashgen
from flashgen.spec import (ALiBi, AttentionSpec, Causal, Llama31Scaling, NoMask, Paged, Ragged, RoPE, Tensor, Variant,
                           YaRNScaling)
from flashgen.testing import request_kv, runtime_params
from flashgen.testing.check import nan_out
from flashgen.testing.layouts import random_batch
from flashgen.testing.reference import attend
from flashgen.testing.tolerance import assert_attention_close
from flashgen.testing.variants import qk_gain_ref
from flashgen.variants.examples import QK_GAIN, QK_GAIN_CUDA

pytestmark = pytest.mark.cuda

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
HEADS, GROUP, D = 2, 2, 128
MAX_KV = 2200
POS_GAIN = Variant(q_transform="return value * q_pos_gain[qo_idx];",
                   k_transform=lambda x, kv_idx, k_pos_gain: x * k_pos_gain[kv_idx],
                   tensors=[Tensor("q_pos_gain", "float32", 1), Tensor("k_pos_gain", "float32", 1)])
# a k_transform alone: on the Hopper prefill its pre-pass takes every run() argument (the kernel runs no hook)
K_GAIN = Variant(k_transform="return value * k_gain(kv_head, dim);", tensors=[Tensor("k_gain", "float32", 2)])
VARIANTS = {"qk_gain": QK_GAIN, "qk_gain_cuda": QK_GAIN_CUDA, "pos_gain": POS_GAIN, "k_gain": K_GAIN}


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _args(name: str, g: torch.Generator, d: int = D) -> dict:
    if name == "pos_gain":
        return {"q_pos_gain": torch.rand(MAX_KV, generator=g) + 0.5,
                "k_pos_gain": torch.rand(MAX_KV, generator=g) + 0.5}
    args = {"q_gain": torch.rand(HEADS * GROUP, d, generator=g) + 0.5,
            "k_gain": torch.rand(HEADS * GROUP, d, generator=g) + 0.5}
    return {"k_gain": args["k_gain"]} if name == "k_gain" else args


def _load(name: str, variant: Variant, args: dict, q, k, q_pos, k_pos):
    """q and k as the hooks leave them (fp64, or the inputs' dtype for a lower one), before RoPE."""
    if name == "pos_gain":
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        q = (q.to(work) * args["q_pos_gain"][q_pos.long()].to(work)[:, None, None]).to(q.dtype)
        if variant.k_transform is not None:
            k = (k.to(work) * args["k_pos_gain"][k_pos.long()].to(work)[:, None, None]).to(k.dtype)
        return q, k
    k_gain = args["k_gain"] if variant.k_transform is not None else torch.ones_like(args["k_gain"])
    return qk_gain_ref(q, k, args.get("q_gain", torch.ones_like(k_gain)), k_gain)


def _check(name, spec, args, q, kv, table, qo_lens, out, lse, k_scale: float = 1.0, positions=None):
    """``positions``: per request, its (query, key) true positions (the sm90 kernel's ``positions`` option)."""
    params = runtime_params(spec)
    refs = {False: ([], []), True: ([], [])}
    start = 0
    for b, (k, v) in enumerate(request_kv(spec, kv, **table)):
        nq, nk = qo_lens[b], k.shape[0]
        q_pos, k_pos = positions[b] if positions else (torch.arange(nk - nq, nk), torch.arange(nk))
        for low in (False, True):
            dtype = q.dtype if low else torch.float64
            kk = (k.double() * k_scale).to(dtype)  # fp8: what the cache means
            qq, kk = _load(name, spec.variant, args, q[start:start + nq].to(dtype), kk, q_pos, k_pos)
            o, s = attend(spec, params, qq, kk, v.to(dtype), q_pos, k_pos, low_precision=low)
            refs[low][0].append(o)
            refs[low][1].append(s)
        start += nq
    (ref, ref_lse), (low, low_lse) = [(torch.cat(o), torch.cat(s)) for o, s in (refs[False], refs[True])]
    assert_attention_close(out.cpu(), ref, low)
    assert_attention_close(lse.cpu(), ref_lse, low_lse, dtype=q.dtype, name="lse")


def _gpu(x):
    if isinstance(x, dict):
        return {k: _gpu(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(v.cuda() for v in x)
    return x.cuda() if isinstance(x, torch.Tensor) else x


def _fp8(kv, kv_dtype: str, k_scale: float):
    """The cache in fp8: K stored as K / k_scale (NaN spares stay NaN), V as it is."""
    fp8 = getattr(torch, kv_dtype)
    return ((kv[0].float() / k_scale).to(fp8), kv[1].to(fp8))


DECODE_CASES = [("qk_gain", {}, None), ("qk_gain_cuda", {"pos_encoding": RoPE()}, None),
                ("pos_gain", {"pos_encoding": RoPE(500000.0)}, None), ("qk_gain", {}, "float8_e4m3fn"),
                ("pos_gain", {"pos_encoding": RoPE()}, "float8_e5m2"), ("qk_gain", {"dtype": "float16"}, None)]


@pytest.mark.parametrize("name,extra,kv_dtype", DECODE_CASES)
def test_decode(name, extra, kv_dtype):
    spec = AttentionSpec(D, kv_layout=Paged(16), variant=VARIANTS[name], **extra)
    g = _generator("decode", name, repr(extra), kv_dtype)
    kv_lens = [700, 1, 2100]
    q, kv, table = random_batch(spec, [1] * 3, kv_lens, HEADS, GROUP, generator=g)
    args = _args(name, g)
    k_scale = 0.37 if kv_dtype else 1.0
    if kv_dtype:
        kv = _fp8(kv, kv_dtype, k_scale)
        spec = spec.replace(kv_dtype=kv_dtype)
    wrapper = flashgen.BatchDecodeWrapper(spec)
    wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, k_scale=k_scale,
                 **dict(table, kv_indices=table["kv_indices"].cuda()))
    out, lse = wrapper.run(q.cuda(), _gpu(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, [1] * 3, out, lse, k_scale)


def test_decode_cuda_graph_replays_new_gains():
    name = "qk_gain"
    spec = AttentionSpec(D, kv_layout=Paged(16), pos_encoding=RoPE(), variant=QK_GAIN)
    g = _generator("graph")
    kv_lens = [300, 17, 1200]
    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=3)
    q, kv, table = random_batch(spec, [1] * 3, kv_lens, HEADS, GROUP, generator=g)
    q_buf, kv_buf = q.cuda(), _gpu(kv)
    gains = _gpu(_args(name, g))
    wrapper.plan(num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS, **dict(table, kv_indices=table["kv_indices"].cuda()))
    wrapper.run(q_buf, kv_buf, **gains)  # warm-up: the kernel loads outside the capture
    out = torch.empty(3, HEADS * GROUP, D, dtype=q.dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, kv_buf, out=out, return_lse=False, **gains)
    for _ in range(2):
        args = _args(name, g)
        for key, value in args.items():
            gains[key].copy_(value)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        params = runtime_params(spec)
        for b, (k, v) in enumerate(request_kv(spec, kv, **table)):
            q_pos, k_pos = torch.tensor([k.shape[0] - 1]), torch.arange(k.shape[0])
            outs = []
            for dtype in (torch.float64, q.dtype):
                qq, kk = _load(name, spec.variant, args, q[b:b + 1].to(dtype), k.to(dtype), q_pos, k_pos)
                low = dtype != torch.float64
                outs.append(attend(spec, params, qq, kk, v.to(dtype), q_pos, k_pos, low_precision=low)[0])
            assert_attention_close(out[b:b + 1].cpu(), outs[0], outs[1])


PREFILL_CASES = [("ragged", "qk_gain", {}, None), ("paged", "qk_gain_cuda", {"pos_encoding": RoPE()}, None),
                 ("ragged", "pos_gain", {"pos_encoding": RoPE()}, None), ("paged", "pos_gain", {}, None),
                 ("ragged", "qk_gain", {}, "float8_e4m3fn"), ("paged", "pos_gain", {}, "float8_e5m2"),
                 ("sm90", "qk_gain", {}, None), ("sm90", "pos_gain", {"mask": NoMask()}, None),
                 ("sm90", "qk_gain_cuda", {"dtype": "float16"}, None),
                 # under RoPE the Hopper pre-pass runs both hooks, then rotates
                 ("sm90", "qk_gain_cuda", {"pos_encoding": RoPE()}, None), ("sm90", "pos_gain", {"pos_encoding": RoPE()}, None),
                 ("sm90", "k_gain", {}, None), ("sm90", "k_gain", {"pos_encoding": RoPE()}, None),
                 # fp8 K/V: the pre-pass dequantises, the hook sees k * k_scale, then RoPE
                 ("sm90", "qk_gain", {}, "float8_e4m3fn"), ("sm90", "pos_gain", {"pos_encoding": RoPE()}, "float8_e5m2"),
                 # ALiBi stays the kernel's (the pass rotates only RoPE)
                 ("sm90", "k_gain", {"pos_encoding": ALiBi()}, None),
                 # a cache of rotated K: q turns after its hook in the kernel (sm90: in shared memory, no pre-pass
                 # without a k_transform; with one the pass runs it and turns nothing); fp8 through load_q_fp8
                 ("sm90", "qk_gain_cuda", {"pos_encoding": RoPE(k_rotated=True)}, None),
                 ("sm90", "pos_gain", {"pos_encoding": RoPE(k_rotated=True, scaling=Llama31Scaling())}, None),
                 ("sm90", "qk_gain", {"pos_encoding": RoPE(k_rotated=True)}, "float8_e4m3fn"),
                 ("paged", "pos_gain", {"pos_encoding": RoPE(k_rotated=True)}, "float8_e4m3fn"),
                 ("ragged", "qk_gain", {"pos_encoding": RoPE(k_rotated=True, scaling=YaRNScaling())}, "float8_e5m2"),
                 ("paged", "qk_gain_cuda", {"pos_encoding": RoPE(scaling=Llama31Scaling())}, None)]


@pytest.mark.parametrize("family,name,extra,kv_dtype", PREFILL_CASES)
def test_prefill(family, name, extra, kv_dtype):
    if family == "sm90" and not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    variant = VARIANTS[name]
    layout = Paged(16) if family == "paged" else Ragged()
    spec = AttentionSpec(D, kv_layout=layout, mask=extra.pop("mask", Causal()), variant=variant, **extra)
    g = _generator("prefill", family, name, repr(extra), kv_dtype)
    qo_lens, kv_lens = [1, 130, 40], [5, 900, 40]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = _args(name, g)
    k_scale = 0.37 if kv_dtype else 1.0
    if kv_dtype:
        kv = _fp8(kv, kv_dtype, k_scale)
        spec = spec.replace(kv_dtype=kv_dtype)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90" if family == "sm90" else "portable")
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                 **({"k_scale": k_scale} if kv_dtype else {}),
                 **{k: v.cuda() if k == "kv_indices" else v for k, v in table.items()})
    out, lse = wrapper.run(q.cuda(), _gpu(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, qo_lens, out, lse, k_scale)


# the Hopper prefill's k_transform, run by its K pre-pass over each layout: ragged, TMA pages and gathered pages
# (Paged(5)), each head_dim; POS_GAIN fails a wrong kv_idx
SM90_CASES = [(layout, d, name) for d in (64, 128, 256) for layout in ("ragged", "paged16", "paged5")
              for name in ("qk_gain", "pos_gain")]
SM90_LAYOUTS = {"ragged": Ragged(), "paged16": Paged(16), "paged5": Paged(5)}


@pytest.mark.parametrize("layout,d,name", SM90_CASES)
def test_sm90_k_transform(layout, d, name):
    if not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    variant = VARIANTS[name]
    spec = AttentionSpec(d, kv_layout=SM90_LAYOUTS[layout], mask=Causal(), variant=variant)
    g = _generator("sm90_k", layout, d, name)
    qo_lens, kv_lens = [1, 200, 40, 77], [5, 1100, 40, 333]  # several KV tiles, partial last tiles and pages
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = _args(name, g, d)
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90")
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                 **{k: v.cuda() if k == "kv_indices" else v for k, v in table.items()})
    out, lse = wrapper.run(q.cuda(), _gpu(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check(name, spec, args, q, kv, table, qo_lens, out, lse)


@pytest.mark.parametrize("rope", [None, RoPE(k_rotated=True)], ids=["nopos", "krot"])
@pytest.mark.parametrize("layout", ["ragged", "paged16"])
def test_sm90_k_transform_at_explicit_positions(layout, rope):
    """kv_idx is the key's true position (kv_page_pos + its offset in the page; Ragged: one a key), q's its
    q_pos: shifted positions that a kernel reading places instead would get wrong (with a cache of rotated K, q
    turns in the kernel by its q_pos too)."""
    if not HOPPER:
        pytest.skip("the sm90 backend needs a compute-capability 9.0 GPU")
    spec = AttentionSpec(D, kv_layout=SM90_LAYOUTS[layout], mask=NoMask(), variant=POS_GAIN, pos_encoding=rope)
    g = _generator("sm90_k_pos", layout, repr(rope))
    qo_lens, kv_lens = [3, 150], [300, 700]
    q, kv, table = random_batch(spec, qo_lens, kv_lens, HEADS, GROUP, generator=g)
    args = _args("pos_gain", g)
    shift = [17, 400]
    positions = [(torch.arange(nk - nq, nk) + s, torch.arange(nk) + s) for nq, nk, s in zip(qo_lens, kv_lens, shift)]
    if layout == "ragged":
        kv_page_pos = torch.cat([k for _, k in positions])
    else:  # the first token's position of each page-table entry
        kv_page_pos = torch.cat([k[::16] for _, k in positions])
    q_pos = torch.cat([p for p, _ in positions])
    wrapper = flashgen.BatchPrefillWrapper(spec, backend="sm90", kernel_options={"positions": True})
    qo_indptr = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=HEADS * GROUP, num_kv_heads=HEADS,
                 kv_page_pos=kv_page_pos.int().numpy(), q_pos=q_pos.int().numpy(),
                 **{k: v.cuda() if k == "kv_indices" else v for k, v in table.items()})
    out, lse = wrapper.run(q.cuda(), _gpu(kv), out=nan_out(spec, q), return_lse=True, **_gpu(args))
    _check("pos_gain", spec, args, q, kv, table, qo_lens, out, lse, positions=positions)
