"""The bad-input catalogue: every case is one wrong argument to a public entry point (spec construction, the
wrappers' constructors, plan() and run(), the planner's functions, merge, the command line), the exception type
it must raise and a regex its message must match, which names the argument. On the CPU: CUDA calls are stubbed
and "device" tensors are CPU tensors that say they are CUDA ones (tests/stub_cuda.py), so run() checks its
arguments and launches nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, CustomMask, MergeSpec, Paged, Ragged, RoPE, SlidingWindow, SpecError
from flashgen.plan import (PlanError, csr_to_block_table, plan_block_sparse, plan_cascade, plan_decode,
                           plan_split_kv, validate_csr)
from flashgen.spec import BlockSparse, spec_from_dict

from stub_cuda import on_device, stubbed_cuda

PAGED = AttentionSpec(128, kv_layout=Paged(16))
RAGGED = AttentionSpec(128, kv_layout=Ragged())
CAPPED = AttentionSpec(128, kv_layout=Paged(16), soft_cap=30.0)
WINDOW = AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(64))
MASKED = AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask())
FP8 = AttentionSpec(128, kv_layout=Paged(16), kv_dtype="float8_e4m3fn")
CSR = dict(kv_indptr=[0, 2, 3], kv_indices=[4, 1, 0], kv_last_page_len=[5, 16])  # KV lengths 21, 16
HEADS = dict(num_qo_heads=8, num_kv_heads=2)
DROP = object()  # a plan() argument left out
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def stubbed(monkeypatch):
    with stubbed_cuda():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        yield


def ids(values, dtype=torch.int32):
    """Page ids on the "device"."""
    return on_device(torch.tensor(values, dtype=dtype))


def dev(*shape, dtype=BF16):
    return on_device(torch.zeros(*shape, dtype=dtype))


def misaligned(*shape):
    """A "device" bf16 tensor 2 bytes past a 16-byte boundary."""
    return on_device(torch.zeros(int(np.prod(shape)) + 1, dtype=BF16)[1:].view(*shape))


def cache(pages=5, heads=2, dtype=BF16):
    return dev(pages, 16, heads, 128, dtype=dtype), dev(pages, 16, heads, 128, dtype=dtype)


def _args(base: dict, changes: dict) -> dict:
    args = {**base, **changes}
    return {k: v for k, v in args.items() if v is not DROP}


def decode(spec=PAGED, ctor=None, **changes):
    """A decode wrapper planned with CSR and HEADS, ``changes`` applied (DROP leaves an argument out)."""
    w = flashgen.BatchDecodeWrapper(spec, num_sms=132, **(ctor or {}))
    base = {**CSR, **HEADS} if isinstance(spec.kv_layout, Paged) else {"kv_indptr": [0, 21, 37], **HEADS}
    w.plan(**_args(base, changes))
    return w


def prefill(spec=PAGED, ctor=None, **changes):
    w = flashgen.BatchPrefillWrapper(spec, num_sms=132, backend="portable", **(ctor or {}))
    base = {"qo_indptr": [0, 3, 5], **HEADS}
    base.update(CSR if isinstance(spec.kv_layout, Paged) else {"kv_indptr": [0, 21, 37]})
    w.plan(**_args(base, changes))
    return w


def decode_run(q=None, kv=None, out=None, spec=PAGED):
    w = decode(spec)
    return w.run(dev(2, 8, 128) if q is None else q, cache() if kv is None else kv, out=out)


def prefill_run(q=None, kv=None, out=None):
    w = prefill()
    return w.run(dev(5, 8, 128) if q is None else q, cache() if kv is None else kv, out=out)


def block_table(table, seq_lens, **changes):
    return decode(kv_indptr=DROP, kv_indices=DROP, kv_last_page_len=DROP, block_table=table, seq_lens=seq_lens,
                  **changes)


class ExitCode2(Exception):
    """The command line exited with code 2 (a user error); the message is stderr's last line."""


def cli(tmp_path, *argv, plan_text=None):
    from flashgen.cli import main

    if plan_text is not None:
        (tmp_path / "plan.json").write_text(plan_text)
        argv = (*argv, "--plan", str(tmp_path / "plan.json"))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    lines = err.getvalue().strip().splitlines()
    if code == 2:
        raise ExitCode2(lines[-1])
    return code


NAN, INF = float("nan"), float("inf")

