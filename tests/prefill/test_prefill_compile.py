"""The prefill family compiles with nvcc for sm_80 and sm_90a over a representative matrix, without spills, in
every tile preset of the family option ``tiles``; the preset is part of the uri and the source."""

import pytest

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen.kernels import family
from flashgen.kernels.prefill import PRESETS, PrefillTiles, parse_tiles, prefill_smem_bytes, prefill_stages
from flashgen.spec import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SlidingWindow, SpecError

PREFILL_SPECS = [
    AttentionSpec(128, kv_layout=Ragged(), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(16), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(1, "HND")),
    AttentionSpec(64, kv_layout=Ragged()),
    AttentionSpec(256, kv_layout=Paged(16), mask=Causal()),
    AttentionSpec(192, head_dim_vo=128, kv_layout=Ragged(), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(5), mask=SlidingWindow(64), pos_encoding=RoPE(), soft_cap=30.0),
    AttentionSpec(128, kv_layout=Paged(64), mask=CustomMask(), pos_encoding=ALiBi(), dtype="float16"),
]
MATRIX = [(spec, arch) for arch in ("sm_80", "sm_90a") for spec in PREFILL_SPECS]
for _tiles in sorted(PRESETS):
    prefetch(__name__, [("prefill", spec, arch) for spec, arch in MATRIX], options={"tiles": _tiles})


@pytest.mark.nvcc
@pytest.mark.parametrize("tiles", sorted(PRESETS))
def test_prefill_matrix_compiles_without_spills(shared_cache, tiles):
    results = build_all([("prefill", spec, arch) for spec, arch in MATRIX], workers=8, options={"tiles": tiles})
    for (spec, arch), (entry, report) in zip(MATRIX, results):
        assert_sound_cubin(entry, report, ["prefill"], f"{arch} {tiles}")


def test_tiles_option_changes_uri_and_source():
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal())
    uris, sources = {}, {}
    for tiles in ("kv32", "kv64", "warps=8,rows=16,kv=64,stages=2"):
        uris[tiles] = family("prefill", {"tiles": tiles}).uri(spec)
        sources[tiles] = flashgen.render(spec, "prefill", {"tiles": tiles})
    assert uris["kv32"].endswith("_w4r32kv32s3c2") and uris["kv64"].endswith("_w4r32kv64s2c2")
    assert uris["warps=8,rows=16,kv=64,stages=2"].endswith("_w8r16kv64s2c1")
    assert len(set(uris.values())) == len(set(sources.values())) == 3
    assert "TILE_KV = 64;" in sources["kv64"] and "STAGES = 2;" in sources["kv64"]
    assert family("prefill").uri(spec) == uris["kv64"]  # the default preset
    with pytest.raises(SpecError, match=r"kernel_options: got \['tile'\]"):
        family("prefill", {"tile": "kv32"})
    with pytest.raises(SpecError, match=r"kernel_options\['tiles'\]"):
        family("prefill", {"tiles": "kv128"})
    with pytest.raises(SpecError, match="decode takes .positions."):
        family("decode", {"tiles": "kv32"})


def test_tiles_option_parsing():
    assert parse_tiles("warps=8,rows=16,kv=64,ctas=2", 128) == PrefillTiles(8, 1, 64, None, 2)
    assert parse_tiles("kv64", 256) == parse_tiles("kv32", 256)  # kv64 changes head dims <= 128 only
    for bad in ("kv128", "warps=4,rows=32", "warps=4,rows=24,kv=64", "warps=4,rows=32,kv=128", "warps=4,rows=32,kv=x"):
        with pytest.raises(SpecError, match=r"kernel_options\['tiles'\]"):
            parse_tiles(bad, 128)


def test_kv64_fits_two_ctas_an_sm():
    assert prefill_stages(128, 128, "kv64") == 2
    assert prefill_smem_bytes(128, 128, 2, tiles="kv64") == 32 * 1024 + 2 * 32 * 1024 + 1024


def test_late_copies_for_ragged_d128_without_custom_mask():
    # where the next tile's copies go is decided per spec (kernels/prefill.py: prefill_late_copies)
    def late(spec):
        source = flashgen.render(spec, "prefill")
        assert ("LATE_COPIES = true;" in source) != ("LATE_COPIES = false;" in source)
        return "LATE_COPIES = true;" in source

    assert late(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()))
    assert late(AttentionSpec(128, kv_layout=Ragged(), mask=SlidingWindow(64), pos_encoding=RoPE()))
    assert not late(AttentionSpec(64, kv_layout=Ragged(), mask=Causal()))  # measured at d=128 only
    assert not late(AttentionSpec(128, kv_layout=Paged(16), mask=Causal()))
    assert not late(AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask()))
