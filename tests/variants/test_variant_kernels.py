"""Variants inside the kernels, on the CPU: every shipped example compiles for sm_90a in every family within a
stated spill bound, the kernel key follows the hook text (not its spelling, never a scalar), run() checks the
variant's arguments by name and packs them where the kernel reads them, and the GPU tests' reference agrees
with the traced hooks evaluated on their own."""

from __future__ import annotations

import re
import struct
from unittest import mock

import pytest
import torch

import flashgen
from compile_checks import build_all, prefetch
from flashgen import jit
from flashgen.kernels import family
from flashgen.api.backends import kernels_for, select
from flashgen.api.wrapper import fp8_scaled, runtime_values
from flashgen.kernels import include_dir
from flashgen.kernels.prefill_sm90 import SMEM_LIMIT, sm90_o_stage_bytes, sm90_tile_kv
from flashgen.spec import AttentionSpec, Causal, NoMask, Paged, Ragged, RoPE, SpecError, Variant
from flashgen.testing import variants as ref
from flashgen.testing.variants import evaluate, example_args, example_attention, tile_class
from flashgen.variants.examples import EXAMPLES
from stub_cuda import fake_build, on_device, stubbed_cuda

VARIANTS = [(name, i, v) for name, pair in EXAMPLES.items() for i, v in enumerate(pair) if v is not None]
# (op, layout) of every family that runs variants
FAMILIES = [("decode", Paged(16)), ("prefill", Ragged()), ("prefill", Paged(16)), ("prefill_sm90", Ragged())]
# ptxas spill bytes (stores, loads) a variant may add: decode and the Hopper prefill none; the portable prefill's
# scores tile already sits at 255 registers (d=128, 64-key tiles), where per-pair table reads cost a few (T5's
# bucket, a log a pair, the most: 44 / 40 bytes, measured 2026-12-02)
SPILL_BOUND = {"decode": 0, "prefill": 64, "prefill_sm90": 0, "rope_gather": 0}


def _spec(variant, op, layout):
    mask = NoMask() if op == "decode" else Causal()
    return AttentionSpec(128, kv_layout=layout, mask=mask, variant=variant)


def _kernels(op, spec):
    """The (op, spec) kernels behind ``op``: the Hopper backend's a k_transform runs in (its pre-pass, the kernel
    of the ragged twin), else ``op`` itself."""
    return kernels_for(spec, "sm90") if op == "prefill_sm90" else ((op, spec),)


COMPILE = [job + ("sm_90a",) for _, _, v in VARIANTS for op, layout in FAMILIES for job in _kernels(op, _spec(v, op, layout))]
# the q half of the load transforms on the Hopper prefill, paged and ragged
Q_GAIN = Variant(q_transform=EXAMPLES["qk_gain"][1].q_transform, tensors=EXAMPLES["qk_gain"][1].tensors)
COMPILE += [("prefill_sm90", _spec(Q_GAIN, "prefill_sm90", layout), "sm_90a") for layout in (Ragged(), Paged(16))]
# both halves on the Hopper backend (the k_transform in the pre-pass): TMA and gathered pages, each head_dim
COMPILE += [job + ("sm_90a",) for d in (64, 128, 256) for layout in (Paged(16), Paged(5))
            for job in kernels_for(AttentionSpec(d, kv_layout=layout, mask=Causal(), variant=EXAMPLES["qk_gain"][1]),
                                   "sm90")]
# the load transforms under RoPE, fp8 K and explicit positions (options: each job's own)
QK = EXAMPLES["qk_gain"][0]
LOADS = [("decode", AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(), variant=QK), None),
         ("decode", AttentionSpec(128, kv_layout=Paged(16), kv_dtype="float8_e4m3fn", variant=QK), None),
         ("decode", AttentionSpec(128, kv_layout=Paged(16), kv_dtype="float8_e5m2", pos_encoding=RoPE(), variant=QK),
          {"positions": True}),
         ("prefill", AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(), variant=QK), None),
         ("prefill", AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), kv_dtype="float8_e4m3fn", variant=QK), None),
         ("prefill", AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(), variant=QK),
          {"positions": True}),
         ("prefill_sm90", AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=Q_GAIN), {"positions": True}),
         ("prefill_sm90", AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=QK), {"positions": True}),
         ("prefill_sm90", AttentionSpec(64, kv_layout=Paged(16), mask=Causal(), variant=QK), {"positions": True}),
         ("prefill_sm90", AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(), variant=QK),
          {"positions": True})]
