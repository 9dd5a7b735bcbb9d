"""The ``positions`` option of the Hopper prefill and its RoPE pre-pass: uri, params and refusals on the CPU,
the kernels compiled for sm_90a (nvcc, no GPU; ragged, TMA pages and gathered pages, causal / window / RoPE /
ALiBi), and what ``BatchPrefillWrapper(backend="sm90")`` packs at plan()."""

from __future__ import annotations

import re
from unittest import mock

import numpy as np
import pytest
import torch

import flashgen
from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import ALiBi, AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from flashgen.api.backends import kernels_for
from flashgen.kernels import family
from flashgen.kernels.prefill_sm90 import sm90_gather
from stub_cuda import stubbed_cuda

POS = {"positions": True}
MATRIX = [  # (spec, whether its kernels must not spill)
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), True),
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal()), True),
    (AttentionSpec(128, kv_layout=Paged(256, "HND"), mask=SlidingWindow(100), pos_encoding=ALiBi()), True),
    (AttentionSpec(64, dtype="float16", kv_layout=Paged(64), mask=SlidingWindow(9), pos_encoding=ALiBi()), True),
    (AttentionSpec(256, kv_layout=Ragged(), mask=Causal(), soft_cap=20.0), False),  # O in 128 registers: 20 bytes
    (AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE()), True),  # pre-pass + ragged
    (AttentionSpec(128, kv_layout=Ragged(), mask=SlidingWindow(64), pos_encoding=RoPE()), True),
    (AttentionSpec(128, kv_layout=Ragged(), pos_encoding=ALiBi()), False),  # a position read a key: 24 bytes
    # gathered pages (the consumers keep 224 registers) and head_dim 256 spill a few bytes with positions: bounded
    (AttentionSpec(128, kv_layout=Paged(1), mask=Causal()), False),
    (AttentionSpec(128, kv_layout=Paged(24), mask=Causal(), pos_encoding=ALiBi(), soft_cap=20.0), False),
]
JOBS = [(op, s, "sm_90a") for spec, _ in MATRIX for op, s in kernels_for(spec, "sm90")]
prefetch(__name__, JOBS, POS)


@pytest.mark.nvcc
def test_sm90_kernels_with_positions_compile_for_sm90a(shared_cache):
    results = iter(build_all(JOBS, options=POS))
    for spec, no_spill in MATRIX:
        for op, kernel_spec in kernels_for(spec, "sm90"):
            entry, report = next(results)
            fam = family(op, POS)
            names = [e.name for e in fam.entry_points(fam.project(kernel_spec))]
            if no_spill:
                assert_sound_cubin(entry, report, names, f"{spec.uri} positions")
            else:
                assert entry.cubin[:4] == b"\x7fELF" and entry.manifest["entry_points"] == names
                stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
                assert max(stores) <= 128, report  # the state at this commit: a bound, not a goal


def test_the_option_names_the_kernels_and_adds_their_params():
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal())
    plain, pos = family("prefill_sm90"), family("prefill_sm90", POS)
    assert pos.uri(spec) == plain.uri(spec) + "_pos" and pos.options == (("positions", "true"),)
    names = [f.name for f in pos.entry_points(spec)[0].params.fields]
    assert names[-2:] == ["kv_page_pos", "q_pos"]
    assert names[:-2] == [f.name for f in plain.entry_points(spec)[0].params.fields]
    assert "POSITIONS = true" in pos.render(spec) and "POSITIONS = false" in plain.render(spec)
    rope = AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())
    gather, gather_pos = family("rope_gather"), family("rope_gather", POS)
    assert gather_pos.uri(rope) == gather.uri(rope) + "_pos"
    names = [f.name for f in gather_pos.entry_points(gather_pos.project(rope))[0].params.fields]
    assert names[-3:] == ["kv_page_pos", "q_pos", "kv_pos_out"]
    assert names[:-3] == [f.name for f in gather.entry_points(gather.project(rope))[0].params.fields]


def test_refusals_name_the_option():
    with pytest.raises(SpecError, match=r"^kernel_options\['positions'\]: got 1, expected True or False"):
        family("prefill_sm90", {"positions": 1})
    with pytest.raises(SpecError, match=r"^kernel_options: got \['tiles'\], prefill_sm90 takes 'positions'"):
        family("prefill_sm90", {"tiles": "kv32"})
    with pytest.raises(SpecError, match=r"^kernel_options: got \['tiles'\], rope_gather takes 'positions'"):
        family("rope_gather", {"tiles": "kv32"})
    with pytest.raises(SpecError, match=r"^mask: CustomMask\(\) takes no explicit positions"):
        family("prefill_sm90", POS).check(AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask()))
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)):
        with pytest.raises(ValueError, match=r"^kernel_options: the sm90 backend takes only 'positions'"):
            flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged()), backend="sm90",
                                         kernel_options={"positions": True, "tiles": "kv32"})


TABLE = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[3, 4])


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("spec", [AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi()),
                                  AttentionSpec(128, kv_layout=Paged(5), mask=SlidingWindow(4))],
                         ids=["tma", "gathered"])
def test_auto_picks_sm90_and_plan_packs_the_positions(spec, graph):
    assert sm90_gather(spec.kv_layout.page_size, 128) == (spec.kv_layout.page_size == 5)
    capacity = dict(use_cuda_graph=True, max_batch_size=4, max_total_q=16, max_num_pages=8) if graph else {}
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)):
        wrapper = flashgen.BatchPrefillWrapper(spec, kernel_options=POS, **capacity)
        assert wrapper.backend == "sm90" and wrapper._impl.positions
        places = []
        for qo, table, pos in (([0, 3, 5], TABLE, [0, 16, 7]),
                               ([0, 1], dict(kv_indptr=[0, 1], kv_indices=[2], kv_last_page_len=[2]), [3])):
            wrapper.plan(qo_indptr=qo, **table, num_qo_heads=4, num_kv_heads=2, kv_page_pos=pos,
                         q_pos=np.arange(qo[-1]) + 40)
            values = wrapper._impl._params.values()
            assert values["kv_page_pos"] and values["q_pos"]
            places.append((values["kv_page_pos"], values["q_pos"], values["kv_indices"]))
        if graph:  # fixed places, so that a captured graph reads the next plan's arrays
            assert places[0] == places[1]


def test_a_position_free_wrapper_keeps_the_plain_kernel():
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)):
        wrapper = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), mask=NoMask()))
        assert wrapper.backend == "sm90" and not wrapper._impl.positions and wrapper._impl._options is None