SPEC_CASES = [
    ("head_dim-unknown", lambda: AttentionSpec(100), SpecError, r"^head_dim: got 100"),
    ("head_dim-float", lambda: AttentionSpec(128.0), SpecError, r"^head_dim: got 128.0, expected an int"),
    ("head_dim-bool", lambda: AttentionSpec(True), SpecError, r"^head_dim: got True"),
    ("head_dim_vo-float", lambda: AttentionSpec(128, head_dim_vo=128.0), SpecError, r"^head_dim_vo: got 128.0"),
    ("dtype", lambda: AttentionSpec(128, dtype="float32"), SpecError, r"^dtype: got 'float32'"),
    ("kv_dtype", lambda: AttentionSpec(128, kv_dtype="int8"), SpecError, r"^kv_dtype: got 'int8'"),
    ("kv_layout-string", lambda: AttentionSpec(128, kv_layout="paged"), SpecError, r"^kv_layout: got 'paged'"),
    ("page_size-zero", lambda: AttentionSpec(128, kv_layout=Paged(0)), SpecError, r"^kv_layout.page_size: got 0"),
    ("page_size-float", lambda: AttentionSpec(128, kv_layout=Paged(16.0)), SpecError,
     r"^kv_layout.page_size: got 16.0, expected an int"),
    ("kv_order", lambda: AttentionSpec(128, kv_layout=Paged(16, "NDH")), SpecError, r"^kv_layout.order: got 'NDH'"),
    ("block_q", lambda: AttentionSpec(128, kv_layout=BlockSparse(0, 16)), SpecError, r"^kv_layout.block_q: got 0"),
    ("mask-string", lambda: AttentionSpec(128, mask="causal"), SpecError, r"^mask: got 'causal'"),
    ("window-negative", lambda: AttentionSpec(128, mask=SlidingWindow(-1)), SpecError, r"^mask.left: got -1"),
    ("window-float", lambda: AttentionSpec(128, mask=SlidingWindow(4.0)), SpecError, r"^mask.left: got 4.0"),
    ("rope_theta-inf", lambda: AttentionSpec(128, pos_encoding=RoPE(theta=INF)), SpecError,
     r"^pos_encoding.theta: got inf, expected a finite number > 0"),
    ("rope_theta-nan", lambda: AttentionSpec(128, pos_encoding=RoPE(theta=NAN)), SpecError,
     r"^pos_encoding.theta: got nan"),
    ("rope_scale-zero", lambda: AttentionSpec(128, pos_encoding=RoPE(scale=0)), SpecError,
     r"^pos_encoding.scale: got 0"),
    ("spec-soft_cap-nan", lambda: AttentionSpec(128, soft_cap=NAN), SpecError, r"^soft_cap: got nan"),
    ("spec-sm_scale-negative", lambda: AttentionSpec(128, sm_scale=-1.0), SpecError, r"^sm_scale: got -1.0"),
    ("merge-dtype", lambda: MergeSpec("int8"), SpecError, r"^dtype: got 'int8'"),
    ("dict-type", lambda: spec_from_dict({"type": "Nope"}), SpecError, r"^type: got 'Nope'"),
    ("dict-part", lambda: spec_from_dict({"head_dim": 128, "kv_layout": {"type": "Paged"}}), SpecError,
     r"^kv_layout: .*page_size"),
]

CONSTRUCTOR_CASES = [
    ("num_sms-zero", lambda: flashgen.BatchDecodeWrapper(PAGED, num_sms=0), ValueError, r"^num_sms: got 0"),
    ("num_sms-float", lambda: flashgen.BatchPrefillWrapper(RAGGED, num_sms=2.5), ValueError, r"^num_sms: got 2.5"),
    ("graph-without-capacity", lambda: flashgen.BatchDecodeWrapper(PAGED, use_cuda_graph=True), ValueError,
     r"^max_batch_size: required with use_cuda_graph=True"),
    ("max_batch_size-negative", lambda: flashgen.BatchDecodeWrapper(PAGED, use_cuda_graph=True, max_batch_size=-1),
     ValueError, r"^max_batch_size: got -1"),
    ("graph-without-max_total_q", lambda: flashgen.BatchPrefillWrapper(RAGGED, use_cuda_graph=True, max_batch_size=4),
     ValueError, r"^max_batch_size: max_batch_size and max_total_q are required"),
    ("max_num_pages-zero", lambda: flashgen.BatchDecodeWrapper(PAGED, use_cuda_graph=True, max_batch_size=4,
                                                               max_num_pages=0), ValueError, r"^max_num_pages: got 0"),
    ("check_indices-string", lambda: flashgen.BatchDecodeWrapper(PAGED, check_indices="yes"), ValueError,
     r"^check_indices: got 'yes'"),
    ("backend-unknown", lambda: flashgen.BatchPrefillWrapper(RAGGED, backend="cuda"), ValueError,
     r"^backend: got 'cuda'"),
    ("backend-sm90-elsewhere", lambda: flashgen.BatchPrefillWrapper(RAGGED, backend="sm90"), ValueError,
     r"^backend: 'sm90' needs a GPU of compute capability 9.0"),
    ("kernel_options-unknown", lambda: flashgen.BatchPrefillWrapper(RAGGED, kernel_options={"tiles": "huge"}),
     SpecError, r"tiles"),
    ("decode-fp8-head_dim", lambda: flashgen.BatchDecodeWrapper(AttentionSpec(64, kv_dtype="float8_e4m3fn")),
     SpecError, r"kv_dtype"),
]

