"""Document masks by document length: where the sm90 kernel's effective rate comes from, against the peers that run
the same attention as variable-length causal sequences.

4 x 4096 tokens (bf16, d128, 32 q / 8 kv heads), each sequence cut into causal documents of L tokens. Rows, timed
round-robin in one process (the median of --reps calls after an L2 flush, as bench_prefill.py):
- flashgen-sm90 doc:  the document mask as a custom bit mask over the 4 sequences (what bench_prefill's ``doc``
  row times, there with L = 512 at 4x4096);
- flashgen-sm90 varlen: the same attention as 4 * 4096 / L ragged causal sequences of L tokens;
- flashinfer-fa3 varlen, sdpa-cudnn (a batch of 4 * 4096 / L causal sequences), flex doc (its document mask).
Effective TFLOP/s count the visible pairs (4 x d x pairs x q heads).

    python3 benchmarks/experiments/exp_doc_length.py [--lengths 256,512,1024,2048,4096] [--reps 10] [--out docs.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # benchmarks/, the repository
import bench_prefill as bp  # noqa: E402
from timing import timed_interleaved  # noqa: E402

B, S, D = 4, 4096, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--peers", default="flashinfer-fa3,sdpa-cudnn,flex")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    peers = set(args.peers.split(",")) if args.peers else set()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B * S, bp.HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B * S, bp.HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        docs = S // length
        bp.DOCS = docs  # bench_prefill's doc mask (flashgen and Flex) and its pair count read this
        pairs = B * docs * length * (length + 1) / 2
        flops = 4 * D * bp.HQ * pairs
        seqs = B * docs
        calls = [("flashgen-sm90 doc", bp.bench_flashgen(q, k, v, B, S, D, "ragged", "doc", gen, "sm90")),
                 ("flashgen-sm90 varlen", bp.bench_flashgen(q, k, v, seqs, length, D, "ragged", "causal", gen, "sm90"))]
        if "flashinfer-fa3" in peers:
            calls.append(("flashinfer-fa3 varlen",
                          bp.bench_flashinfer(q, k, v, seqs, length, D, "ragged", "causal", gen, "fa3")))
        if "sdpa-cudnn" in peers:
            calls.append(("sdpa-cudnn batch", bp.bench_sdpa(q, k, v, seqs, length, D, True, "cudnn")))
        if "flex" in peers:
            calls.append(("flex doc", bp.bench_flex(q, k, v, B, S, D, "doc")[0]))
        for _, fn in calls:
            fn()
        torch.cuda.synchronize()
        times = timed_interleaved([fn for _, fn in calls], args.reps)
        line = [f"L={length:5}"]
        for (name, _), us in zip(calls, times):
            tf = flops / us / 1e6
            rows.append({"doc_len": length, "peer": name, "us": us, "TFLOPs": tf})
            line.append(f"{name} {tf:5.0f}")
        print(" | ".join(line), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    names = list(dict.fromkeys(r["peer"] for r in rows))
    print("| doc length | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for length in sorted({r["doc_len"] for r in rows}):
        cells = [next((f"{r['TFLOPs']:.0f}" for r in rows if r["doc_len"] == length and r["peer"] == n), "-")
                 for n in names]
        print(f"| {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
