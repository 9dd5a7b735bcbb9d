"""The Hopper prefill family compiles for sm_90a without spills, each variant well within the build-time budget."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from compile_checks import WORKERS, build_all, prefetch
from flashgen import jit
from flashgen.spec import (ALiBi, AttentionSpec, Causal, CustomMask, Llama31Scaling, NoMask, Paged, Ragged, RoPE,
                           SlidingWindow, SpecError, YaRNScaling)

SM90_SPECS = [
    AttentionSpec(d, dtype=dtype, kv_layout=Ragged(), mask=mask)
    for d in (64, 128, 256) for dtype in ("bfloat16", "float16") for mask in (NoMask(), Causal())
] + [
    AttentionSpec(d, kv_layout=layout, mask=Causal())
    for d, layout in ((128, Paged(16)), (128, Paged(8, "HND")), (64, Paged(256)), (256, Paged(32)), (256, Paged(128)))
] + [
    AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(1024)),
    AttentionSpec(128, kv_layout=Ragged(), pos_encoding=ALiBi(), soft_cap=30.0),
    AttentionSpec(256, kv_layout=Ragged(), mask=SlidingWindow(64), soft_cap=20.0),
    AttentionSpec(64, kv_layout=Paged(64, "HND"), mask=Causal(), pos_encoding=ALiBi()),
    AttentionSpec(128, kv_layout=Ragged(), mask=SlidingWindow(50), pos_encoding=ALiBi(), soft_cap=20.0),  # near the edge
] + [  # custom masks: tile lists, mask bits read for partial tiles
    AttentionSpec(d, dtype=dtype, kv_layout=layout, mask=CustomMask())
    for d, dtype, layout in ((128, "bfloat16", Ragged()), (128, "float16", Paged(16)), (64, "bfloat16", Ragged()),
                             (256, "bfloat16", Ragged()), (256, "float16", Paged(32, "HND")))
] + [
    AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask(), pos_encoding=ALiBi(), soft_cap=30.0),
] + [  # a cache of rotated K: q turns in shared memory (sm90/q_transform.cuh), plain, Llama-3.1 and YaRN
    AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), pos_encoding=RoPE(k_rotated=True)),
    AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(scaling=Llama31Scaling(), k_rotated=True)),
    # (head_dim 256 spills ~120 bytes in the q pass, where the previous item's O is still live: not listed)
]
GATHER_SPECS = [  # page sizes no TMA box takes: rows gathered by the K and V producer warps (40 registers)
    AttentionSpec(128, kv_layout=Paged(1)),
    AttentionSpec(128, kv_layout=Paged(5, "HND")),
    AttentionSpec(128, kv_layout=Paged(24), mask=Causal()),
    AttentionSpec(64, kv_layout=Paged(3), mask=Causal()),
    AttentionSpec(256, kv_layout=Paged(12), mask=Causal()),
    AttentionSpec(256, dtype="float16", kv_layout=Paged(96, "HND")),
    AttentionSpec(128, kv_layout=Paged(5), mask=CustomMask()),
    AttentionSpec(128, kv_layout=Paged(12), mask=SlidingWindow(100), pos_encoding=ALiBi(), soft_cap=20.0),
    AttentionSpec(64, kv_layout=Paged(5), mask=Causal(), pos_encoding=RoPE(scaling=YaRNScaling(), k_rotated=True)),
]
ROPE_SPECS = [
    AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE()),
    AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(scaling=Llama31Scaling())),
    AttentionSpec(128, kv_layout=Ragged(), pos_encoding=RoPE(scaling=YaRNScaling())),
    AttentionSpec(128, kv_layout=Paged(64, "HND"), pos_encoding=RoPE()),
    AttentionSpec(64, dtype="float16", kv_layout=Ragged(), pos_encoding=RoPE()),
    AttentionSpec(256, kv_layout=Paged(1), pos_encoding=RoPE()),
]
prefetch(__name__, [("prefill_sm90", s, "sm_90a") for s in SM90_SPECS + GATHER_SPECS]
         + [("rope_gather", s, "sm_90a") for s in ROPE_SPECS])
BUILD_SECONDS = 60  # per variant on the 2-core build machine (about 1 s measured with nvcc 13.0)


@pytest.fixture(scope="module")
def sm90_builds(kernel_cache):
    """Every variant compiled once, in parallel (one nvcc per core), into the session's shared cache: uri ->
    (entry, ptxas report), or the exception its build raised (the variant's own test raises it)."""
    def one(spec):
        try:
            return build_all([("prefill_sm90", spec, "sm_90a")], workers=1, cache=kernel_cache)[0]
        except Exception as exc:  # noqa: BLE001 - reported by the variant's test
            return exc

    specs = SM90_SPECS + GATHER_SPECS
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return dict(zip((s.uri for s in specs), pool.map(one, specs)))


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", SM90_SPECS + GATHER_SPECS, ids=lambda s: s.uri)
def test_sm90_variant_compiles_without_spills(sm90_builds, spec):
    built = sm90_builds[spec.uri]
    if isinstance(built, Exception):
        raise built
    entry, report = built
    seconds = entry.manifest["compile_seconds"]
    assert entry.cubin[:4] == b"\x7fELF", entry.uri
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), f"{entry.uri} spills registers: {report}"
    assert "0 bytes stack frame" in report, report
    # C7514 / C7515: ptxas serialized the wgmmas (accumulators read, or written, by ordinary instructions inside a
    # pipeline stage); each cost 27-30 % when it slipped in (465 against 683 TFLOP/s). C7517 / C7519: ptxas
    # injected a warpgroup wait or arrive the source does not have (a P V issued under a branch did both).
    for code in ("C7514", "C7515", "C7517", "C7519"):
        assert code not in report, f"{entry.uri}: ptxas {code} (wgmma pipeline broken): {report}"
    assert entry.manifest["entry_points"] == ["prefill_sm90"]
    assert seconds < BUILD_SECONDS, f"{entry.uri} took {seconds:.1f} s to build"