prefetch(__name__, COMPILE)


# ---------------------------------------------------------------------------------------------- compile


@pytest.mark.nvcc
def test_every_example_compiles_in_every_family_within_the_spill_bound(shared_cache):
    results = build_all(COMPILE)
    report_lines = []
    for (op, spec, _), (entry, report) in zip(COMPILE, results):
        assert entry.cubin[:4] == b"\x7fELF", entry.uri
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        regs = re.findall(r"Used (\d+) registers", report)
        report_lines.append(f"{entry.uri}: {regs} registers, spills {spills}")
        assert spills and max(spills) <= SPILL_BOUND[op], f"{entry.uri} spills {spills}: {report}"
        if spec.variant is not None:
            assert spec.variant.uri in entry.uri
        # the Hopper kernel's wgmma pipeline unbroken with the hooks too (tests/sm90/test_prefill_sm90_compile.py)
        for code in ("C7514", "C7515", "C7517", "C7519"):
            assert code not in report, f"{entry.uri}: ptxas {code} (wgmma pipeline broken): {report}"


@pytest.mark.nvcc
def test_load_transforms_compile_with_rope_fp8_and_positions_without_spills(shared_cache):
    for op, spec, options in LOADS:
        jobs = _kernels(op, spec)  # the Hopper backend: the hooks split between its pre-pass and kernel
        sources = ""
        for (kernel_op, _), (entry, report) in zip(jobs, build_all([job + ("sm_90a",) for job in jobs], options=options)):
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
            assert spills and max(spills) <= SPILL_BOUND[kernel_op], f"{entry.uri} spills {spills}: {report}"
            sources += (entry.path / "kernel.cu").read_text()
        assert sources.count('#line 1 "variant.q_transform"') == 1
        assert sources.count('#line 1 "variant.k_transform"') == (spec.variant is not Q_GAIN)


@pytest.mark.nvcc
def test_an_nvcc_error_in_a_hook_names_the_hooks_line(shared_cache):
    bad = Variant(score="float y = logit;\nreturn y + logit.nonsense;")  # passes the light check, fails nvcc
    for op, layout in FAMILIES[:2]:
        with pytest.raises(Exception, match=r"variant\.score\(2\)"):
            jit.ensure_compiled(_spec(bad, op, layout), op, "sm_90a")


# ---------------------------------------------------------------------------------------------- key


def _render(variant, op="prefill", layout=Ragged()):
    return jit.render(_spec(variant, op, layout), op)


def test_the_key_separates_hook_texts_and_unifies_spellings():
    a = Variant(score="return logit * 0.5f;")
    b = Variant(score="return logit * 0.25f;")
    same = Variant(score="""
        return logit * 0.5f;
    """)
    expr = Variant(score="logit * 0.5f")  # a lone expression is the same body
    for op, layout in FAMILIES:
        specs = [family(op).project(_spec(v, op, layout)) for v in (a, b, same, expr)]
        uris = [family(op).uri(s) for s in specs]
        assert uris[0] != uris[1] and uris[0] == uris[2] == uris[3]
        assert jit.render(specs[0], op) == jit.render(specs[2], op) == jit.render(specs[3], op)
        assert jit.render(specs[0], op) != jit.render(specs[1], op)


def test_traced_and_snippet_spellings_are_separate_kernels_of_one_contract():
    traced, snippet = EXAMPLES["document"]
    assert _spec(traced, "prefill", Ragged()).uri != _spec(snippet, "prefill", Ragged()).uri
    source = _render(snippet)
    assert "flashgen_variant::Hooks" in source and '#line 1 "variant.mask"' in source


