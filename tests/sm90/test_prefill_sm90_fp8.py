"""fp8 K/V (e4m3, e5m2) on the Hopper prefill: TMA staging converted to fp16 tiles by the K and V producer warps
(templates/include/flashgen/sm90/fp8.cuh). CPU: which specs the family takes and refuses, its shared memory and
staging stages, the rendered config. nvcc: the matrix compiles for sm_90a without spills. GPU (H200): against
the fp64 reference of the dequantised cache (tests/prefill/test_prefill_fp8.py's fixtures: fresh random inputs,
NaN-poisoned outputs, per-tensor scales), ragged and TMA-loaded pages, masks, uneven lengths, every fp8 code."""

from __future__ import annotations

import itertools

import pytest

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import (ALiBi, AttentionSpec, Causal, CustomMask, Llama31Scaling, NoMask, Paged, Ragged, RoPE, SlidingWindow,
                      SpecError)
from flashgen.kernels import family
from flashgen.kernels.prefill_sm90 import (SMEM_LIMIT, THREADS, sm90_kv8_ahead, sm90_kv8_stages, sm90_o_staged,
                                           sm90_registers, sm90_smem_bytes)

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"

# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("spec", [
    AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()),
    AttentionSpec(64, dtype="float16", kv_dtype=E5M2, kv_layout=Paged(16)),
    AttentionSpec(256, kv_dtype=E4M3, kv_layout=Paged(64, "HND"), mask=SlidingWindow(64), pos_encoding=ALiBi(),
                  soft_cap=30.0),
    AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(256), mask=CustomMask()),
])
def test_fp8_specs_are_taken(spec):
    family("prefill_sm90").check(spec)
    source = flashgen.render(spec, "prefill_sm90")
    assert "using DTypeMMA = __half;" in source and "float v_scale;" in source
    assert f"static constexpr int KV8_STAGES = {sm90_kv8_stages(spec.head_dim)};" in source
    assert ("__nv_fp8_e4m3" if spec.kv_dtype == E4M3 else "__nv_fp8_e5m2") in source


def test_16bit_specs_render_as_before():
    source = flashgen.render(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), "prefill_sm90")
    assert "using DTypeMMA = __nv_bfloat16;" in source and "KV8_STAGES = 0;" in source
    assert "KV8_AHEAD = 0;" in source and "PRODUCER_REGS = 40;" in source and "CONSUMER_REGS = 232;" in source
    assert "v_scale" not in source


def test_fp8_conversion_pipeline_and_register_split():
    """Up to head_dim 128 the converting K/V warps take 56 registers (the consumers 224, as a gathered cache's)
    and keep 3 chunk loads in flight; at 256 the consumers keep 232 and the producer converts a chunk at a time.
    Every split fits the registers the 384 threads launch with (168 each)."""
    assert [sm90_kv8_ahead(d) for d in (64, 128, 256)] == [3, 3, 0]
    assert [sm90_registers(d, False, fp8=True) for d in (64, 128, 256)] == [(56, 224, 4), (56, 224, 4), (40, 232, 4)]
    assert [sm90_registers(d, False) for d in (64, 128, 256)] == [(40, 232, 4)] * 3  # 16-bit K/V as before
    for d in (64, 128, 256):
        producer, consumer, _ = sm90_registers(d, False, fp8=True)
        assert producer % 8 == 0 and consumer % 8 == 0 and producer * 128 + consumer * 256 <= 168 * THREADS
        source = flashgen.render(AttentionSpec(d, kv_dtype=E4M3, kv_layout=Ragged()), "prefill_sm90")
        assert f"KV8_AHEAD = {sm90_kv8_ahead(d)};" in source and f"PRODUCER_REGS = {producer};" in source
        assert f"CONSUMER_REGS = {consumer};" in source


@pytest.mark.parametrize("spec,message", [
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(5)), r"^kv_dtype: float8_e4m3fn K/V on prefill_sm90 need "
     r"TMA-loaded pages \(a multiple of 8 that divides the KV tile of 128 tokens"),
    (AttentionSpec(256, kv_dtype=E5M2, kv_layout=Paged(24), mask=Causal()), r"^kv_dtype: float8_e5m2 K/V on "
     r"prefill_sm90 need TMA-loaded pages .* of 64 tokens"),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged(), pos_encoding=RoPE()), r"^kv_dtype: .* take no RoPE"),
    (AttentionSpec(128, dtype="float16", kv_dtype="bfloat16", kv_layout=Ragged()),
     r"^kv_dtype: got dtype float16 / kv_dtype bfloat16, prefill_sm90 supports .*float8_e4m3fn or float8_e5m2"),
])
def test_fp8_specs_refused_with_kv_dtype_named(spec, message):
    with pytest.raises(SpecError, match=message):
        family("prefill_sm90").check(spec)