@pytest.mark.parametrize("spec", [
    AttentionSpec(128, kv_layout=Ragged(), pos_encoding=RoPE()),
    AttentionSpec(192, head_dim_vo=128, kv_layout=Ragged()),
], ids=lambda s: s.uri)
def test_sm90_unsupported_specs_are_refused(spec):
    with pytest.raises(SpecError):
        jit.render(spec, "prefill_sm90")


def test_sm90_params_struct_packs_tensor_maps():
    """The tensor maps first (q, o, k, v); 12 pointers, 12 scalars (the group size with its fast divider's magic
    and shift, then the q / o TMA flags), then the custom mask's 4 pointers (the runner's argument tuple in this
    order); the struct 128-byte aligned (CUtensorMap), rendered alignas(128)."""
    from flashgen.kernels import family

    (entry,) = family("prefill_sm90").entry_points(SM90_SPECS[0])
    layout = entry.params
    assert [f.name for f in layout.fields[:4]] == ["tma_q", "tma_o", "tma_k", "tma_v"]
    assert layout.offsets[:4] == (0, 128, 256, 384) and layout.size % 128 == 0 and layout.align == 128
    assert [f.name for f in layout.fields[-4:]] == ["custom_mask", "mask_offset", "tile_indptr", "tiles"]
    names = [f.name for f in layout.fields]
    at = names.index("group_size")
    assert names[at - 1: at + 5] == ["num_qo_heads", "group_size", "group_magic", "group_shift", "q_tma", "o_tma"]
    assert layout.fields[at + 1].ctype == "uint32_t"
    maps = [bytes([i]) * 128 for i in (1, 2, 3, 4)]
    packed = layout.packer().pack(*maps, *([0] * 12), 1, 1, 2**31, 0, 1, 1, 0.5, 1, 1, 0, 0, 0.0, 7, 8, 9, 10)
    assert packed[layout.offsets[at + 1]: layout.offsets[at + 1] + 4] == (2**31).to_bytes(4, "little")
    assert packed[:512] == b"".join(maps) and len(packed) == layout.size
    assert packed[layout.offsets[-1]: layout.offsets[-1] + 8] == (10).to_bytes(8, "little")
    assert "struct alignas(128) PrefillSM90Params {" in jit.render(SM90_SPECS[0], "prefill_sm90")


