"""Params structs packed by name: the names are checked, every value lands at its field's offset (a round trip
through struct.unpack), run-time fields are written in place, and each backend's plan() gives its kernel
every plan-time field by name (with the CUDA calls stubbed: no GPU needed)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import flashgen
from flashgen.plan import plan_decode
from flashgen.kernels import Param, ParamsLayout, family, launch_config
from flashgen.spec import AttentionSpec, Causal, CustomMask, MergeSpec, Paged, Ragged, RoPE

from stub_cuda import stubbed_cuda

RUNTIME = ("q", "k", "v", "o", "lse", "stride_page", "stride_token", "stride_head")
SPECS = {
    "decode": AttentionSpec(128, kv_layout=Paged(16)),
    "prefill": AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask()),
    "prefill_sm90": AttentionSpec(128, kv_layout=Paged(5), mask=Causal()),  # gathered: K/V by address
    "rope_gather": AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE()),
}


def _value(param: Param, i: int):
    kind = param.kind
    if kind == "CUtensorMap":
        return bytes([i % 251 + 1]) * 128
    if kind == "float":
        return float(i) + 0.5
    return 1000 * i + 7 if kind == "ptr" else i + 3


@pytest.mark.parametrize("op", sorted(SPECS))
def test_pack_by_name_round_trips(op):
    (entry,) = family(op).entry_points(family(op).project(SPECS[op]))
    layout = entry.params
    names = layout.names()
    runtime = tuple(n for n in names if n in RUNTIME) if op != "prefill_sm90" else names[: names.index("lse") + 1]
    bound = layout.bind(runtime)
    values = {p.name: _value(p, i) for i, p in enumerate(layout.fields)}
    bound.pack({n: v for n, v in values.items() if n not in runtime})
    bound.set(*(values[n] for n in runtime))
    unpacked = struct.unpack(layout.format, bytes(bound.buffer)[: layout.size])
    assert dict(zip(names, unpacked)) == values == bound.values()
    for param, offset in zip(layout.fields, layout.offsets):  # each value at its own offset
        code = {"CUtensorMap": "128s", "float": "f"}.get(param.kind, "i" if param.kind == "int32_t" else None)
        if code:
            assert struct.unpack_from("<" + code, bytes(bound.buffer), offset)[0] == values[param.name]


def test_names_are_checked():
    layout = ParamsLayout.of("P", (Param("q", "const float*"), Param("a", "int32_t"), Param("b", "float")))
    bound = layout.bind(("q",))
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        bound.pack({"a": 1, "c": 2.0})
    with pytest.raises(ValueError, match=r"unexpected \['q'\]"):
        bound.pack({"a": 1, "b": 2.0, "q": 5})
    with pytest.raises(ValueError, match="not fields of the struct"):
        layout.bind(("x",))
    with pytest.raises(ValueError, match="declaration order"):
        layout.bind(("b", "q"))
    with pytest.raises(ValueError, match="a="):
        bound.pack({"a": 2**40, "b": 1.0})  # a value that does not fit its field names it
    bound.pack({"a": -1, "b": 2.0})
    bound.set(77)
    assert bound.values() == {"q": 77, "a": -1, "b": 2.0}


def test_run_time_writes_leave_the_plan_fields():
    (entry,) = family("decode").entry_points(SPECS["decode"])
    bound = entry.params.bind(RUNTIME)
    plan = {n: i + 1 for i, n in enumerate(entry.params.names()) if n not in RUNTIME}
    bound.pack(plan)
    for step in range(3):
        bound.set(*range(10 * step, 10 * step + len(RUNTIME)))
        got = bound.values()
        assert {n: got[n] for n in plan} == plan
        assert [got[n] for n in RUNTIME] == list(range(10 * step, 10 * step + len(RUNTIME)))


def test_launch_configs():
    decode = launch_config(SPECS["decode"], "decode")
    assert decode.block == (128, 1, 1) and decode.tile_q == 16 and decode.tile_kv == 64 and decode.ctas_per_sm == 2
    assert launch_config(AttentionSpec(128, kv_layout=Ragged()), "prefill").tile_kv == 64
    kv32 = launch_config(AttentionSpec(128, kv_layout=Ragged()), "prefill", {"tiles": "kv32"})
    assert (kv32.tile_q, kv32.tile_kv, kv32.stages) == (128, 32, 3)
    sm90 = launch_config(SPECS["prefill_sm90"], "prefill_sm90")
    assert sm90.block == (384, 1, 1) and sm90.gather and not sm90.o_staged and sm90.tile_q == 128
    assert launch_config(MergeSpec("float32"), "merge_states").block == (256, 1, 1)


def _fields(wrapper) -> dict:
    return wrapper._impl._params.values()


def _planned_arrays(wrapper) -> dict:
    """Device-buffer (here CPU) contents at the plan's field addresses."""
    buf = wrapper._core.plan_buffer.tensor
    return buf, buf.data_ptr()


