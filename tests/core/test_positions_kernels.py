"""The ``positions`` kernel option (explicit key and query positions): its uri, params and refusals on the CPU,
the decode and portable prefill kernels compiled with it for sm_90a (nvcc, no GPU), and the wrappers' checks of
``kv_page_pos`` / ``q_pos`` at plan()."""

from __future__ import annotations

import numpy as np
import pytest

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import ALiBi, AttentionSpec, Causal, CustomMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from flashgen.kernels import family
from flashgen.plan import PlanError
from stub_cuda import stubbed_cuda

POS = {"positions": True}
MATRIX = [
    ("decode", AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE(), mask=SlidingWindow(64))),
    ("decode", AttentionSpec(128, kv_layout=Paged(5), pos_encoding=ALiBi(), soft_cap=30.0)),
    ("decode", AttentionSpec(64, kv_layout=Ragged(), mask=SlidingWindow(8))),
    ("prefill", AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE())),
    ("prefill", AttentionSpec(128, kv_layout=Paged(7), mask=SlidingWindow(32), pos_encoding=ALiBi(), soft_cap=9.0)),
    ("prefill", AttentionSpec(64, dtype="float16", kv_layout=Paged(1), mask=Causal())),
    ("prefill", AttentionSpec(256, kv_layout=Ragged(), pos_encoding=RoPE())),
]
prefetch(__name__, [(op, spec, "sm_90a") for op, spec in MATRIX], POS)


@pytest.mark.nvcc
def test_kernels_with_positions_compile_for_sm90a(shared_cache):
    results = build_all([(op, spec, "sm_90a") for op, spec in MATRIX], options=POS)
    for (op, spec), (entry, report) in zip(MATRIX, results):
        fam = family(op, POS)
        assert_sound_cubin(entry, report, [e.name for e in fam.entry_points(fam.project(spec))])


@pytest.mark.parametrize("op", ["decode", "prefill", "prefill_sm90"])
def test_the_option_names_its_kernel_and_adds_the_position_params(op):
    spec = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=ALiBi() if op == "prefill_sm90" else RoPE())
    plain, pos = family(op), family(op, POS)
    assert pos.uri(spec) == plain.uri(spec) + "_pos" and pos.options == (("positions", "true"),)
    names = [f.name for f in pos.entry_points(spec)[0].params.fields]
    assert names[-2:] == ["kv_page_pos", "q_pos"]
    assert names[:-2] == [f.name for f in plain.entry_points(spec)[0].params.fields]
    assert "POSITIONS = true" in pos.render(spec) and "POSITIONS = false" in plain.render(spec)
    assert family(op, {"positions": False}).uri(spec) == plain.uri(spec)


def test_bad_options_are_refused():
    with pytest.raises(SpecError, match=r"^kernel_options\['positions'\]: got 'yes', expected True or False"):
        family("decode", {"positions": "yes"})
    with pytest.raises(SpecError, match=r"^kernel_options: got \['tiles'\], decode takes 'positions'"):
        family("decode", {"tiles": "kv32"})
    with pytest.raises(SpecError, match=r"^mask: CustomMask\(\) takes no explicit positions"):
        family("prefill", POS).check(AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask()))
    with pytest.raises(SpecError, match=r"^backend: 'sm90' cannot run this spec \(mask: CustomMask\(\) takes no "
                                        r"explicit positions"):
        flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask()), backend="sm90",
                                     kernel_options=POS)


TABLE = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[3, 16])


def test_decode_plan_uploads_the_positions():
    spec = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())
    with stubbed_cuda():
        wrapper = flashgen.BatchDecodeWrapper(spec, kernel_options=POS)
        wrapper.plan(**TABLE, num_qo_heads=4, num_kv_heads=2, kv_page_pos=[0, 32, 100], q_pos=[40, 115])
        values = wrapper._impl._params.values()
        assert values["kv_page_pos"] and values["q_pos"]
        with pytest.raises(PlanError, match=r"^kv_page_pos: a wrapper built with kernel_options"):
            wrapper.plan(**TABLE, num_qo_heads=4, num_kv_heads=2)
        with pytest.raises(PlanError, match=r"^q_pos: has 3 entries, expected the total query count = 2"):
            wrapper.plan(**TABLE, num_qo_heads=4, num_kv_heads=2, kv_page_pos=[0, 16, 0], q_pos=[1, 2, 3])
        with pytest.raises(PlanError, match=r"^kv_page_pos\[1\] = -16, expected a position in \[0, 2\*\*30\)"):
            wrapper.plan(**TABLE, num_qo_heads=4, num_kv_heads=2, kv_page_pos=[0, -16, 0], q_pos=[1, 2])
        with pytest.raises(PlanError, match=r"^kv_page_pos: has 2 entries, expected at least kv_indptr\[-1\] = 3"):
            wrapper.plan(**TABLE, num_qo_heads=4, num_kv_heads=2, kv_page_pos=[0, 16], q_pos=[1, 2])
        plain = flashgen.BatchDecodeWrapper(spec)
        with pytest.raises(PlanError, match=r"^q_pos: explicit positions need a wrapper built with"):
            plain.plan(**TABLE, num_qo_heads=4, num_kv_heads=2, q_pos=[1, 2])


def test_graph_mode_pads_the_positions_to_fixed_places():
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi())
    with stubbed_cuda():
        wrapper = flashgen.BatchPrefillWrapper(spec, kernel_options=POS, use_cuda_graph=True, max_batch_size=4,
                                               max_total_q=16, max_num_pages=8)
        places = []
        for qo, table, pos in (([0, 3, 5], TABLE, [0, 16, 7]), ([0, 1], dict(kv_indptr=[0, 1], kv_indices=[2],
                                                                               kv_last_page_len=[5]), [3])):
            wrapper.plan(qo_indptr=qo, **table, num_qo_heads=4, num_kv_heads=2, kv_page_pos=pos,
                         q_pos=np.arange(qo[-1]))
            values = wrapper._impl._params.values()
            places.append((values["kv_page_pos"], values["q_pos"], values["kv_indices"]))
        assert places[0] == places[1]
        with pytest.raises(PlanError, match=r"^kv_page_pos: 9 entries, more than the 8 this CUDA-graph wrapper keeps"):
            wrapper.plan(qo_indptr=[0, 1], kv_indptr=[0, 9], kv_indices=list(range(9)), kv_last_page_len=[1],
                         num_qo_heads=4, num_kv_heads=2, kv_page_pos=np.arange(9) * 16, q_pos=[0])
