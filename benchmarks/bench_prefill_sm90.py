"""Hopper prefill benchmark: flashgen's prefill_sm90 against the portable flashgen prefill (BatchPrefillWrapper
with backend="sm90" and backend="portable"), torch SDPA's cuDNN backend and FlashInfer's FA3 backend, in one run.

bf16, 32 q heads / 8 kv heads, head_dim 128, ragged KV, 16k tokens as 1x16384 and 4x4096, causal and not. Every
timed call follows an L2 flush (benchmarks/timing.py); the median of --reps calls is reported as TFLOP/s
(4·b·h·s²·d, halved for causal). Before timing, each flashgen output is compared with SDPA (max |diff|).

    python3 benchmarks/bench_prefill_sm90.py --out benchmarks/results/prefill_sm90.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import commit, timed  # noqa: E402
from flashgen import AttentionSpec, Causal, NoMask, Ragged  # noqa: E402

HQ, HKV, D, TOKENS = 32, 8, 128, 16384


def sdpa(q, k, v, batch, seqlen, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = (x.view(batch, seqlen, -1, D).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def flashgen_call(backend, q, k, v, batch, seqlen, causal):
    spec = AttentionSpec(D, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
    runner = flashgen.BatchPrefillWrapper(spec, backend=backend)
    indptr = np.arange(batch + 1) * seqlen
    runner.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    out = torch.empty_like(q)
    return lambda: runner.run(q, (k, v), out=out)


def flashinfer_call(q, k, v, batch, seqlen, causal):
    import flashinfer

    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    indptr = (torch.arange(batch + 1, dtype=torch.int32) * seqlen).cuda()
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(indptr, indptr, HQ, HKV, D, causal=causal, q_data_type=torch.bfloat16)
    return lambda: w.run(q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in (1, 4):
        seqlen = TOKENS // batch
        q = torch.randn(TOKENS, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        k, v = (torch.randn(TOKENS, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
        for causal in (False, True):
            flops = 4 * batch * HQ * seqlen * seqlen * D / (2 if causal else 1)
            ref = sdpa(q, k, v, batch, seqlen, causal)
            calls = {"flashgen_sm90": flashgen_call("sm90", q, k, v, batch, seqlen, causal),
                     "flashgen_portable": flashgen_call("portable", q, k, v, batch, seqlen, causal),
                     "sdpa_cudnn": lambda: sdpa(q, k, v, batch, seqlen, causal)}
            try:
                calls["flashinfer_fa3"] = flashinfer_call(q, k, v, batch, seqlen, causal)
            except Exception as exc:  # not installed, or no FA3 build for this GPU
                print(f"flashinfer fa3 skipped: {exc!r}")
            for name, call in calls.items():
                err = float((call().float() - ref.float()).abs().max()) if name.startswith("flashgen") else 0.0
                us = timed(call, args.reps)
                rows.append({"impl": name, "batch": batch, "seqlen": seqlen, "causal": causal, "us": round(us, 1),
                             "tflops": round(flops / us / 1e6, 1), "max_abs_err_vs_sdpa": round(err, 4)})
                print(f"{name:18s} {batch}x{seqlen:<6d} {'causal' if causal else 'full  '} {us:9.1f} us "
                      f"{flops / us / 1e6:7.1f} TFLOP/s  err {err:.4f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"commit": commit(args.commit), "gpu": torch.cuda.get_device_name(),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
