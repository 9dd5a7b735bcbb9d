"""Every kernel family compiles with nvcc for sm_90a over a representative matrix of specs (no GPU needed)."""

import pytest

from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen.kernels import family
from flashgen.spec import ALiBi, AttentionSpec, MergeSpec, Paged, Ragged, RoPE, SlidingWindow

DECODE_SPECS = [
    AttentionSpec(128, kv_layout=Paged(16)),
    AttentionSpec(128, kv_layout=Paged(1, "HND")),
    AttentionSpec(128, kv_layout=Paged(17), pos_encoding=RoPE(), soft_cap=30.0, mask=SlidingWindow(128)),
    AttentionSpec(128, kv_layout=Paged(256), pos_encoding=ALiBi(), dtype="float16"),
    AttentionSpec(64, kv_layout=Paged(3)),
    AttentionSpec(256, kv_layout=Paged(64, "HND")),
    AttentionSpec(128, kv_layout=Ragged()),
    AttentionSpec(128, kv_dtype="float8_e4m3fn", kv_layout=Paged(16)),
    AttentionSpec(256, dtype="float16", kv_dtype="float8_e5m2", kv_layout=Paged(3, "HND")),
]
MATRIX = [("decode", s) for s in DECODE_SPECS] + [("merge_states", MergeSpec(d)) for d in ("f16", "bf16", "f32")]
prefetch(__name__, [(op, spec, "sm_90a") for op, spec in MATRIX])


@pytest.mark.nvcc
def test_representative_matrix_compiles_for_sm90a(shared_cache):
    results = build_all([(op, spec, "sm_90a") for op, spec in MATRIX])
    for (op, spec), (entry, report) in zip(MATRIX, results):
        names = [e.name for e in family(op).entry_points(family(op).project(spec))]
        assert_sound_cubin(entry, report, names)