PLAN_CASES = [
    # head counts and runtime values
    ("num_kv_heads-zero", lambda: decode(num_kv_heads=0), PlanError, r"^num_kv_heads: got 0, expected an int >= 1"),
    ("num_qo_heads-zero", lambda: prefill(num_qo_heads=0), PlanError, r"^num_qo_heads: got 0"),
    ("num_qo_heads-float", lambda: decode(num_qo_heads=8.0), PlanError, r"^num_qo_heads: got 8.0"),
    ("num_qo_heads-not-a-multiple", lambda: decode(num_qo_heads=7), PlanError,
     r"^num_qo_heads: 7 is not a multiple of num_kv_heads = 2"),
    ("sm_scale-nan", lambda: decode(sm_scale=NAN), PlanError, r"^sm_scale: got nan, expected a finite number > 0"),
    ("sm_scale-inf", lambda: prefill(sm_scale=INF), PlanError, r"^sm_scale: got inf"),
    ("sm_scale-zero", lambda: decode(sm_scale=0.0), PlanError, r"^sm_scale: got 0.0"),
    ("sm_scale-negative", lambda: prefill(sm_scale=-0.5), PlanError, r"^sm_scale: got -0.5"),
    ("sm_scale-string", lambda: decode(sm_scale="0.1"), PlanError, r"^sm_scale: got '0.1'"),
    ("window_left-below-minus-one", lambda: decode(WINDOW, window_left=-2), PlanError,
     r"^window_left: got -2, expected >= -1"),
    ("window_left-float", lambda: prefill(WINDOW, window_left=1.5), PlanError,
     r"^window_left: got 1.5, expected an int"),
    ("window_left-without-window", lambda: decode(window_left=5), PlanError,
     r"^window_left: got 5, but this spec has no sliding window"),
    ("soft_cap-negative", lambda: decode(CAPPED, soft_cap=-1.0), PlanError, r"^soft_cap: got -1.0"),
    ("soft_cap-nan", lambda: prefill(CAPPED, soft_cap=NAN), PlanError, r"^soft_cap: got nan"),
    ("soft_cap-zero-on-a-capped-spec", lambda: decode(CAPPED, soft_cap=0.0), PlanError, r"^soft_cap: got 0.0"),
    ("soft_cap-without-cap", lambda: decode(soft_cap=5.0), PlanError, r"^soft_cap: got 5.0, but this spec has no"),
    ("rope_theta-zero", lambda: decode(rope_theta=0.0), PlanError, r"^rope_theta: got 0.0"),
    ("plan-rope_theta-inf", lambda: prefill(rope_theta=INF), PlanError, r"^rope_theta: got inf"),
    ("rope_scale-nan", lambda: decode(rope_scale=NAN), PlanError, r"^rope_scale: got nan"),
    ("rope_scale-negative", lambda: prefill(rope_scale=-2.0), PlanError, r"^rope_scale: got -2.0"),
    ("k_scale-not-fp8", lambda: decode(k_scale=2.0), PlanError, r"^k_scale: got 2.0; per-tensor scales apply to fp8"),
    ("v_scale-not-fp8", lambda: decode(v_scale=0.5), PlanError, r"^v_scale: got 0.5; per-tensor scales apply to fp8"),
    ("k_scale-nan", lambda: decode(FP8, k_scale=NAN), PlanError, r"^k_scale: got nan"),
    ("v_scale-zero", lambda: decode(FP8, v_scale=0.0), PlanError, r"^v_scale: got 0.0"),
    # page tables
    ("kv_indptr-first", lambda: decode(kv_indptr=[1, 2, 3]), PlanError, r"^kv_indptr\[0\] = 1, expected 0"),
    ("kv_indptr-decreasing", lambda: decode(kv_indptr=[0, 2, 1], kv_last_page_len=[5, 0]), PlanError,
     r"^kv_indptr\[2\] = 1 < kv_indptr\[1\] = 2"),
    ("kv_indptr-empty", lambda: decode(kv_indptr=[]), PlanError, r"^kv_indptr: is empty"),
    ("kv_indptr-on-device", lambda: decode(kv_indptr=ids([0, 2, 3])), PlanError,
     r"^kv_indptr: is a \w+ tensor; planning reads host arrays only"),
    ("kv_indptr-past-kv_indices", lambda: decode(kv_indptr=[0, 2, 4]), PlanError,
     r"^kv_indptr\[-1\] = 4 > len\(kv_indices\) = 3"),
    ("kv_last_page_len-too-long", lambda: decode(kv_last_page_len=[5, 17]), PlanError,
     r"^kv_last_page_len\[1\] = 17, expected 1..16"),
    ("kv_last_page_len-device-ids", lambda: decode(kv_indices=ids([4, 1, 0]), kv_last_page_len=[0, 16]), PlanError,
     r"^kv_last_page_len\[0\] = 0, expected 1..16"),
    ("kv_last_page_len-no-pages", lambda: prefill(kv_indptr=[0, 0, 3], kv_indices=ids([4, 1, 0]),
                                                 kv_last_page_len=[5, 16]), PlanError,
     r"^kv_last_page_len\[0\] = 5, expected 0 \(the request has no pages\)"),
    ("kv_last_page_len-count", lambda: decode(kv_last_page_len=[5]), PlanError,
     r"^kv_last_page_len: has 1 entries, expected batch_size = 2"),
    ("kv_last_page_len-missing", lambda: decode(kv_last_page_len=DROP), PlanError,
     r"^kv_indptr: a paged layout takes kv_indptr, kv_indices and kv_last_page_len"),
    ("kv_indices-float", lambda: decode(kv_indices=[4.0, 1.0, 0.0]), PlanError,
     r"^kv_indices: expected an int32 tensor with 1 dimension\(s\), got torch.float64"),
    ("kv_indices-int64-on-device", lambda: decode(kv_indices=ids([4, 1, 0], torch.int64)), PlanError,
     r"^kv_indices: a device page table must be int32"),
    ("kv_indices-negative", lambda: decode(kv_indices=[4, -1, 0]), PlanError,
     r"^kv_indices\[1\] = -1 is outside the page pool \[0, inf\)"),
    ("kv_indices-past-the-pool", lambda: prefill(num_pages=4), PlanError,
     r"^kv_indices\[0\] = 4 is outside the page pool \[0, 4\)"),
    ("num_pages-string", lambda: decode(num_pages="4"), PlanError, r"^num_pages: got .4."),
    ("num_pages-negative", lambda: decode(num_pages=-1), PlanError, r"^num_pages: got -1, expected None or an int"),
    ("ragged-with-page-ids", lambda: decode(RAGGED, kv_indices=[0]), PlanError,
     r"^kv_indptr: a Ragged layout takes kv_indptr"),
    ("block_table-with-csr", lambda: decode(block_table=[[0]], seq_lens=[3]), PlanError,
     r"^block_table: give block_table with seq_lens, and no CSR arrays"),
    ("block_table-1d", lambda: block_table(ids([0, 1]), [3]), PlanError,
     r"^block_table: expected an int32 tensor with 2 dimension\(s\)"),
    ("block_table-past-the-pool", lambda: block_table([[3, 9], [0, 0]], [20, 16], num_pages=4), PlanError,
     r"^block_table\[0, 1\] = 9 is outside the page pool \[0, 4\)"),
    ("seq_lens-negative", lambda: block_table([[3, 1], [0, 0]], [20, -1]), PlanError, r"^seq_lens\[1\] = -1"),
    ("seq_lens-past-a-device-table", lambda: block_table(ids([[3, 1], [0, 0]]), [33, 1]), PlanError,
     r"^seq_lens\[0\] = 33, expected 0..32 \(block_table's 2 columns of 16 tokens\)"),
    ("seq_lens-count", lambda: block_table(ids([[3, 1], [0, 0]]), [3]), PlanError,
     r"^seq_lens: has 1 entries, expected batch_size = 2"),
    ("graph-batch-past-capacity", lambda: decode(ctor=dict(use_cuda_graph=True, max_batch_size=1)), PlanError,
     r"^kv_indptr: batch_size 2 exceeds max_batch_size = 1"),
    # prefill-only arguments
    ("qo_indptr-count", lambda: prefill(qo_indptr=[0, 3]), PlanError,
     r"^qo_indptr: has 2 entries, expected batch_size \+ 1 = 3"),
    ("qo_indptr-decreasing", lambda: prefill(qo_indptr=[0, 3, 2]), PlanError, r"^qo_indptr\[2\] = 2 < qo_indptr\[1\]"),
    ("qo_indptr-past-max_total_q", lambda: prefill(ctor=dict(use_cuda_graph=True, max_batch_size=4, max_total_q=4)),
     PlanError, r"^qo_indptr\[-1\] = 5 exceeds max_total_q = 4"),
    ("custom_mask-on-another-mask", lambda: prefill(custom_mask=[np.ones((3, 21), bool), np.ones((2, 16), bool)]),
     PlanError, r"^custom_mask: this spec's mask is not CustomMask\(\)"),
    ("custom_mask-missing", lambda: prefill(MASKED), PlanError, r"^custom_mask: required by a CustomMask spec"),
    ("custom_mask-count", lambda: prefill(MASKED, custom_mask=[torch.ones(3, 21, dtype=torch.bool)]), PlanError,
     r"^custom_mask: got 1 masks, expected batch_size = 2"),
    ("custom_mask-shape", lambda: prefill(MASKED, custom_mask=[np.ones((3, 20), bool), np.ones((2, 16), bool)]),
     PlanError, r"^custom_mask\[0\]: shape \(3, 20\), expected \(3, 21\)"),
    ("custom_mask-packed-short", lambda: prefill(MASKED, custom_mask=np.zeros(3, np.uint8)), PlanError,
     r"^custom_mask: expected uint8 \[12\] packed bits"),
]