def test_sm90_params_struct_of_a_gathered_cache():
    """A gathered page size (sm90_gather) takes the cache's k, v and element strides (the runner's kv_args)
    where the K and V tensor maps were, after the q map (and the o map where the variant stages O, as at head_dim
    64 but not 128); the rest of the struct is the same fields in the same order."""
    from flashgen.kernels import family
    from flashgen.kernels.prefill_sm90 import sm90_gather

    assert [sm90_gather(ps, 128) for ps in (1, 5, 12, 24, 48, 96, 8, 16, 128, 256, 384)] == [True] * 6 + [False] * 5
    assert [sm90_gather(ps, 256) for ps in (32, 64, 96, 128, 12)] == [False, False, True, False, True]
    tma = family("prefill_sm90").entry_points(SM90_SPECS[0])[0].params
    (entry,) = family("prefill_sm90").entry_points(GATHER_SPECS[0])
    layout = entry.params
    assert [f.name for f in layout.fields[:6]] == ["tma_q", "k", "v", "stride_page", "stride_token", "stride_head"]
    assert [f.name for f in layout.fields[6:]] == [f.name for f in tma.fields[4:]]
    assert layout.align == 128 and layout.offsets[:6] == (0, 128, 136, 144, 152, 160)
    packed = layout.packer().pack(b"\1" * 128, 1, 2, 3, 4, 5, *([0] * 12), 1, 1, 2**31, 0, 1, 0, 0.5, 1, 1, 0, 0, 0.0,
                                  7, 8, 9, 10)
    assert packed[144:152] == (3).to_bytes(8, "little") and len(packed) == layout.size
    source = jit.render(GATHER_SPECS[0], "prefill_sm90")
    assert "static constexpr bool GATHER = true;" in source and "CUtensorMap tma_k" not in source
    assert "CUtensorMap tma_o" not in source  # head_dim 128 gathered: O from registers
    (staged,) = family("prefill_sm90").entry_points(AttentionSpec(64, kv_layout=Paged(3), mask=Causal()))
    assert [f.name for f in staged.params.fields[:3]] == ["tma_q", "tma_o", "k"]
    assert "static constexpr bool GATHER = false;" in jit.render(SM90_SPECS[0], "prefill_sm90")


def test_sm90_o_staging_only_where_it_fits():
    """The staged epilogue (O through shared memory, TMA stores) where its 8 warp areas fit beside two Q buffers
    and the KV stages within 227 KB: head_dim 64 and 128, not 128 with a gathered cache, not 256. The plan then
    picks the TMA paths by the GQA group (sm90_qo_tma)."""
    from flashgen.kernels.prefill_sm90 import SMEM_LIMIT, sm90_o_staged, sm90_qo_tma, sm90_smem_bytes

    assert [sm90_o_staged(d, g) for d, g in ((64, False), (64, True), (128, False), (128, True), (256, False))] == [
        True, True, True, False, False]
    assert sm90_smem_bytes(128) == 192 * 1024 + 1792 + 8 * 16 * 256 <= SMEM_LIMIT
    assert sm90_smem_bytes(128, gather=True) == 192 * 1024 + 1792 + 2048
    assert "static constexpr bool O_STAGED = true;" in jit.render(SM90_SPECS[0], "prefill_sm90")
    assert "static constexpr bool O_STAGED = false;" in jit.render(GATHER_SPECS[0], "prefill_sm90")
    groups = (1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256)
    assert [sm90_qo_tma(g, True) for g in groups] == [
        (True, True), (True, True), (False, False), (True, True), (False, False), (True, True), (True, True),
        (True, False), (True, False), (True, False), (False, False)]
    assert all(not sm90_qo_tma(g, False)[1] for g in groups)


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", ROPE_SPECS, ids=lambda s: s.uri)
def test_rope_gather_compiles_without_spills(shared_cache, spec):

    entry = jit.ensure_compiled(spec, "rope_gather", "sm_90a")
    report = (entry.path / "ptxas.log").read_text()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), f"{entry.uri} spills registers: {report}"


