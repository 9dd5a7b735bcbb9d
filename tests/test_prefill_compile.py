"""The prefill family compiles with nvcc for sm_80 and sm_90a over a representative matrix, without spills."""

import pytest

from compile_checks import assert_sound_cubin, build_all
from flashgen.spec import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SlidingWindow

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


@pytest.mark.nvcc
def test_prefill_matrix_compiles_without_spills(cache_dir):
    results = build_all([("prefill", spec, arch) for spec, arch in MATRIX], workers=8)
    for (spec, arch), (entry, report) in zip(MATRIX, results):
        assert_sound_cubin(entry, report, ["prefill"], arch)