PLANNER_CASES = [
    ("planner-num_sms-zero", lambda: plan_decode([100], num_qo_heads=8, num_kv_heads=8, num_sms=0), PlanError,
     r"^num_sms: got 0, expected an int >= 1"),
    ("planner-num_sms-float", lambda: plan_split_kv([0, 1], [100], num_qo_heads=8, num_kv_heads=8, num_sms=2.5),
     PlanError, r"^num_sms: got 2.5"),
    ("planner-kv_granularity-zero", lambda: plan_decode([100], num_qo_heads=8, num_kv_heads=8, kv_granularity=0),
     PlanError, r"^kv_granularity: got 0"),
    ("planner-tile_rows-zero", lambda: plan_split_kv([0, 4], [100], num_qo_heads=8, num_kv_heads=8, tile_rows=0),
     PlanError, r"^tile_rows: got 0"),
    ("planner-item_overhead-negative", lambda: plan_decode([1], num_qo_heads=8, num_kv_heads=8, item_overhead=-1),
     PlanError, r"^item_overhead: got -1, expected an int >= 0"),
    ("planner-num_kv_heads-zero", lambda: plan_decode([100], num_qo_heads=8, num_kv_heads=0), PlanError,
     r"^num_kv_heads: got 0"),
    ("planner-kv_lens-negative", lambda: plan_decode([1, -3], num_qo_heads=4, num_kv_heads=4), PlanError,
     r"^kv_lens\[1\] = -3, expected >= 0"),
    ("planner-kv_lens-too-long", lambda: plan_decode([2**30], num_qo_heads=4, num_kv_heads=4), PlanError,
     r"^kv_lens\[0\] = 1073741824, expected < 2\*\*30"),
    ("planner-kv_lens-float", lambda: plan_decode([1.5], num_qo_heads=4, num_kv_heads=4), PlanError,
     r"^kv_lens: dtype float64, expected an integer dtype"),
    ("planner-kv_lens-count", lambda: plan_split_kv([0, 1, 2], [4], num_qo_heads=4, num_kv_heads=4), PlanError,
     r"^kv_lens: has 1 entries, expected batch_size = 2"),
    ("planner-max_batch_size-float", lambda: plan_decode([1], num_qo_heads=4, num_kv_heads=4, max_batch_size=2.5),
     PlanError, r"^max_batch_size: got 2.5"),
    ("planner-capacity-small", lambda: plan_decode([1, 2, 3], num_qo_heads=4, num_kv_heads=4, max_batch_size=8,
                                                   capacity=2), PlanError, r"^capacity: .*more than the capacity of 2"),
    ("planner-cascade-kv_granularity", lambda: plan_cascade([([0, 7], [4096])], num_qo_heads=8, num_kv_heads=2,
                                                            kv_granularity=0), PlanError, r"^kv_granularity: got 0"),
    ("planner-cascade-levels", lambda: plan_cascade([], num_qo_heads=8, num_kv_heads=2), PlanError, r"^levels: empty"),
    ("planner-block_sparse-block_q", lambda: plan_block_sparse([0, 1, 1], [1], block_q=0, block_kv=4, qo_len=8,
                                                               kv_len=8, num_qo_heads=2, num_kv_heads=2), PlanError,
     r"^block_q: got 0, expected an int >= 1"),
    ("planner-block_sparse-num_sms", lambda: plan_block_sparse([0, 1, 1], [1], block_q=4, block_kv=4, qo_len=8,
                                                               kv_len=8, num_qo_heads=2, num_kv_heads=2, num_sms=-1),
     PlanError, r"^num_sms: got -1"),
    ("planner-page_size-zero", lambda: validate_csr([0, 1], [0], [1], page_size=0), PlanError, r"^page_size: got 0"),
    ("csr_to_block_table-max_blocks", lambda: csr_to_block_table([0, 3], [0, 1, 2], [1], 16, max_blocks=2),
     PlanError, r"^kv_indptr: request 0 has 3 pages, more than max_blocks = 2"),
]

