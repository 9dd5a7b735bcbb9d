"""A variant's mask on the Hopper prefill (CPU and compile-only): the kernel takes tile lists exactly where
``sm90_tile_lists`` says, written by its own list warp under a tile predicate and by a pre-pass entry where the mask
hook classifies (``sm90_tile_prepass``); plan() sizes the lists' buffer from the plan's items and run() launches
the pre-pass, where there is one, ahead of the prefill with the same params; the shipped predicates agree with
their masks; both compile for sm_90a without spills. The GPU checks are in test_variants_sm90_tiles.py."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import numpy as np
import pytest
import torch

import flashgen
from flashgen.api import sm90
from compile_checks import build_all, prefetch
from flashgen.kernels import TILE_HOOK_THREADS, family, sm90_tile_heads, sm90_tile_lists, sm90_tile_prepass
from flashgen.plan import PlanError
from flashgen.plan.mask_tiles import tile_list_indptr
from flashgen.spec import (AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, SlidingWindow, SpecError,
                           spec_from_dict, spec_to_dict)
from flashgen.spec.variant import hook_names
from flashgen.testing.variants import tile_class
from flashgen.variants.examples import EXAMPLES
from stub_cuda import on_device, stubbed_cuda

DOC, DOC_CUDA = EXAMPLES["document_tiled"]
PREFIX, PREFIX_CUDA = EXAMPLES["prefix_lm"]
HEADS = dict(num_qo_heads=8, num_kv_heads=2)
DOC_OFF = dataclasses.replace(EXAMPLES["document"][0], classify_tiles=False)
HEAD_MASK = flashgen.Variant(mask="return (qo_head + kv_idx) % 3 != 0;")


def test_the_prefix_lm_tile_predicate_agrees_with_its_mask():
    """examples.PREFIX_LM: on random tiles and prefixes, EMPTY hides every pair, FULL keeps every one."""
    g = torch.Generator().manual_seed(5)
    seen = set()
    for _ in range(400):
        q0, k0, prefix = (int(x) for x in torch.randint(0, 200, (3,), generator=g))
        q1, k1 = q0 + int(torch.randint(1, 40, (1,), generator=g)), k0 + int(torch.randint(1, 40, (1,), generator=g))
        seen.add(tile_class(PREFIX, q0, q1, k0, k1, {"prefix_len": torch.tensor([prefix])}))
    assert seen == {0, 1, 2}


@pytest.mark.parametrize("spec,options,lists", [
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC), None, True),
    (AttentionSpec(128, kv_layout=Paged(16), mask=NoMask(), variant=PREFIX_CUDA), None, True),
    (AttentionSpec(64, kv_layout=Paged(5), mask=SlidingWindow(40), variant=DOC_CUDA), None, True),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC), {"positions": True}, False),
    (AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask(), variant=DOC), None, False),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=EXAMPLES["document"][0]), None, True),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC_OFF), None, False),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=EXAMPLES["alibi"][0]), None, False),
    (AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), None, False),
])
def test_the_lists_and_their_pre_pass_are_rendered_exactly_where_they_apply(spec, options, lists):
    """Lists where sm90_tile_lists says; the pre-pass entry only for a mask hook without a predicate (a predicate's
    lists are the kernel's list warp's)."""
    fam = family("prefill_sm90", options)
    source = fam.render(spec)
    assert sm90_tile_lists(spec, bool(options)) is lists
    prepass = lists and spec.variant.mask_tile is None
    assert sm90_tile_prepass(spec, bool(options)) is prepass
    assert f"static constexpr bool TILE_LIST = {'true' if lists else 'false'};" in source
    assert ("prefill_sm90_tiles" in source) is prepass
    names = [e.name for e in fam.entry_points(fam.project(spec))]
    assert names == (["prefill_sm90", "prefill_sm90_tiles"] if prepass else ["prefill_sm90"])


def test_tile_list_indptr_gives_each_item_its_range_and_a_count():
    indptr = tile_list_indptr(np.array([0, 0, 0, 128]), np.array([300, 128, 0, 257]), 128)
    assert indptr.dtype == np.int32 and indptr.tolist() == [0, 4, 6, 7, 10]
    with pytest.raises(PlanError, match="kv lengths: the tile lists need"):
        tile_list_indptr(np.zeros(3, np.int64), np.full(3, 2**40), 128)


class _Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def set_max_dynamic_shared_memory(self, nbytes):
        pass

    def launch_params(self, grid, block, smem, stream, address):
        self.calls.append((self.name, grid, block, address))


@pytest.fixture
def hopper():
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
        yield


def _wrapper(spec, **kwargs):
    w = flashgen.BatchPrefillWrapper(spec, backend="sm90", num_sms=132, **kwargs)
    assert w.backend == "sm90"
    return w


def _plan(w, qo_lens, kv_lens):
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    w.plan(qo_indptr=qo, kv_indptr=kv, **HEADS)
    return int(qo[-1]), int(kv[-1])


@pytest.mark.parametrize("variant", [DOC, EXAMPLES["document"][0]], ids=["predicate", "hook"])
def test_plan_sizes_the_lists_and_run_launches_the_pre_pass_first(hopper, variant):
    """Both kinds of lists get their buffer at plan(); the mask hook's pre-pass runs first, with the prefill's
    params, a CTA an item; a predicate's lists need no launch of their own."""
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=variant)
    w = _wrapper(spec)
    total_q, total_kv = _plan(w, [1, 300, 40], [5, 1000, 40])
    impl = w._impl
    plan = impl.last_plan
    indptr = tile_list_indptr(plan.numpy("kv_start"), plan.numpy("kv_end"), 128)
    assert indptr.size == plan.info.capacity + 1
    fields = impl._params.values()
    assert fields["tiles"] == impl._tile_buffer.address != 0
    assert impl._tile_buffer.numel >= HEADS["num_kv_heads"] * int(indptr[-1])
    assert fields["tile_indptr"] != 0 and fields["custom_mask"] == 0
    calls = []
    impl._load()  # the fake kernels, replaced by recorders
    prepass = variant.mask_tile is None
    assert (impl._tiles_fn is not None) is prepass
    impl._fn = _Recorder("prefill", calls)
    if prepass:
        impl._tiles_fn = _Recorder("tiles", calls)
    no_map = lambda *args: bytes(128)  # noqa: E731 - tensor maps need the driver
    with mock.patch.object(sm90, "kv_tensor_map", no_map), mock.patch.object(sm90, "qo_tensor_map", no_map):
        w.run(on_device(torch.zeros(total_q, 8, 128, dtype=torch.bfloat16)),
              (on_device(torch.zeros(total_kv, 2, 128, dtype=torch.bfloat16)),) * 2, doc_ids=torch.zeros(1040).int())
    if not prepass:
        assert [c[0] for c in calls] == ["prefill"]
        return
    assert [c[0] for c in calls] == ["tiles", "prefill"]
    assert calls[0][3] == calls[1][3]  # one params struct
    assert calls[0][2] == (TILE_HOOK_THREADS, 1, 1)
    assert calls[0][1] == (plan.info.capacity, 1, 1)  # a CTA an item, its list written for every kv head