def test_a_default_kernel_names_no_hooks():
    source = jit.render(AttentionSpec(128, kv_layout=Ragged()), "prefill")
    assert "flashgen::variant::NoHooks" in source and "flashgen_variant" not in source
    layout = family("prefill").entry_points(AttentionSpec(128, kv_layout=Ragged()))[0].params
    assert "variant" not in layout.names()


def test_the_variant_params_come_last_with_their_layout():
    variant = Variant(score="return logit + bias * static_cast<float>(rel(qo_head, kv_idx));",
                      tensors=[("rel", "float32", 2)], scalars=[("bias", "float32")])
    for op, layout in FAMILIES:
        spec = family(op).project(_spec(variant, op, layout))
        params = family(op).entry_points(spec)[0].params
        assert params.names()[-1] == "variant"
        # data pointer, two strides, the scalar: 8 + 16 + 4, padded to 8
        assert params.fields[-1].blob == (32, 8)
        assert "static_assert(sizeof(VariantParams) == 32 && alignof(VariantParams) == 8" in jit.render(spec, op)


def test_every_family_runs_k_transforms():
    """One hook contract: decode, the portable prefill and the Hopper backend (in its pre-pass) all render the
    k_transform."""
    for op, layout in FAMILIES:
        sources = [jit.render(s, o) for o, s in _kernels(op, _spec(QK, op, layout))]
        assert sum('#line 1 "variant.k_transform"' in source for source in sources) == 1
    assert select(AttentionSpec(128, kv_layout=Ragged(), variant=QK), "auto", (9, 0)) == "sm90"


def test_the_sm90_kernel_leaves_the_k_transform_to_the_pre_pass_and_its_text_enters_the_key():
    """The kernel itself refuses a k_transform, naming the pre-pass that runs it; the pre-pass's key follows the
    hook text (two texts, two kernels; a q-only variant and no variant, none)."""
    with pytest.raises(SpecError, match=r"variant\.k_transform: the sm90 kernel runs no k transform itself; the sm90 "
                                        r"backend runs it in the rope_gather pre-pass"):
        family("prefill_sm90").project(AttentionSpec(128, kv_layout=Ragged(), variant=QK))
    other = Variant(k_transform="return value * 3.0f;")
    for d in (64, 128, 256):
        for layout in (Ragged(), Paged(16), Paged(5)):
            specs = [AttentionSpec(d, kv_layout=layout, mask=Causal(), variant=v) for v in (QK, EXAMPLES["qk_gain"][1], other)]
            keys = {jit.prepare(dict(kernels_for(s, "sm90"))["rope_gather"], "rope_gather", "sm_90a").content_key
                    for s in specs}
            assert len(keys) == 3
            for v in (None, Q_GAIN):
                assert "rope_gather" not in dict(kernels_for(specs[0].replace(variant=v), "sm90"))


def test_the_sm90_backend_runs_load_transforms_in_its_pre_pass():
    """A k_transform (and under RoPE the q_transform too) runs in the rope_gather pre-pass, once an element, before
    RoPE; the kernel of the ragged twin runs the rest of the variant (None where nothing is left) and keeps every
    declaration. Not in CUDA-graph mode: auto falls back to portable there, sm90 says why."""
    k_only = Variant(k_transform=QK.k_transform, tensors=QK.tensors)
    for rope in (None, RoPE()):
        for variant in (Q_GAIN, k_only, QK):
            spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=rope, variant=variant)
            assert select(spec, "auto", (9, 0)) == "sm90"
            kernels = dict(kernels_for(spec, "sm90"))
            if rope is None and variant is Q_GAIN:  # nothing for a pre-pass: the kernel itself
                assert kernels == {"prefill_sm90": spec}
                continue
            pre, twin = kernels["rope_gather"].variant, kernels["prefill_sm90"].variant
            assert kernels["prefill_sm90"].kv_layout == Ragged() and kernels["prefill_sm90"].pos_encoding is None
            assert pre is None or (pre.k_transform == variant.k_transform and pre.tensors == variant.tensors)
            assert (pre is not None and pre.q_transform is not None) == (rope is not None and variant.q_transform is not None)
            if rope is None and variant.q_transform is not None:
                assert twin.q_transform == variant.q_transform and twin.k_transform is None
                assert twin.tensors == variant.tensors
            else:
                assert twin is None
            if pre is not None:
                source = jit.render(kernels["rope_gather"], "rope_gather")
                for name in ("q_transform", "k_transform"):
                    assert (f'#line 1 "variant.{name}"' in source) == (getattr(pre, name) is not None)
            with pytest.raises(SpecError, match="not CUDA-graph safe"):
                select(spec, "sm90", (9, 0), graph=True)
            assert select(spec, "auto", (9, 0), graph=True) == "portable"