def test_rope_specs_run_on_sm90_through_the_pre_pass():
    from flashgen.api.backends import check_sm90 as check_sm90_backend
    from flashgen.kernels import ragged_twin as attention_spec

    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(), soft_cap=30.0)
    check_sm90_backend(spec)
    assert attention_spec(spec) == AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), soft_cap=30.0)
    with pytest.raises(SpecError):
        jit.render(spec, "prefill_sm90")  # the kernel itself has no RoPE
    with pytest.raises(SpecError, match="CUDA-graph"):
        check_sm90_backend(spec, graph=True)
    check_sm90_backend(AttentionSpec(128, kv_layout=Paged(5), pos_encoding=RoPE()))  # any page size: the pass gathers
    with pytest.raises(SpecError, match="head_dim"):
        check_sm90_backend(AttentionSpec(192, head_dim_vo=128, kv_layout=Ragged(), pos_encoding=RoPE()))


def test_rotated_k_turns_q_in_the_kernel_without_the_pre_pass():
    """RoPE(k_rotated=True): the kernel itself turns q (its ROPE flags and rope params), no pre-pass, graphs too;
    with fp8 K/V or a k_transform the pass runs what it must and turns nothing, the kernel of the twin turns q."""
    from flashgen.api.backends import check_sm90, kernels_for
    from flashgen.kernels import family
    from flashgen.variants.examples import QK_GAIN

    for scaling, names in ((None, []), (Llama31Scaling(), ["rope_rcp_factor", "rope_smooth_a", "rope_smooth_b",
                                                             "rope_smooth_c", "rope_mscale"])):
        spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(scaling=scaling, k_rotated=True))
        for graph in (False, True):
            check_sm90(spec, graph)
            assert kernels_for(spec, "sm90", graph) == (("prefill_sm90", spec),)
        source = jit.render(spec, "prefill_sm90")
        assert "ROPE = true" in source and f"ROPE_SCALING = {'true' if scaling else 'false'}" in source
        fields = family("prefill_sm90").entry_points(spec)[0].params.names()
        assert list(fields[-2 - len(names):]) == ["rope_rcp_scale", "rope_log2_theta", *names]
    plain = family("prefill_sm90").entry_points(AttentionSpec(128, kv_layout=Ragged()))[0].params.names()
    assert "rope_rcp_scale" not in plain and "ROPE = false" in jit.render(AttentionSpec(128, kv_layout=Ragged()),
                                                                          "prefill_sm90")
    rotated = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(k_rotated=True))
    for extra in ({"kv_dtype": "float8_e4m3fn"}, {"variant": QK_GAIN}):
        (pre_op, pre), (op, kernel) = kernels_for(rotated.replace(**extra), "sm90")
        assert (pre_op, op) == ("rope_gather", "prefill_sm90") and kernel.pos_encoding == rotated.pos_encoding
        projected = family("rope_gather").project(pre)
        assert projected.pos_encoding is None and "ROPE = false" in jit.render(pre, "rope_gather")
        if "variant" in extra:  # the pass runs the k_transform; the kernel the q_transform, before it turns q
            assert projected.variant.q_transform is None and kernel.variant.q_transform is not None
    with pytest.raises(SpecError, match="RoPE over unrotated K on the sm90 backend"):
        check_sm90(rotated.replace(pos_encoding=RoPE()), graph=True)
    with pytest.raises(SpecError, match="turns q alone"):
        jit.render(rotated.replace(pos_encoding=RoPE()), "prefill_sm90")


def test_the_pre_pass_key_holds_the_scaling_kind_not_its_numbers():
    from flashgen.kernels import family

    fam = family("rope_gather")

    def key(rope):
        return fam.uri(fam.project(AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=rope)))

    assert key(RoPE(10000.0, scaling=Llama31Scaling(factor=8.0))) == key(RoPE(5e5, 2.0, Llama31Scaling(factor=32.0)))
    assert len({key(RoPE()), key(RoPE(scaling=Llama31Scaling())), key(RoPE(scaling=YaRNScaling()))}) == 3
    source = jit.render(AttentionSpec(128, kv_layout=Ragged(), pos_encoding=RoPE(scaling=YaRNScaling())), "rope_gather")
    assert "ROPE_SCALING = true" in source and "float rope_mscale;" in source