@pytest.mark.parametrize("variant,per_head", [(EXAMPLES["document"][0], False), (EXAMPLES["document"][1], False),
                                               (HEAD_MASK, True), (DOC, True)])
def test_a_mask_hook_alone_gets_lists_one_cta_an_item_unless_it_names_a_head(hopper, variant, per_head):
    """By the mask hook a pre-pass CTA of TILE_HOOK_THREADS a work item (kv head 0's alone unless the hook names a
    head); by a tile predicate (given the heads) the kernel's list warp, each kv head's list."""
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=variant)
    assert sm90_tile_heads(spec) is per_head
    source = family("prefill_sm90").render(spec)
    w = _wrapper(spec)
    _plan(w, [3, 300], [3, 400])
    impl = w._impl
    assert impl.tile_lists and impl._params.values()["tiles"] == impl._tile_buffer.address != 0
    if variant.mask_tile is not None:
        assert "prefill_sm90_tiles" not in source
        return
    assert f"plan_tiles<PrefillSM90Config, {'true' if per_head else 'false'}>(p)" in source
    assert f"__launch_bounds__({TILE_HOOK_THREADS}) prefill_sm90_tiles" in source
    items = impl.last_plan.info.capacity * (HEADS["num_kv_heads"] if per_head else 1)
    assert impl._tiles_block == (TILE_HOOK_THREADS, 1, 1) and impl._tiles_grid == (items, 1, 1)


def test_classify_tiles_off_gives_no_lists_and_its_own_key(hopper):
    w = _wrapper(AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC_OFF))
    _plan(w, [3, 40], [3, 400])
    assert w._impl._tiles_fn is None and w._impl._params.values()["tiles"] == 0
    on = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=EXAMPLES["document"][0])
    assert DOC_OFF.uri != on.variant.uri and DOC_OFF != on.variant


def test_classify_tiles_is_checked_and_keeps_the_default_digest():
    mask = "return doc_ids[qo_idx] == doc_ids[kv_idx];"
    tensors = [("doc_ids", "int32", 1)]
    default = flashgen.Variant(mask=mask, tensors=tensors)
    assert default.canonical().keys() == {"hooks", "tensors", "scalars", "softmax"}  # digests as before the field
    assert default == flashgen.Variant(mask=mask, tensors=tensors, classify_tiles=True)
    off = flashgen.Variant(mask=mask, tensors=tensors, classify_tiles=False)
    assert off.canonical()["classify_tiles"] is False and off.digest != default.digest
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=off)
    assert spec_from_dict(spec_to_dict(spec)) == spec
    with pytest.raises(SpecError, match=r"variant.classify_tiles: got 1, expected True or False"):
        flashgen.Variant(mask=mask, tensors=tensors, classify_tiles=1)
    with pytest.raises(SpecError, match="variant.classify_tiles: False .* mask hook without mask_tile only"):
        flashgen.Variant(score="return logit;", classify_tiles=False)
    with pytest.raises(SpecError, match="variant.classify_tiles: False .* mask hook without mask_tile only"):
        dataclasses.replace(DOC, classify_tiles=False)