def test_fp8_runs_through_the_pre_pass_outside_graphs():
    """Outside CUDA-graph mode the sm90 backend dequantises fp8 K/V in its rope_gather pre-pass into 16-bit ragged
    scratch and runs the 16-bit kernel (so RoPE and variants run over fp8 too); in graph mode the kernel converts
    them itself (sm90/fp8.cuh), which takes no RoPE and no variant."""
    from flashgen.api.backends import check_sm90, kernels_for
    from flashgen.variants.examples import DOCUMENT

    for extra in ({}, {"pos_encoding": RoPE()}, {"variant": DOCUMENT}, {"pos_encoding": ALiBi(), "soft_cap": 30.0}):
        spec = AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal(), **extra)
        check_sm90(spec)
        (pre_op, pre), (op, kernel) = kernels_for(spec, "sm90")
        assert (pre_op, op) == ("rope_gather", "prefill_sm90")
        assert pre.kv_dtype == E4M3 and kernel.kv_dtype == "bfloat16" and kernel.kv_layout == Ragged()
        assert kernel.variant == spec.variant and kernel.soft_cap == spec.soft_cap
        # RoPE is the pass's; ALiBi (a bias by position) the kernel's
        assert kernel.pos_encoding == (None if isinstance(spec.pos_encoding, RoPE) else spec.pos_encoding)
        assert "__nv_fp8_e4m3" in family("rope_gather").render(pre)
    plain = AttentionSpec(128, kv_dtype=E5M2, kv_layout=Paged(16), mask=Causal())
    assert kernels_for(plain, "sm90", graph=True) == (("prefill_sm90", plain),)
    check_sm90(plain, graph=True)
    with pytest.raises(SpecError, match=r"^pos_encoding: RoPE over unrotated K on the sm90 backend turns K in a "
                       "pre-pass that is not CUDA-graph safe"):
        check_sm90(plain.replace(pos_encoding=RoPE()), graph=True)
    # a cache of rotated fp8 K: the pass dequantises, the twin's kernel turns q; in a graph fp8 conversion in the
    # kernel takes no RoPE (auto picks the portable prefill)
    rotated = plain.replace(pos_encoding=RoPE(k_rotated=True))
    (_, pre), (_, kernel) = kernels_for(rotated, "sm90")
    assert family("rope_gather").project(pre).pos_encoding is None and kernel.pos_encoding == rotated.pos_encoding
    with pytest.raises(SpecError, match=r"^kv_dtype: float8_e5m2 K/V on prefill_sm90 take no RoPE"):
        check_sm90(rotated, graph=True)
    with pytest.raises(SpecError, match=r"^kv_dtype: float8_e5m2 K/V on prefill_sm90 take no variant hooks"):
        check_sm90(plain.replace(variant=DOCUMENT), graph=True)


def test_fp8_staging_fits_shared_memory():
    """Two staging stages at head_dim 64 (the O staging kept), one at 128 (two Q buffers kept, O from registers)
    and 256; every layout within 227 KB."""
    assert [sm90_kv8_stages(d) for d in (64, 128, 256)] == [2, 1, 1]
    assert [sm90_o_staged(d, False, kv8=sm90_kv8_stages(d)) for d in (64, 128, 256)] == [True, False, False]
    assert sm90_smem_bytes(128, kv8=1) == 192 * 1024 + 2 * 128 * 128 + 1792 <= SMEM_LIMIT
    assert sm90_smem_bytes(64, kv8=2) == 96 * 1024 + 4 * 128 * 64 + 1792 + 8 * 16 * 128
    assert sm90_smem_bytes(256, kv8=1) == 192 * 1024 + 2 * 64 * 256 + 1792 <= SMEM_LIMIT
    launch = family("prefill_sm90").launch(AttentionSpec(128, kv_dtype=E4M3, kv_layout=Ragged()))
    assert (launch.smem_bytes, launch.o_staged, launch.gather) == (sm90_smem_bytes(128, kv8=1), False, False)


# ------------------------------------------------------------------------------------------------ nvcc

COMPILE = [AttentionSpec(d, dtype=dtype, kv_dtype=kv, kv_layout=Ragged() if causal else Paged(16),
                         mask=Causal() if causal else NoMask())
           for kv, dtype, d, causal in itertools.product((E4M3, E5M2), ("bfloat16", "float16"), (64, 128, 256),
                                                         (True, False))]
COMPILE_EXTRA = [  # HND pages, a page larger than the tile, a custom mask, ALiBi + soft-cap + window, positions
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(8, "HND"), mask=Causal()), None),
    (AttentionSpec(256, kv_dtype=E5M2, kv_layout=Paged(128), mask=Causal()), None),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=CustomMask(), pos_encoding=ALiBi()), None),
    (AttentionSpec(128, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged(), mask=SlidingWindow(64),
                   pos_encoding=ALiBi(), soft_cap=30.0), None),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()), {"positions": True}),
]
prefetch(__name__, [("prefill_sm90", spec, "sm_90a") for spec in COMPILE])


@pytest.mark.nvcc
def test_fp8_matrix_compiles_for_sm90a_without_spills(shared_cache):
    results = build_all([("prefill_sm90", spec, "sm_90a") for spec in COMPILE], workers=2)
    for spec, (entry, report) in zip(COMPILE, results):
        assert_sound_cubin(entry, report, ["prefill_sm90"], f"sm_90a {spec.uri}")


