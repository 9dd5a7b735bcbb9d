"""fp8 K/V (e4m3, e5m2) in the portable prefill. CPU: which specs the family takes and refuses, the tiles and
shared memory it plans, what plan() packs (k_scale folded into sm_scale, v_scale), the bad-scale errors. nvcc:
the kernels compile for sm_90a without spills over e4m3/e5m2 x bf16/fp16 q x paged 16/ragged x causal/none x
head_dim 128/256. GPU: against the fp64 reference of the dequantised cache (fresh random inputs, NaN-poisoned
outputs, NaN in the cache slots no request owns): layouts, masks, split plans, every finite code."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import (ALiBi, AttentionSpec, Causal, CustomMask, Llama31Scaling, NoMask, Paged, Ragged, RoPE, SlidingWindow,
                      SpecError)
from flashgen.kernels import family
from flashgen.kernels.prefill import prefill_smem_bytes, prefill_stages
from flashgen.plan import PlanError
from flashgen.testing.check import check_attention
from flashgen.testing.layouts import fp8_codes, random_batch
from flashgen.testing.reference import pack_custom_mask
from stub_cuda import on_device, stubbed_cuda

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"

# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("spec", [
    AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()),
    AttentionSpec(256, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged()),
    AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(1, "HND"), mask=SlidingWindow(64), pos_encoding=ALiBi(),
                  soft_cap=30.0),
    AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(64), mask=CustomMask()),
    AttentionSpec(256, head_dim_vo=128, kv_dtype=E4M3, kv_layout=Ragged()),
])
def test_fp8_specs_are_taken(spec):
    fam = family("prefill")
    fam.check(spec)
    source = flashgen.render(spec, "prefill")
    assert "using DTypeMMA = __half;" in source and "float v_scale;" in source
    assert ("__nv_fp8_e4m3" if spec.kv_dtype == E4M3 else "__nv_fp8_e5m2") in source


@pytest.mark.parametrize("spec,tiles,message", [
    (AttentionSpec(64, kv_dtype=E4M3, kv_layout=Paged(16)), None, r"^kv_dtype: fp8 K/V need head dims in \(128, 256\)"),
    (AttentionSpec(192, head_dim_vo=128, kv_dtype=E4M3, kv_layout=Ragged()), None, r"^kv_dtype: fp8 K/V need head dims"),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), pos_encoding=RoPE()), None,
     r"^pos_encoding: RoPE over unrotated fp8 K"),
    (AttentionSpec(128, kv_dtype="float16", kv_layout=Paged(16)), None, r"^kv_dtype: got float16, prefill takes"),
    (AttentionSpec(128, kv_dtype=E5M2, kv_layout=Ragged()), "warps=4,rows=32,kv=48",
     r"^kernel_options\['tiles'\]: fp8 K/V need KV tiles of 32 or 64"),
])
def test_fp8_specs_refused_with_the_field_named(spec, tiles, message):
    with pytest.raises(SpecError, match=message):
        family("prefill", {"tiles": tiles} if tiles else None).check(spec)


def test_auto_picks_sm90_for_fp8_where_it_runs():
    """fp8 K/V run on the Hopper backend (tests/sm90/test_prefill_sm90_fp8.py): outside CUDA graphs through its
    pre-pass, any page size; in a graph the kernel converts them where TMA loads them, and gathered page sizes
    stay on the portable kernel."""
    from flashgen.api.backends import select
    assert select(AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()), "auto", (9, 0)) == "sm90"
    spec = AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(5), mask=Causal())
    assert select(spec, "auto", (9, 0)) == "sm90"
    assert select(spec, "auto", (9, 0), graph=True) == "portable"
    with pytest.raises(SpecError, match="^backend: 'sm90' cannot run this spec \\(kv_dtype: float8_e4m3fn K/V"):
        select(spec, "sm90", (9, 0), graph=True)


def test_fp8_stages_and_shared_memory():
    # fp8 halves a stage: kv64 at d=128 fits a third stage under two CTAs an SM (bf16: two); d=256 too
    assert prefill_stages(128, 128) == 2 and prefill_stages(128, 128, kv_bytes=1) == 3
    assert prefill_stages(256, 256) == 2 and prefill_stages(256, 256, kv_bytes=1) == 3
    assert prefill_smem_bytes(128, 128, 3, 1) == 32 * 1024 + 3 * 16 * 1024 + 1024
    launch = family("prefill").launch(AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16)))
    assert (launch.stages, launch.ctas_per_sm, launch.smem_bytes) == (3, 2, 32 * 1024 + 3 * 16 * 1024 + 1024)
    assert family("prefill").uri(AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged())).endswith("_w4r32kv64s3c2")
    assert family("prefill").uri(AttentionSpec(128, kv_layout=Ragged())).endswith("_w4r32kv64s2c2")  # unchanged


HEADS = dict(num_qo_heads=8, num_kv_heads=2)
CSR = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[5, 16])


@pytest.fixture
def stubbed(monkeypatch):
    with stubbed_cuda():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        yield


def _prefill(spec, backend="portable", **plan):
    w = flashgen.BatchPrefillWrapper(spec, num_sms=132, backend=backend)
    w.plan(qo_indptr=[0, 3, 5], **HEADS, **CSR, **plan)
    return w


@pytest.mark.parametrize("backend", ["portable", "sm90"])
def test_plan_folds_k_scale_and_packs_v_scale(stubbed, backend, monkeypatch):
    """k_scale in sm_scale; v_scale in the kernel's params, or on the sm90 backend (outside graphs) in its
    pre-pass's, which dequantises V into the scratch the 16-bit kernel reads."""
    monkeypatch.setattr("flashgen.api.sm90.kv_tensor_map", lambda *args: bytes(128))  # scratch maps: the driver's
    spec = AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal())
    w = _prefill(spec, backend, k_scale=0.5, v_scale=2.0, sm_scale=0.1)
    assert w.backend == backend
    v_params = w._impl._rope_params if backend == "sm90" else w._impl._params
    fields = w._impl._params.values()
    assert fields["sm_scale"] == pytest.approx(0.05) and v_params.values()["v_scale"] == 2.0
    w.plan(qo_indptr=[0, 3, 5], **HEADS, **CSR)  # scales default to 1
    fields = w._impl._params.values()
    assert fields["sm_scale"] == pytest.approx(128 ** -0.5) and v_params.values()["v_scale"] == 1.0
    if backend == "sm90":  # the kernel reads 16-bit scratch: no v_scale of its own
        assert "v_scale" not in fields and w._impl.kernel_spec.kv_dtype == "bfloat16"
        return
    cache = tuple(on_device(torch.zeros(5, 16, 2, 128, dtype=torch.float8_e4m3fn)) for _ in range(2))
    w.run(on_device(torch.zeros(5, 8, 128, dtype=torch.bfloat16)), cache)
    with pytest.raises(TypeError, match=r"^kv_cache \(k\): expected dtype torch.float8_e4m3fn"):
        w.run(on_device(torch.zeros(5, 8, 128, dtype=torch.bfloat16)),
              tuple(on_device(torch.zeros(5, 16, 2, 128, dtype=torch.bfloat16)) for _ in range(2)))