def test_which_inputs_a_mask_names():
    """Names in comments, strings and member accesses are not uses; a preprocessor line makes every input one."""
    assert hook_names("// qo_head\nreturn p.kv_head + x->qo_head < 3; /* kv_head */") == {"return", "p", "x"}
    assert {"qo_head", "kv_head"} <= hook_names("#define H qo_ ## head\nreturn H > 0;")
    v = flashgen.Variant(mask="int head = qo_head; return head != 1;")
    assert v.uses("mask", "qo_head") and not v.uses("mask", "kv_head") and not v.uses("score", "logit")
    traced = flashgen.Variant(mask=lambda h, q_idx, kv_idx: (h + kv_idx) % 2 == 0)
    assert traced.uses("mask", "qo_head") and not traced.uses("mask", "kv_head")


def test_a_cuda_graph_wrapper_keeps_its_lists_in_place_and_names_the_limit(hopper):
    w = _wrapper(AttentionSpec(128, kv_layout=Ragged(), mask=NoMask(), variant=PREFIX), use_cuda_graph=True,
                 max_batch_size=4, max_total_q=600)
    _plan(w, [300, 200], [300, 2000])
    address = w._impl._params.values()["tiles"]
    _plan(w, [5, 1, 1], [5, 1, 700])  # fewer tiles: the same buffer
    assert w._impl._params.values()["tiles"] == address
    with pytest.raises(PlanError, match=r"tile lists: needs \d+ elements.*most KV tiles"):
        _plan(w, [300, 300], [4000, 4000])


# ---------------------------------------------------------------------------------------------- compile

COMPILE = [("prefill_sm90", spec, "sm_90a") for spec in (
    AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), variant=DOC),  # the list warp beside TMA Q
    AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), variant=DOC_CUDA),
    AttentionSpec(128, kv_layout=Paged(48), mask=NoMask(), variant=PREFIX_CUDA),
    AttentionSpec(64, kv_layout=Ragged(), mask=SlidingWindow(100), variant=DOC_CUDA),
    AttentionSpec(64, kv_layout=Paged(5), mask=Causal(), variant=DOC),  # gathered pages
    AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), variant=EXAMPLES["document"][0]),  # by the mask hook
    AttentionSpec(64, kv_layout=Paged(5), mask=SlidingWindow(40), variant=EXAMPLES["document"][1]),
    AttentionSpec(128, kv_layout=Ragged(), mask=NoMask(), variant=HEAD_MASK),  # per kv head
)]  # not d256: there the Hopper kernel's variants spill with or without lists (document 96 / 132 bytes unlisted,
# document_tiled 76 / 80 listed, prefix-LM 28 / 28 at nvcc 13.0); docs/performance.md, Variants
prefetch(__name__, COMPILE)


@pytest.mark.nvcc
def test_the_pre_pass_and_the_listed_prefill_compile_without_spills(shared_cache):
    for (_, spec, _), (entry, report) in zip(COMPILE, build_all(COMPILE)):
        prepass = spec.variant.mask_tile is None
        assert ("prefill_sm90_tiles" in report) is prepass, entry.uri
        for function in ("prefill_sm90_tiles", "prefill_sm90") if prepass else ("prefill_sm90",):
            part = report.split(f"Function properties for {function}\n", 1)[1]
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", part.split("Compile time")[0])]
            assert spills == [0, 0], f"{entry.uri} {function}: {report}"
        if spec.variant.mask_tile is None:  # 4 CTAs of the mask hook's pre-pass an SM at least: 32 warps in flight
            part = report.split("Function properties for prefill_sm90_tiles\n", 1)[1]
            registers = int(re.search(r"Used (\d+) registers", part).group(1))
            assert registers * TILE_HOOK_THREADS * 4 <= 65536, f"{entry.uri}: {registers} registers"


def test_tile_class_names_a_predicate_that_disagrees_with_its_mask():
    """flashgen.testing.variants.tile_class: a predicate that calls every tile FULL is caught on a partial one."""
    always_full = flashgen.Variant(mask=lambda qo_idx, kv_idx: kv_idx <= qo_idx,
                                   mask_tile=lambda qo_begin, qo_end, kv_begin, kv_end: 2)
    assert tile_class(always_full, 10, 20, 0, 5, {}) == 2
    with pytest.raises(AssertionError, match=r"FULL for q \[10, 20\) x kv \[5, 15\)"):
        tile_class(always_full, 10, 20, 5, 15, {})
