"""Where the document mask's time goes on the Hopper prefill: the tile-list pre-pass and the prefill apart.

The ``document_tiled`` example (a mask hook with its tile predicate) runs one launch, its lists written by the
prefill itself; the ``document`` example (the mask hook alone) two, the pre-pass that classifies each work item's
tiles by the hook and writes its tile list (``prefill_sm90_tiles``) and the prefill (``prefill_sm90``). Beside them, on the
same attention (1k-token documents, causal, 32 q / 8 kv heads, d128, bf16, ragged): the built-in ``CustomMask``
with the same mask as host-classified tiles (one launch), the built-in causal mask over each document as a
sequence of its own (the same pairs without a mask: the floor of this attention on this kernel), and the built-in
causal mask over whole sequences. Each
kernel's device time comes from the profiler's CUDA activity (median over the calls); the call's time from CUDA
events (median, no L2 flush: the question is the split, not the absolute).

    PYTHONPATH=$PWD python3 benchmarks/experiments/exp_document_prepass.py --shapes 4x4096,1x16384
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from bench_variants import D, HKV, HQ, example_inputs, flashgen_call, visible_pairs  # noqa: E402
from flashgen import BatchPrefillWrapper  # noqa: E402
from flashgen.spec import AttentionSpec, Causal, CustomMask, Ragged  # noqa: E402
from flashgen.testing.reference import pack_custom_mask  # noqa: E402


def document_masks(batch: int, seqlen: int, doc_len: int) -> list[torch.Tensor]:
    ids = torch.arange(seqlen) // doc_len
    mask = (ids[:, None] == ids[None, :]) & torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    return [mask] * batch


def contenders(batch: int, seqlen: int, doc_len: int, q, k, v) -> dict:
    indptr = np.arange(batch + 1) * seqlen
    out = torch.empty_like(q)
    inputs = example_inputs("document_tiled", batch, seqlen, doc_len, 0)
    calls = {"document_tiled (variant)": flashgen_call("document_tiled", "sm90", q, k, v, batch, seqlen, inputs)}
    calls["document (lists by hook)"] = flashgen_call("document", "sm90", q, k, v, batch, seqlen,
                                                      example_inputs("document", batch, seqlen, doc_len, 0))
    custom = BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=CustomMask()), backend="sm90")
    custom.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV,
                custom_mask=pack_custom_mask(document_masks(batch, seqlen, doc_len)))
    calls["custom mask (host tiles)"] = lambda: custom.run(q, (k, v), out=out)
    causal = BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), backend="sm90")
    causal.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    calls["causal, whole sequences"] = lambda: causal.run(q, (k, v), out=out)
    docs = np.arange(batch * seqlen // doc_len + 1) * doc_len
    varlen = BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), backend="sm90")
    varlen.plan(qo_indptr=docs, kv_indptr=docs, num_qo_heads=HQ, num_kv_heads=HKV)
    calls["causal, documents as seqs"] = lambda: varlen.run(q, (k, v), out=out)
    return calls


def kernel_times(fn, reps: int) -> dict[str, float]:
    """Median device µs of each kernel name over ``reps`` calls (profiler CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name, []).append(event.device_time)
    return {name: statistics.median(us) for name, us in times.items()}


def call_time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4x4096,1x16384")
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(f"{'shape':9} {'contender':26} {'call us':>9} {'TFLOP/s':>8}  kernels (median device us)")
    for shape in args.shapes.split(","):
        batch, seqlen = (int(x) for x in shape.split("x"))
        pairs = batch * visible_pairs("document_tiled", seqlen, args.doc_len, 0)
        q = torch.randn(batch * seqlen, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch * seqlen, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, fn in contenders(batch, seqlen, args.doc_len, q, k, v).items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            us = call_time(fn, args.reps)
            kernels = kernel_times(fn, args.reps)
            visible = pairs if "whole" not in name else batch * seqlen * seqlen / 2
            split = ", ".join(f"{n} {t:.1f}" for n, t in sorted(kernels.items()))
            print(f"{shape:9} {name:26} {us:9.1f} {4 * HQ * D * visible / us / 1e6:8.0f}  {split}", flush=True)


if __name__ == "__main__":
    main()