RUN_CASES = [
    ("run-before-plan", lambda: flashgen.BatchDecodeWrapper(PAGED, num_sms=132).run(dev(2, 8, 128), cache()),
     RuntimeError, r"^run: call plan\(\) first"),
    ("q-shape", lambda: decode_run(q=dev(3, 8, 128)), ValueError,
     r"^q: expected shape \(2, 8, 128\), got \(3, 8, 128\)"),
    ("q-dims", lambda: decode_run(q=dev(2, 1024)), ValueError, r"^q: expected 3 dimensions"),
    ("q-dtype", lambda: decode_run(q=dev(2, 8, 128, dtype=torch.float16)), TypeError,
     r"^q: expected dtype torch.bfloat16, got torch.float16"),
    ("q-non-contiguous", lambda: decode_run(q=torch.zeros(2, 128, 8, dtype=BF16).transpose(1, 2)), ValueError,
     r"^q: expected a contiguous tensor"),
    ("q-device", lambda: decode_run(q=torch.zeros(2, 8, 128, dtype=BF16, device="meta")), ValueError,
     r"^q: expected a tensor on cpu, got one on meta"),
    ("q-not-a-tensor", lambda: decode_run(q=[[0.0] * 128] * 8), TypeError, r"^q: expected a torch.Tensor, got list"),
    ("q-misaligned", lambda: prefill_run(q=misaligned(5, 8, 128)), ValueError,
     r"^q: expected data aligned to 16 bytes"),
    ("out-shape", lambda: decode_run(out=dev(2, 8, 64)), ValueError, r"^out: expected shape \(2, 8, 128\)"),
    ("out-dtype", lambda: prefill_run(out=dev(5, 8, 128, dtype=torch.float32)), TypeError, r"^out: expected dtype"),
    ("kv_cache-heads", lambda: decode_run(kv=cache(heads=4)), ValueError,
     r"^kv_cache \(k\): expected shape \[pages, 16, 2, 128\] \(NHD\), got \(5, 16, 4, 128\)"),
    ("kv_cache-dtype", lambda: prefill_run(kv=cache(dtype=torch.float16)), TypeError,
     r"^kv_cache \(k\): expected dtype torch.bfloat16 \(spec.kv_dtype\), got torch.float16"),
    ("kv_cache-three-tensors", lambda: decode_run(kv=(*cache(), dev(5, 16, 2, 128))), ValueError,
     r"^kv_cache: expected a \(k, v\) pair, got 3 tensors"),
    ("kv_cache-one-tensor-shape", lambda: decode_run(kv=dev(5, 3, 16, 2, 128)), ValueError,
     r"^kv_cache: expected \[pages, 2, \.\.\.\] \(5 dims\), got shape \(5, 3, 16, 2, 128\)"),
    ("kv_cache-on-the-host", lambda: decode_run(kv=(torch.zeros(5, 16, 2, 128, dtype=BF16),) * 2), ValueError,
     r"^kv_cache \(k\): expected a CUDA tensor"),
    ("kv_cache-strides-differ", lambda: decode_run(kv=(dev(5, 16, 2, 128),
                                                       on_device(torch.zeros(5, 16, 4, 128, dtype=BF16)[:, :, :2]))),
     ValueError, r"^kv_cache: k and v must share strides"),
    ("kv_cache-strided-rows", lambda: decode_run(kv=(on_device(torch.zeros(5, 16, 2, 256, dtype=BF16)[..., ::2]),) * 2),
     ValueError, r"^kv_cache \(k\): rows must be contiguous"),
    ("kv_cache-too-few-pages", lambda: decode_run(kv=cache(pages=4)), ValueError,
     r"^kv_indices: page id 4 is outside kv_cache's 4 pages"),
    ("kv_cache-too-few-tokens", lambda: decode_run(spec=RAGGED, kv=(dev(30, 2, 128), dev(30, 2, 128))), ValueError,
     r"^kv_cache: 30 tokens, fewer than kv_indptr\[-1\] = 37"),
    ("kv_cache-ragged-one-tensor", lambda: decode_run(spec=RAGGED, kv=dev(37, 2, 2, 128)), ValueError,
     r"^kv_cache: expected a \(k, v\) pair for a Ragged layout"),
    ("attention-q-on-the-host", lambda: flashgen.attention(torch.zeros(4, 8, 128, dtype=BF16), dev(4, 2, 128),
                                                          dev(4, 2, 128)), ValueError, r"^q: expected a CUDA tensor"),
    ("attention-k-dims", lambda: flashgen.attention(dev(4, 8, 128), dev(4, 256), dev(4, 2, 128)), ValueError,
     r"^k: expected 3 dimensions"),
    ("attention-sm_scale", lambda: flashgen.attention(dev(4, 8, 128), dev(4, 2, 128), dev(4, 2, 128), sm_scale=NAN),
     PlanError, r"^sm_scale: got nan"),
    ("attention-window_left", lambda: flashgen.attention(dev(4, 8, 128), dev(4, 2, 128), dev(4, 2, 128),
                                                        window_left=3), PlanError, r"^window_left: got 3, but"),
    ("attention-paged-spec", lambda: flashgen.attention(dev(4, 8, 128), dev(4, 2, 128), dev(4, 2, 128), PAGED),
     ValueError, r"^spec: attention\(\) takes a Ragged\(\) kv_layout"),
]