def test_load_transforms_enter_the_key_and_order_before_rope():
    """A transform's text changes the kernel key; kernels without one keep theirs; the hook's call precedes the
    RoPE rotation in the q and K loads of decode and the portable prefill (fp8 K/V's q load too), and in the
    Hopper prefill's q pass."""
    base = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())
    k_only = Variant(k_transform="return value * 2.0f;")
    k_other = Variant(k_transform="return value * 3.0f;")
    for op in ("decode", "prefill"):
        uris = {family(op).uri(family(op).project(base.replace(variant=v))) for v in (None, QK, k_only, k_other)}
        assert len(uris) == 4
    decode = (include_dir() / "flashgen/decode/tiles.cuh").read_text()
    assert decode.index("q_value<") < decode.index("rope_rotate_by<C::ROPE_SCALING, true>(lo[i]")
    kernel = (include_dir() / "flashgen/decode/kernel.cuh").read_text()
    assert kernel.index("lo = k_in(lo") < kernel.index("rope_rotate_by<C::ROPE_SCALING, true>(lo.x, hi.x")
    prefill = (include_dir() / "flashgen/prefill/tiles.cuh").read_text()
    assert prefill.index("map_chunk<DTypeKV>(x") < prefill.index("rope_chunk_pair<DTypeKV, C::ROPE_SCALING>(x, y")
    assert prefill.index("map_chunk<typename C::DTypeQ>(a") < prefill.index(
        "rope_chunk_pair<typename C::DTypeQ, C::ROPE_SCALING>(a")
    assert prefill.index("map_chunk<DTypeQ>(x[h][0]") < prefill.index("rope_chunk_pair<DTypeQ, C::ROPE_SCALING>(x[0][0]")
    sm90 = (include_dir() / "flashgen/sm90/q_transform.cuh").read_text()  # a cache of rotated K: q turns there
    assert sm90.index("lo[e] = flashgen::variant::q_value<V>") < sm90.index("rope_pair(lo[e], hi[e], cs[e], sn[e])")


def test_fp8_k_transforms_take_k_scale_out_of_sm_scale():
    """The hook sees the dequantised element: the kernel takes k_scale as a param, and plan() leaves sm_scale."""
    spec = family("decode").project(AttentionSpec(128, kv_layout=Paged(16), kv_dtype="float8_e4m3fn", variant=QK))
    for op in ("decode", "prefill"):
        names = family(op).entry_points(spec)[0].params.names()
        assert "k_scale" in names and names[-1] == "variant"
        plain = spec.replace(variant=Q_GAIN)
        assert "k_scale" not in family(op).entry_points(plain)[0].params.names()
    runtime = fp8_scaled(runtime_values(spec), True, 0.5, 2.0, fold_k=False)[0]
    assert runtime.sm_scale == runtime_values(spec).sm_scale
    assert fp8_scaled(runtime_values(spec), True, 0.5, 2.0)[0].sm_scale == 0.5 * runtime.sm_scale


# ---------------------------------------------------------------------------------------------- run()