@pytest.mark.parametrize("spec,plan,message", [
    (AttentionSpec(128, kv_layout=Paged(16)), {"k_scale": 2.0}, r"^k_scale: got 2.0; per-tensor scales apply to fp8"),
    (AttentionSpec(128, kv_layout=Paged(16)), {"v_scale": 0.5}, r"^v_scale: got 0.5; per-tensor scales apply to fp8"),
    (AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(16)), {"k_scale": float("nan")}, r"^k_scale: got nan"),
    (AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(16)), {"v_scale": 0.0}, r"^v_scale: got 0.0"),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16)), {"k_scale": 1e38, "sm_scale": 100.0},
     r"^k_scale: .*sm_scale \* k_scale must be a finite fp32"),
])
def test_bad_scales_are_named(stubbed, spec, plan, message):
    with pytest.raises(PlanError, match=message):
        _prefill(spec, **plan)


def test_bench_kv_dtypes_option(monkeypatch):
    """``--kv-dtypes``: fp8 rows of the portable kernel beside the bf16 ones; the ratios to peers are bf16's."""
    import argparse

    from flashgen.bench import prefill as bench

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.config(parser.parse_args([])).kv_dtypes == ["bf16"]
    assert bench.config(parser.parse_args(["--kv-dtypes", "bf16,e4m3,e5m2"])).kv_dtypes == ["bf16", "e4m3", "e5m2"]
    with pytest.raises(ValueError, match=r"^--kv-dtypes: unknown \['fp8'\]"):
        bench.config(parser.parse_args(["--kv-dtypes", "fp8"]))
    fp8 = bench.spec_for(128, "paged16", "causal", "e4m3")
    assert fp8.kv_dtype == E4M3 and bench.runs(fp8, "portable") and bench.runs(fp8, "sm90")
    # gathered pages too: the sm90 backend dequantises fp8 in its pre-pass, any page size
    assert bench.runs(bench.spec_for(128, "paged1", "causal", "e5m2"), "sm90")
    assert not bench.runs(bench.spec_for(128, "paged1", "causal", "e5m2").replace(head_dim=192), "sm90")
    shape = {"head_dim": 128, "batch": 4, "seqlen": 4096, "mask": "causal", "layout": "ragged"}
    rows = [{"peer": "flashgen-portable", "us": 1000.0, "kv_dtype": "bf16", **shape},
            {"peer": "flashgen-portable-e4m3", "us": 500.0, "kv_dtype": "e4m3", **shape},
            {"peer": "flashinfer", "us": 1200.0, **shape}]
    assert bench.ratios({"rows": rows}) == [("d128 4x4k causal ragged", "flashinfer", 1.2)]