def test_decode_plan_fills_every_field_by_name():
    with stubbed_cuda():
        w = flashgen.BatchDecodeWrapper(SPECS["decode"], num_sms=132)
        w.plan(kv_indptr=[0, 2, 5], kv_indices=[4, 1, 0, 3, 2], kv_last_page_len=[5, 16], num_qo_heads=32,
               num_kv_heads=8, sm_scale=0.25, window_left=None)
        got = _fields(w)
        buf, base = _planned_arrays(w)
        at = lambda name, n: buf[(got[name] - base) // 4:][:n].tolist()  # noqa: E731
        assert at("kv_indptr", 3) == [0, 2, 5] and at("kv_indices", 5) == [4, 1, 0, 3, 2]
        assert got["block_table"] == 0 and got["block_table_stride"] == 0
        assert got["num_qo_heads"] == 32 and got["group_size"] == 4 and got["sm_scale"] == 0.25
        assert got["v_scale"] == 1.0 and got["counters"] == w._core._counters.data_ptr()
        plan_lens = at("kv_len", 2)
        assert plan_lens == [21, 48]  # (pages - 1) * 16 + last
        assert all(got[n] == 0 for n in RUNTIME)  # written at run()


def test_prefill_plans_fill_every_field_by_name():
    with stubbed_cuda(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        for backend, spec in (("portable", AttentionSpec(128, kv_layout=Ragged(), mask=Causal())),
                              ("sm90", AttentionSpec(128, kv_layout=Ragged(), mask=Causal()))):
            w = flashgen.BatchPrefillWrapper(spec, num_sms=132, backend=backend)
            w.plan(qo_indptr=[0, 100, 612], kv_indptr=[0, 100, 612], num_qo_heads=32, num_kv_heads=8)
            got = _fields(w)
            buf, base = _planned_arrays(w)
            at = lambda name, n: buf[(got[name] - base) // 4:][:n].tolist()  # noqa: E731
            assert at("kv_indptr", 3) == [0, 100, 612] and at("qo_indptr", 3) == [0, 100, 612]
            assert got["num_qo_heads"] == 32 and got["group_size"] == 4 and got["window_left"] == 0
            assert got["kv_indices"] == got["block_table"] == 0
            if backend == "sm90":
                assert got["q_tma"] == 1 and got["num_kv_heads"] == 8 and got["custom_mask"] == 0
            else:
                assert got["tiles"] == 0 and got["counters"] == w._core._counters.data_ptr()


def test_wrappers_pass_split_policy_to_the_planner():
    from flashgen.plan import SplitPolicy

    forced = SplitPolicy(candidates=lambda max_len, work, num_kv_heads, num_sms, granularity: [1024])
    with stubbed_cuda():
        w = flashgen.BatchDecodeWrapper(SPECS["decode"], num_sms=132)
        kw = dict(kv_indptr=[0, 600], kv_indices=list(range(600)), kv_last_page_len=[16], num_qo_heads=32,
                  num_kv_heads=8)
        chunks = []
        for policy in (None, forced):  # 9600 tokens: split by default; with only 1024 on offer, not split
            w.plan(**kw, split_policy=policy)
            buf, base = _planned_arrays(w)
            chunks.append(int(buf[(_fields(w)["num_chunks"] - base) // 4]))
        cfg = w._impl._launch
        slots = 132 * cfg.ctas_per_sm
        expect = [int(plan_decode([9600], num_qo_heads=32, num_kv_heads=8, tile_rows=cfg.tile_q,
                                  kv_granularity=cfg.tile_kv, num_sms=slots, split_policy=p).numpy("num_chunks")[0])
                  for p in (None, forced)]
        assert chunks == expect and expect[0] > 1 and expect[1] == 1
        p = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged()), num_sms=132, backend="portable")
        p.plan(qo_indptr=[0, 64], kv_indptr=[0, 8192], num_qo_heads=32, num_kv_heads=8, split_policy=forced)
        assert p._impl.last_plan.info.kv_chunk == 1024