HEADS = dict(num_qo_heads=8, num_kv_heads=2)
CSR = dict(kv_indptr=[0, 2, 3], kv_indices=[0, 1, 2], kv_last_page_len=[16, 5])


def dev(*shape, dtype=torch.bfloat16):
    return on_device(torch.zeros(*shape, dtype=dtype))


def _cache():
    return dev(5, 16, 2, 128), dev(5, 16, 2, 128)


@pytest.fixture
def stubbed():
    with stubbed_cuda():
        yield


def _decode(variant, **plan):
    w = flashgen.BatchDecodeWrapper(AttentionSpec(128, kv_layout=Paged(16), variant=variant), num_sms=132)
    w.plan(**CSR, **HEADS, **plan)
    return w


DOC = EXAMPLES["document"][1]
T5 = EXAMPLES["t5_bias"][0]
SIGMOID = EXAMPLES["sigmoid"][0]


def _variant_bytes(w):
    params = w._impl._params
    return params.values()["variant"]


def test_run_packs_tensors_and_scalars_where_the_kernel_reads_them(stubbed):
    w = _decode(T5)
    table = torch.randn(8, 32)[:, ::2]  # a strided view: its strides travel, not a copy
    w.run(dev(2, 8, 128), _cache(), rel_bias=table)
    assert _variant_bytes(w) == struct.pack("<Qqq", table.data_ptr(), *table.stride())
    w = _decode(SIGMOID)
    w.run(dev(2, 8, 128), _cache(), bias=-2.5)
    assert _variant_bytes(w) == struct.pack("<f", -2.5)


def test_scalars_never_recompile(stubbed):
    builds = []

    def counting(*args, **kwargs):
        builds.append(args)
        return fake_build(*args, **kwargs)

    with mock.patch.object(jit, "build", counting):
        w = _decode(SIGMOID)
        for bias in (-1.0, 0.0, 3.5):
            w.run(dev(2, 8, 128), _cache(), bias=bias)
            assert _variant_bytes(w) == struct.pack("<f", bias)
        w.plan(**CSR, **HEADS)
        w.run(dev(2, 8, 128), _cache(), bias=7.0)
    assert len(builds) == 1


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({}, TypeError, r"^run\(\): missing the variant's argument\(s\) doc_ids \(variant var\w+ declares: doc_ids\)"),
    ({"doc_ids": None, "docs": 1}, TypeError, r"got unexpected keyword argument\(s\) docs"),
    ({"doc_ids": [1, 2]}, TypeError, r"^doc_ids: got list, expected a int32 tensor of rank 1"),
    ({"doc_ids": torch.zeros(4, dtype=torch.int64)}, ValueError,
     r"^doc_ids: got a int64 tensor of rank 1 on cpu, expected a int32 tensor of rank 1"),
    ({"doc_ids": torch.zeros(4, 2, dtype=torch.int32)}, ValueError, r"^doc_ids: got a int32 tensor of rank 2"),
    ({"doc_ids": torch.zeros(4, dtype=torch.int32, device="meta")}, ValueError, r"^doc_ids: .* on meta, expected"),
])
def test_bad_variant_arguments_name_the_argument(stubbed, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        _decode(DOC).run(dev(2, 8, 128), _cache(), **kwargs)


@pytest.mark.parametrize("value, error, pattern", [
    ("1.0", TypeError, r"^bias: got '1.0', expected a number"),
    (True, TypeError, r"^bias: got True"),
    (float("nan"), ValueError, r"^bias: got nan, expected a finite float32"),
    (1e39, ValueError, r"^bias: got 1e\+39"),
])
def test_bad_scalars_name_the_argument(stubbed, value, error, pattern):
    with pytest.raises(error, match=pattern):
        _decode(SIGMOID).run(dev(2, 8, 128), _cache(), bias=value)


def test_int_scalars_are_range_checked(stubbed):
    variant = Variant(score="return logit + static_cast<float>(shift);", scalars=[("shift", "int32")])
    w = _decode(variant)
    w.run(dev(2, 8, 128), _cache(), shift=-7)
    assert _variant_bytes(w) == struct.pack("<i", -7)
    with pytest.raises(ValueError, match=r"^shift: got 2147483648, expected an int in"):
        w.run(dev(2, 8, 128), _cache(), shift=2**31)
    with pytest.raises(TypeError, match=r"^shift: got 1.5, expected an int"):
        w.run(dev(2, 8, 128), _cache(), shift=1.5)


def test_prefill_and_attention_take_the_arguments(stubbed):
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC)
    w = flashgen.BatchPrefillWrapper(spec, backend="portable", num_sms=132)
    w.plan(qo_indptr=[0, 3, 7], kv_indptr=[0, 3, 10], **HEADS)
    ids = torch.zeros(10, dtype=torch.int32)
    w.run(dev(7, 8, 128), (dev(10, 2, 128), dev(10, 2, 128)), doc_ids=ids)
    assert w._impl._params.values()["variant"] == struct.pack("<Qq", ids.data_ptr(), 1)
    with pytest.raises(TypeError, match="missing the variant's argument"):
        w.run(dev(7, 8, 128), (dev(10, 2, 128), dev(10, 2, 128)))