# ------------------------------------------------------------------------------------------------ nvcc

COMPILE = [AttentionSpec(d, dtype=dtype, kv_dtype=kv, kv_layout=layout, mask=mask)
           for kv, dtype, layout, mask, d in itertools.product((E4M3, E5M2), ("bfloat16", "float16"),
                                                                (Paged(16), Ragged()), (Causal(), NoMask()), (128, 256))]
COMPILE_EXTRA = [  # the other tile preset, a custom mask, ALiBi + soft-cap, a window, explicit positions
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()), {"tiles": "kv32"}),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=CustomMask(), pos_encoding=ALiBi()), None),
    (AttentionSpec(128, dtype="float16", kv_dtype=E5M2, kv_layout=Paged(5, "HND"), mask=SlidingWindow(64),
                   soft_cap=30.0), None),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()), {"positions": True}),
]
prefetch(__name__, [("prefill", spec, "sm_90a") for spec in COMPILE])


@pytest.mark.nvcc
def test_fp8_matrix_compiles_for_sm90a_without_spills(shared_cache):
    results = build_all([("prefill", spec, "sm_90a") for spec in COMPILE], workers=2)
    for spec, (entry, report) in zip(COMPILE, results):
        assert_sound_cubin(entry, report, ["prefill"], f"sm_90a {spec.uri}")


@pytest.mark.nvcc
@pytest.mark.parametrize("spec,options", COMPILE_EXTRA)
def test_fp8_variants_compile_without_spills(shared_cache, spec, options):
    (entry, report), = build_all([("prefill", spec, "sm_90a")], workers=1, options=options)
    assert_sound_cubin(entry, report, ["prefill"], f"sm_90a {spec.uri} {options}")


# ------------------------------------------------------------------------------------------------ GPU

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5]
KV = [5, 1, 17, 300, 64, 0, 130, 0]


