"""Every kernel family compiles with nvcc for sm_90a over a representative matrix of specs (no GPU needed)."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashgen import jit
from flashgen.codegen import family
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


@pytest.mark.nvcc
def test_representative_matrix_compiles_for_sm90a(cache_dir):
    def one(item):
        op, spec = item
        entry = jit.ensure_compiled(spec, op, "sm_90a")
        return entry, (entry.path / "ptxas.log").read_text()

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, MATRIX))
    for (op, spec), (entry, report) in zip(MATRIX, results):
        assert entry.cubin[:4] == b"\x7fELF", entry.uri
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        assert spills and not any(spills), f"{entry.uri} spills registers: {report}"
        assert entry.manifest["entry_points"] == [e.name for e in family(op).entry_points(family(op).project(spec))]