@pytest.mark.nvcc
@pytest.mark.parametrize("spec,options", COMPILE_EXTRA, ids=lambda x: getattr(x, "uri", str(x)))
def test_fp8_variants_compile_without_spills(shared_cache, spec, options):
    (entry, report), = build_all([("prefill_sm90", spec, "sm_90a")], workers=1, options=options)
    assert_sound_cubin(entry, report, ["prefill_sm90"], f"sm_90a {spec.uri} {options}")


# ------------------------------------------------------------------------------------------------ GPU

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1, a long one
QO = [0, 1, 17, 65, 64, 3, 130, 5, 300]
KV = [5, 1, 17, 300, 64, 0, 130, 0, 1000]


def run_sm90_fp8(spec, qo_lens=QO, kv_lens=KV, **kwargs):
    """tests/prefill/test_prefill_fp8.py's run_fp8 (the fp8 batch, the dequantised reference, the check) on sm90."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "prefill" / "test_prefill_fp8.py"
    module = importlib.util.spec_from_file_location("prefill_fp8_checks", path)
    checks = importlib.util.module_from_spec(module)
    module.loader.exec_module(checks)
    return checks.run_fp8(spec, qo_lens, kv_lens, backend="sm90", **kwargs)


# graph: the kernel's own conversion (sm90/fp8.cuh, CUDA-graph mode), else the pre-pass's (rope_gather)
@pytest.mark.cuda
@pytest.mark.hopper
@pytest.mark.parametrize("graph", [False, True], ids=["prepass", "inkernel"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout,mask", [
    (Ragged(), NoMask()), (Ragged(), Causal()), (Paged(16), Causal()), (Paged(16), NoMask()),
    (Paged(8, "HND"), SlidingWindow(20)), (Paged(256), Causal()), (Paged(16), CustomMask()),
])
def test_sm90_fp8_layouts_and_masks(kv_dtype, dtype, layout, mask, graph):
    run_sm90_fp8(AttentionSpec(128, dtype=dtype, kv_dtype=kv_dtype, kv_layout=layout, mask=mask), graph=graph)


@pytest.mark.cuda
@pytest.mark.hopper
@pytest.mark.parametrize("spec,runtime", [
    (AttentionSpec(64, kv_dtype=E4M3, kv_layout=Ragged(), mask=Causal()), {}),
    (AttentionSpec(64, dtype="float16", kv_dtype=E5M2, kv_layout=Paged(32, "HND")), {}),
    (AttentionSpec(256, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()), {}),
    (AttentionSpec(256, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged()), {}),
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi(), soft_cap=30.0),
     {"soft_cap": 5.0}),
    (AttentionSpec(128, kv_dtype=E5M2, kv_layout=Ragged(), mask=Causal()), {"sm_scale": 0.3}),
    # a cache of rotated fp8 K: the pre-pass dequantises, the kernel of the ragged twin turns q
    (AttentionSpec(128, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(k_rotated=True)), {}),
    (AttentionSpec(128, dtype="float16", kv_dtype=E5M2, kv_layout=Ragged(), mask=Causal(),
                   pos_encoding=RoPE(k_rotated=True, scaling=Llama31Scaling())), {"rope_theta": 500000.0}),
])
def test_sm90_fp8_head_dims_and_logits(spec, runtime):
    run_sm90_fp8(spec, **runtime)


@pytest.mark.cuda
@pytest.mark.hopper
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 40.0), (3.0, 0.125)])
def test_sm90_fp8_per_tensor_scales(scales):
    """k_scale folded into sm_scale (the fp16 Q holds q * sm_scale), v_scale applied to the output (in the kernel)
    or to V (the pre-pass)."""
    for dtype in ("bfloat16", "float16"):
        for graph in (False, True):
            run_sm90_fp8(AttentionSpec(128, dtype=dtype, kv_dtype=E4M3, kv_layout=Paged(16), mask=Causal()),
                         scales=scales, graph=graph)


@pytest.mark.cuda
@pytest.mark.hopper
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("codes", ["all", "subnormal"])
def test_sm90_fp8_every_code(kv_dtype, codes):
    """Every finite fp8 code converts exactly in the producer's staging conversion and in the pre-pass,
    subnormals included."""
    for dtype, layout in (("bfloat16", Paged(16)), ("float16", Ragged())):
        for graph in (False, True):
            run_sm90_fp8(AttentionSpec(128, dtype=dtype, kv_dtype=kv_dtype, kv_layout=layout, mask=Causal()),
                         [130, 17, 1], [300, 17, 64], codes=codes, graph=graph)


@pytest.mark.cuda
@pytest.mark.hopper
def test_sm90_fp8_many_items_cross_the_staging_ring():
    """More tiles than stages on every CTA and items of one or many tiles back to back: the conversion lags the
    loads across items (KV8_STAGES 2 at head_dim 64)."""
    lens = [1, 129, 4000, 7, 2048, 255, 1, 900]
    for d in (64, 128):
        run_sm90_fp8(AttentionSpec(d, kv_dtype=E5M2, kv_layout=Paged(64), mask=Causal()), lens, [x + 37 for x in lens],
                     graph=True)
