"""Fused append + decode (``kernel_options={"append": True}``), RoPE scaling for q (Llama-3.1, YaRN) and
``RoPE(k_rotated=True)`` on the CPU: spec identity and kernel keys, the kernels' form of the scalings against the
references, refusals, ``run()``'s ``k_new`` / ``v_new`` checks, what ``plan()`` packs; and the fused kernel compiled
for sm_90a (nvcc, no GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import AttentionSpec, Llama31Scaling, Paged, Ragged, RoPE, SpecError, YaRNScaling
from flashgen.api import backends
from flashgen.kernels import family
from flashgen.spec import spec_from_dict, spec_to_dict
from flashgen.testing.append import rope_attention_factor, rope_inv_freq
from stub_cuda import on_device, stubbed_cuda

APPEND = {"append": True}
L31 = RoPE(500000.0, scaling=Llama31Scaling())
MATRIX = [  # bf16 and fp8 caches, RoPE off / on (in-kernel K, rotated cache, scaled), page sizes 1 and 16
    AttentionSpec(128, kv_layout=Paged(16)),
    AttentionSpec(128, kv_layout=Paged(1), pos_encoding=RoPE(k_rotated=True)),
    AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(500000.0, scaling=Llama31Scaling(), k_rotated=True)),
    AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16)),
    AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(1), pos_encoding=L31),
    AttentionSpec(128, kv_dtype="float8_e5m2", kv_layout=Paged(16, "HND"),
                  pos_encoding=RoPE(scaling=YaRNScaling(), k_rotated=True)),
    AttentionSpec(64, kv_layout=Paged(16), pos_encoding=RoPE()),
    AttentionSpec(256, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True)),
    AttentionSpec(256, kv_dtype="float8_e4m3fn", kv_layout=Paged(17), pos_encoding=RoPE()),
]
PREFILL_ROTATED = AttentionSpec(128, kv_layout=Paged(16), mask=flashgen.Causal(), pos_encoding=RoPE(k_rotated=True))
prefetch(__name__, [("decode", spec, "sm_90a") for spec in MATRIX], APPEND)
prefetch(__name__, [("prefill", PREFILL_ROTATED, "sm_90a")])


@pytest.mark.nvcc
def test_fused_kernels_compile_for_sm90a(shared_cache):
    results = build_all([("decode", spec, "sm_90a") for spec in MATRIX], options=APPEND)
    fam = family("decode", APPEND)
    for spec, (entry, report) in zip(MATRIX, results):
        assert_sound_cubin(entry, report, [e.name for e in fam.entry_points(fam.project(spec))])


@pytest.mark.nvcc
def test_prefill_over_a_rotated_cache_compiles_for_sm90a(shared_cache):
    (entry, report), = build_all([("prefill", PREFILL_ROTATED, "sm_90a")])
    assert_sound_cubin(entry, report, ["prefill"])


# ---------------------------------------------------------------------------------------------- spec and keys


def test_plain_rope_keeps_its_name_and_the_new_kinds_enter_the_key():
    assert RoPE().uri == "rope" and RoPE(123.0, 2.0).uri == "rope"
    assert RoPE(k_rotated=True).uri == "ropekrot"
    assert RoPE(scaling=Llama31Scaling()).uri == "ropel31"
    assert RoPE(scaling=YaRNScaling(), k_rotated=True).uri == "ropeyarnkrot"
    base = AttentionSpec(128, pos_encoding=RoPE())
    # the scaling's numbers are runtime values: one kernel for every Llama-3.1 model
    a = AttentionSpec(128, pos_encoding=RoPE(scaling=Llama31Scaling(8.0)))
    b = AttentionSpec(128, pos_encoding=RoPE(scaling=Llama31Scaling(32.0, original_max_position=4096)))
    assert a.kernel_fields() == b.kernel_fields() != base.kernel_fields()
    for spec in MATRIX:
        assert spec_from_dict(spec_to_dict(spec)) == spec


def test_bad_rope_parts_are_refused():
    with pytest.raises(SpecError, match=r"^pos_encoding.scaling: got 'yarn', expected None, Llama31Scaling"):
        AttentionSpec(128, pos_encoding=RoPE(scaling="yarn"))
    with pytest.raises(SpecError, match=r"^pos_encoding.k_rotated: got 1, expected True or False"):
        AttentionSpec(128, pos_encoding=RoPE(k_rotated=1))
    with pytest.raises(SpecError, match=r"^rope_scaling.beta_fast: got 1.0, expected > beta_slow"):
        YaRNScaling(beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(SpecError, match=r"^rope_scaling.factor: got -2"):
        YaRNScaling(factor=-2)


def test_the_append_option_names_its_kernel_and_adds_its_params_last():
    spec = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())
    plain, fused = family("decode"), family("decode", APPEND)
    assert fused.uri(spec) == plain.uri(spec) + "_append" and fused.options == (("append", "true"),)
    assert family("decode", {"append": True, "positions": True}).uri(spec) == plain.uri(spec) + "_pos_append"
    assert family("decode", {"append": False}).uri(spec) == plain.uri(spec)
    names = [f.name for f in fused.entry_points(spec)[0].params.fields]
    assert names[-8:] == ["k_new", "v_new", "k_new_stride_token", "k_new_stride_head", "v_new_stride_token",
                          "v_new_stride_head", "k_rcp_scale", "v_rcp_scale"]
    assert names[:-8] == [f.name for f in plain.entry_points(spec)[0].params.fields]
    text = fused.render(spec)
    assert "APPEND = true" in text and "ROPE_K = true" in text and "ROPE_K_ON_WRITE = false" in text
    rotated = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True))
    text = fused.render(rotated)
    assert "ROPE_K = false" in text and "ROPE_K_ON_WRITE = true" in text and "ROPE = true" in text


def test_a_default_decode_kernel_renders_as_before():
    """The default kernel's params struct is unchanged and its new switches are off (its PTX and SASS were
    compared byte for byte when these were added)."""
    spec = AttentionSpec(128, kv_layout=Paged(16))
    text = family("decode").render(spec)
    for flag in ("APPEND", "ROPE_K", "ROPE_SCALING", "ROPE_K_ON_WRITE"):
        assert f"{flag} = false" in text
    names = [f.name for f in family("decode").entry_points(spec)[0].params.fields]
    assert names[-1] == "v_scale" and "rope_mscale" not in names and "k_new" not in names


def test_scaling_params_follow_the_scaling():
    scaled = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(scaling=YaRNScaling()))
    names = [f.name for f in family("decode").entry_points(scaled)[0].params.fields]
    assert names[-5:] == ["rope_rcp_factor", "rope_smooth_a", "rope_smooth_b", "rope_smooth_c", "rope_mscale"]
    assert "ROPE_SCALING = true" in family("decode").render(scaled)


def test_refusals():
    with pytest.raises(SpecError, match=r"^kernel_options\['append'\]: got 'yes', expected True or False"):
        family("decode", {"append": "yes"})
    with pytest.raises(SpecError, match=r"^kernel_options: got \['tiles'\], decode takes 'positions' and 'append'"):
        family("decode", {"tiles": "kv32"})
    with pytest.raises(SpecError, match=r"^kv_layout: got Ragged\(\); kernel_options\['append'\] writes into a paged"):
        family("decode", APPEND).check(AttentionSpec(128, kv_layout=Ragged()))
    scaled = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=L31)
    family("prefill").check(scaled)  # the prefills take the scalings too
    assert "ROPE_SCALING = true" in family("prefill").render(scaled)
    rotated = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(k_rotated=True))
    assert backends.select(rotated, "auto", (9, 0)) == "sm90"  # q turns in the kernel, graphs included
    assert backends.select(rotated, "auto", (9, 0), graph=True) == "sm90"
    assert backends.select(rotated.replace(pos_encoding=RoPE()), "auto", (9, 0), graph=True) == "portable"
    assert "ROPE_K = false" in family("prefill").render(rotated)


@pytest.mark.parametrize("backend,k_rotated", [("portable", False), ("portable", True), ("sm90", False),
                                               ("sm90", True)])
def test_prefill_plans_pack_the_scaling_where_q_or_k_turns(monkeypatch, backend, k_rotated):
    """The scaling's terms at the plan's theta go to the kernel that turns: the portable kernel; on sm90 its K
    pre-pass over unrotated K (the kernel then has no RoPE), or the kernel itself over rotated K."""
    with stubbed_cuda():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        monkeypatch.setattr("flashgen.api.sm90.kv_tensor_map", lambda *args: bytes(128))  # the driver's
        rope = RoPE(500000.0, scaling=YaRNScaling(factor=8.0), k_rotated=k_rotated)
        spec = AttentionSpec(128, kv_layout=Paged(16), mask=flashgen.Causal(), pos_encoding=rope)
        wrapper = flashgen.BatchPrefillWrapper(spec, num_sms=132, backend=backend)
        wrapper.plan(qo_indptr=[0, 3, 5], num_qo_heads=8, num_kv_heads=2, kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0],
                     kv_last_page_len=[5, 16], rope_theta=10000.0, rope_scale=2.0)
        impl = wrapper._impl
        pre_pass = backend == "sm90" and not k_rotated
        assert getattr(impl, "prepass", False) == pre_pass
        values = (impl._rope_params if pre_pass else impl._params).values()
        names = ("rope_rcp_factor", "rope_smooth_a", "rope_smooth_b", "rope_smooth_c", "rope_mscale")
        for name, term in zip(names, rope.rope_terms(128, 10000.0)):
            assert values[name] == pytest.approx(term, rel=1e-6), name
        assert values["rope_log2_theta"] == pytest.approx(math.log2(10000.0))
        assert values["rope_rcp_scale"] == pytest.approx(0.5)
        if pre_pass:
            assert "rope_mscale" not in impl._params.values()  # the kernel of the ragged twin turns nothing


# ---------------------------------------------------------------------------------------------- the kernels' form


def _kernel_freqs(rope: RoPE, dim: int) -> np.ndarray:
    """common/rope.cuh's rope_scaled_freq in fp64, from rope_terms."""
    rcp_factor, a, b, c, _ = rope.rope_terms(dim)
    i = np.arange(dim // 2)
    f = rope.theta ** (-2.0 * i / dim)
    s = np.clip(f * a + i * c + b, 0.0, 1.0)
    return (1 - s) * f * rcp_factor + s * f


@pytest.mark.parametrize("scaling", [None, Llama31Scaling(), Llama31Scaling(32.0, 2.0, 8.0, 4096),
                                     YaRNScaling(), YaRNScaling(16.0, 8192, 16.0, 2.0, truncate=False),
                                     YaRNScaling(40.0, 4096, attention_factor=1.3)])
@pytest.mark.parametrize("theta, dim", [(10000.0, 128), (500000.0, 128), (1e6, 64)])
def test_the_kernels_scaled_frequencies_match_the_references(scaling, theta, dim):
    rope = RoPE(theta, scaling=scaling)
    np.testing.assert_allclose(_kernel_freqs(rope, dim), rope_inv_freq(dim, theta, scaling).numpy(), rtol=1e-12)
    assert math.isclose(rope.rope_terms(dim)[4], rope_attention_factor(scaling))


def test_yarn_terms_worked_example():
    rcp_factor, a, b, c, mscale = YaRNScaling(4.0, 4096).rope_terms(10000.0, 128)
    assert (rcp_factor, a) == (0.25, 0.0) and math.isclose(c, -1 / 26) and math.isclose(b, 1 + 20 / 26)
    assert math.isclose(mscale, 0.1 * math.log(4.0) + 1)


# ---------------------------------------------------------------------------------------------- run() and plan()

CSR = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[5, 16])  # KV lengths 21, 16
HEADS = dict(num_qo_heads=8, num_kv_heads=2)
BF16 = torch.bfloat16


