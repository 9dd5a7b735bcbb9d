"""AppendSpec (validation, uri, serialisation), rendering of the append family, and its compile matrix with nvcc
for sm_90a and sm_80 (no GPU needed)."""

import pytest

from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import AppendSpec, Llama31Scaling, Paged, SpecError, render
from flashgen.kernels import family, launch_config, rows_per_block
from flashgen.spec import spec_from_dict, spec_to_dict

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
# every option at least once: page sizes 1/16/17/256, NHD/HND, rope none/theta/table, bf16/fp16 -> same or fp8,
# per-tensor/per-head scales, CSR/slots, int32/int64 indices, head dims 64..256
MATRIX = [
    AppendSpec(128, "bfloat16", None, Paged(16)),
    AppendSpec(128, "bfloat16", None, Paged(1, "HND"), rope="rope", page_table="slot_mapping", index_dtype="int64"),
    AppendSpec(128, "float16", None, Paged(17), rope="cos_sin_cache"),
    AppendSpec(128, "bfloat16", E4M3, Paged(256, "HND"), rope="rope", scales="per_head"),
    AppendSpec(128, "float16", E5M2, Paged(16), page_table="slot_mapping"),
    AppendSpec(64, "bfloat16", E4M3, Paged(17, "HND"), rope="cos_sin_cache", scales="per_head",
               page_table="slot_mapping", index_dtype="int64"),
    AppendSpec(256, "bfloat16", None, Paged(16, "HND"), rope="rope"),
    AppendSpec(192, "float16", E4M3, Paged(1), rope="rope", index_dtype="int64"),
]
ARCHS = ("sm_90a", "sm_80")
prefetch(__name__, [("append", spec, arch) for arch in ARCHS for spec in MATRIX])


def test_spec_uri_names_every_choice_and_round_trips():
    spec = AppendSpec(128, "bf16", "e4m3", Paged(17, "HND"), rope="rope", scales="per_head",
                      page_table="slot_mapping", index_dtype="torch.int64")
    assert spec.uri == "d128_bf16_kve4m3_paged17hnd_rope_hscale_slots_i64"
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert AppendSpec(128).uri == "d128_bf16_kvbf16_paged16nhd_norope_tscale_csr_i32"
    uris = {s.uri for s in MATRIX}
    assert len(uris) == len(MATRIX)


@pytest.mark.parametrize("kwargs,field", [
    (dict(head_dim=96), "head_dim"), (dict(head_dim=128.0), "head_dim"), (dict(dtype="float32"), "dtype"),
    (dict(kv_dtype="float16"), "kv_dtype"), (dict(kv_layout=Paged(0)), "page_size"),
    (dict(kv_layout=Paged(16, "HDN")), "order"), (dict(rope="yarn"), "rope"), (dict(scales="per_token"), "scales"),
    (dict(scales="per_head"), "scales"), (dict(page_table="block_table"), "page_table"),
    (dict(index_dtype="int16"), "index_dtype"),
])
def test_bad_specs_name_their_field(kwargs, field):
    with pytest.raises(SpecError, match=field):
        AppendSpec(**{"head_dim": 128, **kwargs})


@pytest.mark.parametrize("kwargs,field", [(dict(factor=0.0), "factor"), (dict(low_freq_factor=4.0), "high_freq"),
                                          (dict(original_max_position=float("inf")), "original_max_position")])
def test_bad_llama31_scaling_names_its_field(kwargs, field):
    with pytest.raises(SpecError, match=field):
        Llama31Scaling(**kwargs)


def test_render_declares_the_variant():
    spec = AppendSpec(128, "bfloat16", E4M3, Paged(17, "HND"), rope="rope", scales="per_head",
                      page_table="slot_mapping", index_dtype="int64")
    source = render(spec, "append")
    for line in ("using DTypeKV = __nv_fp8_e4m3;", "using IdType = int64_t;", "PAGE_SIZE = 17;", "ELEMS = 16;",
                 "THREADS_PER_ROW = 4;", "PER_HEAD_SCALE = true;", "SLOT_MAPPING = true;", "ROPE_COS_SIN = false;",
                 'extern "C" __global__'):
        assert line in source, line
    assert "ELEMS = 8;" in render(AppendSpec(128), "append")
    assert rows_per_block(spec) == launch_config(spec, "append").threads // 4
    with pytest.raises(TypeError, match="AppendSpec"):
        family("append").project(object())


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_matrix_compiles(shared_cache, arch):
    results = build_all([("append", spec, arch) for spec in MATRIX])
    for spec, (entry, report) in zip(MATRIX, results):
        if arch == "sm_90a":
            assert_sound_cubin(entry, report, ["append_kv"], spec.uri)
        else:  # sincosf's slow path (huge angles) keeps a few bytes of stack on sm_80; no other spill
            assert entry.cubin[:4] == b"\x7fELF" and entry.manifest["entry_points"] == ["append_kv"]
