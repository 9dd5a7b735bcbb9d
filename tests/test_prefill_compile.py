"""The prefill family compiles with nvcc for sm_80 and sm_90a over a representative matrix, without spills."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashgen import jit
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
    def one(item):
        spec, arch = item
        entry = jit.ensure_compiled(spec, "prefill", arch)
        return entry, (entry.path / "ptxas.log").read_text()

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, MATRIX))
    for (spec, arch), (entry, report) in zip(MATRIX, results):
        assert entry.cubin[:4] == b"\x7fELF", entry.uri
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        assert spills and not any(spills), f"{entry.uri} ({arch}) spills registers: {report}"
        assert entry.manifest["entry_points"] == ["prefill"]