def dev(*shape, dtype=BF16):
    return on_device(torch.zeros(*shape, dtype=dtype))


class _OtherDevice(torch.Tensor):
    """A CPU tensor that says it lives on device 1 (q, a stubbed device tensor, says -1)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True

    def get_device(self):
        return 1


def _cache(dtype=BF16):
    return dev(5, 16, 2, 128, dtype=dtype), dev(5, 16, 2, 128, dtype=dtype)


@pytest.fixture
def stubbed(monkeypatch):
    with stubbed_cuda():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        yield


def _fused(spec=AttentionSpec(128, kv_layout=Paged(16)), **plan):
    w = flashgen.BatchDecodeWrapper(spec, num_sms=132, kernel_options=APPEND)
    w.plan(**CSR, **HEADS, **plan)
    return w


def test_run_takes_the_new_rows(stubbed):
    w = _fused()
    out = w.run(dev(2, 8, 128), _cache(), k_new=dev(2, 2, 128), v_new=dev(2, 2, 128))
    assert out.shape == (2, 8, 128)
    qkv = dev(2, 2 * 8 + 2 * 2 + 4, 128)  # slices of a fused projection: strided rows
    w.run(dev(2, 8, 128), _cache(), k_new=qkv[:, 8:10], v_new=qkv[:, 10:12])


@pytest.mark.parametrize("changes, error, pattern", [
    (dict(k_new=None), ValueError, r"^k_new: a wrapper built with kernel_options=\{'append': True\} takes k_new"),
    (dict(v_new=None), ValueError, r"^v_new: a wrapper built with"),
    (dict(k_new=np.zeros((2, 2, 128))), TypeError, r"^k_new: expected a torch.Tensor, got ndarray"),
    (dict(k_new=dev(2, 2, 128, dtype=torch.float16)), TypeError, r"^k_new: expected q's dtype torch.bfloat16"),
    (dict(v_new=on_device(torch.zeros(2, 2, 128, dtype=BF16)).as_subclass(_OtherDevice)), ValueError,
     r"^v_new: expected a tensor on q's device"),
    (dict(k_new=dev(3, 2, 128)), ValueError, r"^k_new: expected shape \(2, 2, 128\) \(one row a request of q"),
    (dict(v_new=dev(2, 4, 128)), ValueError, r"^v_new: expected shape \(2, 2, 128\)"),
    (dict(k_new=dev(2, 2, 64)), ValueError, r"^k_new: expected shape \(2, 2, 128\)"),
    (dict(k_new=dev(2, 2, 256)[:, :, ::2]), ValueError, r"^k_new: rows must be contiguous and 16-byte aligned"),
    (dict(v_new=on_device(torch.zeros(2 * 2 * 128 + 1, dtype=BF16)[1:].view(2, 2, 128))), ValueError,
     r"^v_new: rows must be contiguous and 16-byte aligned"),
])
def test_bad_new_rows_name_the_argument(stubbed, changes, error, pattern):
    args = {"k_new": dev(2, 2, 128), "v_new": dev(2, 2, 128), **changes}
    with pytest.raises(error, match=pattern):
        _fused().run(dev(2, 8, 128), _cache(), **args)


def test_new_rows_need_the_option(stubbed):
    w = flashgen.BatchDecodeWrapper(AttentionSpec(128, kv_layout=Paged(16)), num_sms=132)
    w.plan(**CSR, **HEADS)
    with pytest.raises(ValueError, match=r"^k_new: fused append \+ decode needs a wrapper built with kernel_options"):
        w.run(dev(2, 8, 128), _cache(), k_new=dev(2, 2, 128), v_new=dev(2, 2, 128))
    with pytest.raises(ValueError, match=r"^v_new: fused append"):
        w.run(dev(2, 8, 128), _cache(), v_new=dev(2, 2, 128))


def test_plan_packs_the_scales_and_the_scaling(stubbed):
    spec = AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16),
                         pos_encoding=RoPE(500000.0, scaling=YaRNScaling(8.0, 8192), k_rotated=True))
    w = _fused(spec, k_scale=0.5, v_scale=4.0)
    values = w._impl._params.values()
    assert values["k_rcp_scale"] == 2.0 and values["v_rcp_scale"] == 0.25
    terms = spec.pos_encoding.rope_terms(128)
    got = [values[n] for n in ("rope_rcp_factor", "rope_smooth_a", "rope_smooth_b", "rope_smooth_c", "rope_mscale")]
    np.testing.assert_allclose(got, terms, rtol=1e-6)
    w.plan(**CSR, **HEADS, rope_theta=10000.0)  # the scaling's terms follow the plan's theta
    assert values != w._impl._params.values()
    w.run(dev(2, 8, 128), _cache(torch.float8_e4m3fn), k_new=dev(2, 2, 128), v_new=dev(2, 2, 128))