MERGE_CASES = [
    ("merge-v_a-on-the-host", lambda: flashgen.merge_state(torch.zeros(4, 2, 64), dev(4, 2, dtype=torch.float32),
                                                           dev(4, 2, 64, dtype=torch.float32),
                                                           dev(4, 2, dtype=torch.float32)),
     ValueError, r"^v_a: expected a CUDA tensor"),
    ("merge-v_a-dims", lambda: flashgen.merge_state(dev(4, 128), dev(4, 2, dtype=torch.float32), dev(4, 128),
                                                    dev(4, 2, dtype=torch.float32)), ValueError,
     r"^v_a: expected 3 dimensions"),
    ("merge-v_a-dtype", lambda: flashgen.merge_state(dev(4, 2, 64, dtype=torch.int32), dev(4, 2, dtype=torch.float32),
                                                     dev(4, 2, 64, dtype=torch.int32), dev(4, 2, dtype=torch.float32)),
     TypeError, r"^v_a: expected dtype"),
    ("merge-v_b-shape", lambda: flashgen.merge_state(dev(4, 2, 64), dev(4, 2, dtype=torch.float32), dev(4, 3, 64),
                                                     dev(4, 2, dtype=torch.float32)), ValueError,
     r"^v_b: expected shape \(4, 2, 64\), got \(4, 3, 64\)"),
    ("merge-v_b-dtype", lambda: flashgen.merge_state(dev(4, 2, 64), dev(4, 2, dtype=torch.float32),
                                                     dev(4, 2, 64, dtype=torch.float16),
                                                     dev(4, 2, dtype=torch.float32)),
     TypeError, r"^v_b: expected dtype torch.bfloat16"),
    ("merge-s_a-dtype", lambda: flashgen.merge_state(dev(4, 2, 64), dev(4, 2), dev(4, 2, 64),
                                                     dev(4, 2, dtype=torch.float32)), TypeError,
     r"^s_a: expected dtype torch.float32"),
    ("merge-s_b-shape", lambda: flashgen.merge_state(dev(4, 2, 64), dev(4, 2, dtype=torch.float32), dev(4, 2, 64),
                                                     dev(4, 3, dtype=torch.float32)), ValueError,
     r"^s_b: expected shape \(4, 2\), got \(4, 3\)"),
    ("merge-head_dim", lambda: flashgen.merge_state(dev(4, 2, 4), dev(4, 2, dtype=torch.float32), dev(4, 2, 4),
                                                    dev(4, 2, dtype=torch.float32)), ValueError,
     r"^head_dim: expected a multiple of 8 for torch.bfloat16"),
    ("merge-v_a-misaligned", lambda: flashgen.merge_state(misaligned(4, 2, 64),
                                                          dev(4, 2, dtype=torch.float32), dev(4, 2, 64),
                                                          dev(4, 2, dtype=torch.float32)), ValueError,
     r"^v_a: expected data aligned to 16 bytes"),
    ("merge_states-v-dims", lambda: flashgen.merge_states(dev(4, 2, 64), dev(4, 2, dtype=torch.float32)), ValueError,
     r"^v: expected 4 dimensions"),
    ("merge_states-s-shape", lambda: flashgen.merge_states(dev(4, 3, 2, 64), dev(4, 2, 2, dtype=torch.float32)),
     ValueError, r"^s: expected shape \(4, 3, 2\), got \(4, 2, 2\)"),
    ("merge_in_place-mask-shape", lambda: flashgen.merge_state_in_place(
        dev(4, 2, 64), dev(4, 2, dtype=torch.float32), dev(4, 2, 64), dev(4, 2, dtype=torch.float32),
        mask=dev(5, dtype=torch.bool)), ValueError, r"^mask: expected shape \(4,\), got \(5,\)"),
]