def fp8_batch(spec, qo_lens, kv_lens, scales=(0.37, 1.9), codes=None, seed=None):
    """A random batch whose cache is fp8 (the 16-bit draw divided by the scales, or ``codes``: every finite code,
    ``fp8_codes``); returns q, the fp8 kv, the reference kv (the dequantised cache in fp64), table, qo_indptr,
    custom mask (CustomMask specs), k_scale, v_scale."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(np.random.randint(1 << 30)))
    q, kv16, table = random_batch(spec.replace(kv_dtype=spec.dtype), qo_lens, kv_lens, 2, 4, generator=gen)
    fp8 = getattr(torch, spec.kv_dtype)
    if codes is None:
        k_scale, v_scale = scales
        kv8 = tuple((x.float() / s).to(fp8) for x, s in zip(kv16, scales))  # NaN spares stay NaN
    else:
        kv8 = tuple(fp8_codes(x, fp8, codes == "subnormal", gen) for x in kv16)
        top_k, top_v = (x.float().nan_to_num().abs().max().item() for x in kv8)
        k_scale, v_scale = 4.0 / top_k, 10.0 / top_v  # keys up to 4 (logits of order one), values up to 10
    kv_ref = (kv8[0].double() * k_scale, kv8[1].double() * v_scale)  # what the fp8 cache means
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    mask = None
    if isinstance(spec.mask, CustomMask):
        mask = [torch.rand(a, b, generator=gen) < 0.7 for a, b in zip(qo_lens, kv_lens)]
    return q, kv8, kv_ref, table, qo_indptr, mask, k_scale, v_scale


def run_fp8(spec, qo_lens, kv_lens, *, codes=None, plan_kwargs=None, kernel_options=None, backend="portable",
            scales=(0.37, 1.9), graph=False, **runtime):
    """Plan with the scales, run into NaN-poisoned out / lse, check against the fp64 reference of the dequantised
    cache; returns the wrapper. ``graph``: a CUDA-graph wrapper sized to the batch, run eagerly (on the sm90
    backend the kernel then converts fp8 itself, where outside graphs its pre-pass dequantises)."""
    q, kv8, kv_ref, table, qo_indptr, mask, k_scale, v_scale = fp8_batch(spec, qo_lens, kv_lens, scales, codes=codes)
    capacity = {}
    if graph:
        capacity = dict(use_cuda_graph=True, max_batch_size=len(qo_lens), max_total_q=max(1, sum(qo_lens)))
        if "kv_indices" in table:
            capacity["max_num_pages"] = max(1, len(table["kv_indices"]))
    wrapper = flashgen.BatchPrefillWrapper(spec, kernel_options=kernel_options, backend=backend, **capacity)
    assert wrapper.backend == backend
    tab = dict(table)
    if "kv_indices" in tab:
        tab["kv_indices"] = tab["kv_indices"].cuda()
    wrapper.plan(qo_indptr=qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=2, k_scale=k_scale, v_scale=v_scale,
                 custom_mask=pack_custom_mask(mask) if mask is not None else None, **tab, **runtime,
                 **(plan_kwargs or {}))
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv8)
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv_ref,
                    kv_dtype=getattr(torch, spec.kv_dtype), qo_indptr=qo_indptr, custom_mask=mask, **table, **runtime)
    return wrapper


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout,mask", [
    (Ragged(), NoMask()), (Ragged(), Causal()), (Paged(16), Causal()), (Paged(16), NoMask()),
    (Paged(1, "HND"), SlidingWindow(20)), (Paged(5), CustomMask()),
])
def test_fp8_layouts_and_masks(kv_dtype, dtype, layout, mask):
    run_fp8(AttentionSpec(128, dtype=dtype, kv_dtype=kv_dtype, kv_layout=layout, mask=mask), QO, KV)


@pytest.mark.cuda
@pytest.mark.parametrize("spec,runtime,options", [
    (AttentionSpec(256, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()), {}, None),
    (AttentionSpec(256, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged()), {}, None),
    (AttentionSpec(256, head_dim_vo=128, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()), {}, None),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi(), soft_cap=30.0),
     {"soft_cap": 5.0}, None),
    (AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(16), mask=Causal()), {"sm_scale": 0.3}, None),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()), {}, {"tiles": "kv32"}),
    # a cache of rotated fp8 K (q alone turns, in load_q_fp8), plain and Llama-3.1-scaled
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(k_rotated=True)), {},
     None),
    (AttentionSpec(256, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged(), mask=Causal(),
                   pos_encoding=RoPE(k_rotated=True, scaling=Llama31Scaling())), {"rope_theta": 500000.0}, None),
])
def test_fp8_head_dims_and_options(spec, runtime, options):
    run_fp8(spec, QO, KV, kernel_options=options, **runtime)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", [
    AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()),
    AttentionSpec(128, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged()),
    AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=CustomMask()),
])
def test_fp8_split_plans(spec):
    """Few short-q requests over long KV: the plan splits the KV, partials (v_scale applied) merge in-kernel."""
    wrapper = run_fp8(spec, [3, 40, 1], [9000, 5000, 3000])
    plan = wrapper._impl.last_plan
    assert (plan.numpy("chunk_idx")[:plan.info.num_items] >= 0).any(), "expected a split plan"


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("codes", ["all", "subnormal"])
def test_fp8_every_code(kv_dtype, dtype, codes):
    """Every finite fp8 code converts exactly, subnormals included: K and V drawn from all finite codes (or only
    the subnormals, scaled up to order ten, so that a flushed subnormal fails loudly), paged and ragged."""
    for layout in (Paged(16), Ragged()):
        run_fp8(AttentionSpec(128, dtype=dtype, kv_dtype=kv_dtype, kv_layout=layout, mask=Causal()), [130, 17, 1],
                [300, 17, 64], codes=codes)