def test_a_wrapper_without_a_variant_refuses_keywords(stubbed):
    w = _decode(None)
    with pytest.raises(TypeError, match=r"^run\(\): got unexpected keyword argument\(s\) doc_ids \(the spec has no"):
        w.run(dev(2, 8, 128), _cache(), doc_ids=torch.zeros(3, dtype=torch.int32))


def test_cascade_and_block_sparse_refuse_a_variant():
    spec = AttentionSpec(128, kv_layout=Paged(16), variant=DOC)
    with pytest.raises(SpecError, match="variant: CascadeWrapper does not run variants yet"):
        flashgen.CascadeWrapper(spec)


# ---------------------------------------------------------------------------------------------- reference


def _traced_reference(variant, args, q, k, v, q_pos, k_pos, visible, sm_scale, batch):
    """The traced hooks evaluated on the grid, then softmax (sink in the denominator) or the weights' sum."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    q, k = q.double(), k.double()
    def load(hook, x, pos, idx, head):  # each element of x [n, heads, dim] at load, over (position, head, dim)
        if getattr(variant, hook) is None:
            return x
        env = {"value": x, "batch": torch.tensor(batch), idx: pos.view(-1, 1, 1),
               head: torch.arange(x.shape[1]).view(1, -1, 1), "dim": torch.arange(x.shape[2]).view(1, 1, -1), **args}
        return evaluate(getattr(variant, hook).expr, env).expand_as(x).double()

    q = load("q_transform", q, q_pos, "qo_idx", "qo_head")
    k = load("k_transform", k, k_pos, "kv_idx", "kv_head")
    k, v = k.repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    env = {"qo_head": torch.arange(heads).view(-1, 1, 1), "kv_head": torch.arange(heads).view(-1, 1, 1) // group,
           "qo_idx": q_pos.view(1, -1, 1), "kv_idx": k_pos.view(1, 1, -1), "batch": torch.tensor(batch),
           "logit": logits, **args}
    keep = visible[None].clone()
    if variant.mask is not None:
        keep = keep & evaluate(variant.mask.expr, env).bool()
    if variant.score is not None:
        logits = evaluate(variant.score.expr, env).expand_as(logits).double()
    if not variant.softmax:
        return torch.einsum("hqk,khd->qhd", logits.masked_fill(~keep, 0.0), v)
    logits = logits.masked_fill(~keep, float("-inf"))
    if variant.sink is not None:
        sink_env = {**env, "qo_head": torch.arange(heads).view(-1, 1), "qo_idx": q_pos.view(1, -1)}
        sink = evaluate(variant.sink.expr, sink_env).expand(heads, q.shape[0])
        logits = torch.cat([logits, sink.double()[..., None]], dim=-1)
        v = torch.cat([v, torch.zeros(1, heads, v.shape[-1], dtype=v.dtype)])
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_gpu_reference_agrees_with_the_traced_hooks(name):
    g = torch.Generator().manual_seed(5)
    nq, nk, hkv, group = 9, 64, 2, 2  # 64: the tree's bits fill the int64 words, sign bit included
    q, k, v = (torch.randn(n, h, 32, generator=g) for n, h in ((nq, hkv * group), (nk, hkv), (nk, hkv)))
    q_pos, k_pos = torch.arange(nk - nq, nk), torch.arange(nk)
    visible = k_pos[None, :] <= q_pos[:, None]
    args = example_args(name, heads=hkv * group, max_kv=nk, batch=2, generator=g)
    out, _ = example_attention(name, args, q, k, v, q_pos, k_pos, visible, 0.2, batch=1)
    want = _traced_reference(EXAMPLES[name][0], args, q, k, v, q_pos, k_pos, visible, 0.2, 1)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    low, _ = example_attention(name, args, q.bfloat16(), k.bfloat16(), v.bfloat16(), q_pos, k_pos, visible, 0.2,
                               batch=1, low_precision=True)
    assert (low - want).abs().max() < 0.1


def test_the_document_tile_predicate_agrees_with_its_mask():
    """examples.DOCUMENT_TILED: on random tiles of sorted ids, EMPTY hides every pair, FULL keeps every one."""
    variant = EXAMPLES["document_tiled"][0]
    g = torch.Generator().manual_seed(3)
    ids = torch.repeat_interleave(torch.arange(40), torch.randint(1, 30, (40,), generator=g))[:300].int()
    seen = set()
    for _ in range(400):
        q0, k0 = (int(x) for x in torch.randint(0, 290, (2,), generator=g))
        q1, k1 = q0 + int(torch.randint(1, 10, (1,), generator=g)), k0 + int(torch.randint(1, 10, (1,), generator=g))
        seen.add(tile_class(variant, q0, q1, k0, k1, {"doc_ids": ids}))
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("rope", [None, RoPE()], ids=["plain", "rope"])
@pytest.mark.parametrize("which", ["k_only", "qk"])
def test_the_sm90_pre_pass_takes_the_run_arguments(which, rope):
    """The pre-pass's VariantParams carry the run() arguments: packed there alone when the kernel runs no hook
    (a k_transform alone, or both transforms under RoPE), else copied from the kernel's params at run()."""
    variant = QK if which == "qk" else Variant(k_transform=QK.k_transform, tensors=QK.tensors)
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=rope, variant=variant)
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)), \
            mock.patch("flashgen.jit.build", fake_build), \
            mock.patch("flashgen.api.sm90.kv_tensor_map", lambda *args: bytes(128)), \
            mock.patch("flashgen.api.sm90.qo_tensor_map", lambda *args: bytes(128)):
        wrapper = flashgen.BatchPrefillWrapper(spec)
        assert wrapper.backend == "sm90"
        wrapper.plan(qo_indptr=[0, 3, 5], kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[3, 4],
                     num_qo_heads=4, num_kv_heads=2)
        impl = wrapper._impl
        kernel_runs_hooks = impl.kernel_spec.variant is not None
        assert kernel_runs_hooks == (which == "qk" and rope is None)
        q = on_device(torch.zeros(5, 4, 128, dtype=torch.bfloat16))
        cache = tuple(on_device(torch.zeros(5, 16, 2, 128, dtype=torch.bfloat16)) for _ in range(2))
        args = {"q_gain": on_device(torch.ones(4, 128)), "k_gain": on_device(torch.ones(2, 128))}  # both declared
        wrapper.run(q, cache, out=on_device(torch.zeros(5, 4, 128, dtype=torch.bfloat16)), **args)
        pre = impl._rope_params.values()["variant"]
        assert args["k_gain"].data_ptr() in struct.unpack(f"{len(pre) // 8}q", pre)
        if kernel_runs_hooks:
            assert impl._params.values()["variant"] == pre