CLI_CASES = [
    ("cli-jobs-zero", lambda t: cli(t, "build", "--arch", "sm_80", "-j", "0"), ExitCode2,
     r"^flashgen build: error: argument -j/--jobs: got '0', expected an int >= 1"),
    ("cli-plan-not-json", lambda t: cli(t, "build", "--arch", "sm_80", plan_text="[{"), ExitCode2,
     r"^flashgen build: error: --plan \S+: not valid JSON"),
    ("cli-plan-an-object", lambda t: cli(t, "build", "--arch", "sm_80", plan_text='{"op": "decode"}'), ExitCode2,
     r"^flashgen build: error: --plan \S+: got a JSON object, expected a JSON list"),
    ("cli-plan-item-without-spec", lambda t: cli(t, "build", "--arch", "sm_80", plan_text='[{"op": "decode"}]'),
     ExitCode2, r"^flashgen build: error: --plan \S+: item 0: got \{\"op\": \"decode\"\}"),
    ("cli-plan-unknown-op", lambda t: cli(t, "build", "--arch", "sm_80", plan_text='[{"op": "x", "spec": {}}]'),
     ExitCode2, r"^flashgen build: error: --plan \S+: item 0: op 'x', expected one of"),
    ("cli-plan-bad-spec", lambda t: cli(t, "build", "--arch", "sm_80",
                                        plan_text='[{"op": "decode", "spec": {"head_dim": 127}}]'), ExitCode2,
     r"^flashgen build: error: --plan \S+: item 0: spec: head_dim: got 127"),
    ("cli-plan-missing", lambda t: cli(t, "build", "--arch", "sm_80", "--plan", str(t / "none.json")), ExitCode2,
     r"^flashgen build: error: --plan \S+none.json: cannot read it"),
    ("cli-cache-action", lambda t: cli(t, "cache", "prune"), ExitCode2,
     r"^flashgen cache: error: argument action: invalid choice: 'prune'"),
]

CASES = SPEC_CASES + CONSTRUCTOR_CASES + PLAN_CASES + PLANNER_CASES + RUN_CASES + MERGE_CASES


def test_the_catalogue_is_large_and_its_ids_distinct():
    names = [c[0] for c in CASES + CLI_CASES]
    assert len(names) == len(set(names)) and len(names) >= 60


@pytest.mark.parametrize("make, exc, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


@pytest.mark.parametrize("make, exc, message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_is_named(tmp_path, monkeypatch, make, exc, message):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(exc, match=message):
        make(tmp_path)


def test_good_inputs_pass():
    """The baselines the cases above change one argument of: each plans (and runs) without an error."""
    decode_run()
    prefill_run()
    decode_run(spec=RAGGED, kv=(dev(37, 2, 128), dev(37, 2, 128)))
    flashgen.attention(dev(4, 8, 128), dev(4, 2, 128), dev(4, 2, 128), causal=True)
    block_table(ids([[3, 1], [0, 0]]), [20, 16])
    prefill(MASKED, custom_mask=[np.ones((3, 21), bool), np.ones((2, 16), bool)])
    decode(WINDOW, window_left=-1)
    decode(FP8, k_scale=0.5, v_scale=2.0)
    flashgen.merge_state_in_place(dev(4, 2, 64), dev(4, 2, dtype=torch.float32), dev(4, 2, 64),
                                  dev(4, 2, dtype=torch.float32), mask=dev(4, dtype=torch.bool))
