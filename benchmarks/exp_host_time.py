"""Host time of the wrappers on a GPU machine: ``plan()`` (the planner, its checks and the upload of the plan) and
``run()`` (the launch), for decode and prefill, flashgen against FlashInfer in the same process
(its indptr arrays handed over on the host, as its plan() wants them).

Per configuration: ``plan()`` called 41 times on one wrapper, the median of the last 40 (the first allocates the
wrapper's buffers); ``run()`` called 200 times back to back after a warm-up and a sync, the host time a call (the
GPU runs behind; 200 launches do not fill the launch queue). Decode: page 16, KV 4096 tokens a request. Prefill:
ragged, causal, 512 query and KV tokens a request. bf16, d128, 32 q / 8 kv heads.

    python3 benchmarks/exp_host_time.py [--batches-decode 1,16,64,256] [--batches-prefill 1,4,16,64] [--out host.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, Causal, Paged, Ragged  # noqa: E402

HQ, HKV, D, PAGE, KV_DECODE, SEQ = 32, 8, 128, 16, 4096, 512


def host_times(plan, run) -> tuple[float, float]:
    times = []
    for _ in range(41):
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    plan_us = float(np.median(times[1:]))
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        run()
    run_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    return plan_us, run_us


def decode_table(batch: int):
    pages_per = KV_DECODE // PAGE
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(batch * pages_per).to(torch.int32)
    last = torch.full((batch,), PAGE, dtype=torch.int32)
    return indptr, indices, last


def decode(batch: int, peer: str):
    indptr, indices, last = decode_table(batch)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(batch * KV_DECODE // PAGE, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    if peer == "flashgen":
        w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(PAGE)))
        gi = indices.cuda()
        out = torch.empty_like(q)
        return host_times(lambda: w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=gi,
                                         kv_last_page_len=last),
                          lambda: w.run(q, cache, out=out))
    import flashinfer

    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    gi = indices.cuda()  # indptr and last page lengths stay on the host (FlashInfer plans from host copies)
    return host_times(lambda: w.plan(indptr, gi, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16),
                      lambda: w.run(q, cache))


def prefill(batch: int, peer: str):
    indptr = np.arange(batch + 1) * SEQ
    q = torch.randn(batch * SEQ, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch * SEQ, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if peer.startswith("flashgen"):
        w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), backend=peer[9:])
        out = torch.empty_like(q)
        return host_times(lambda: w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV),
                          lambda: w.run(q, (k, v), out=out))
    import flashinfer

    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")
    gi = torch.from_numpy(indptr).to(torch.int32)  # on the host, as FlashInfer's plan wants them
    return host_times(lambda: w.plan(gi, gi, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16),
                      lambda: w.run(q, k, v))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches-decode", default="1,16,64,256")
    parser.add_argument("--batches-prefill", default="1,4,16,64")
    parser.add_argument("--peers", default="flashinfer")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    hopper = torch.cuda.get_device_capability() == (9, 0)
    rows = []
    for kind, batches, who in (("decode", args.batches_decode, ["flashgen"] + peers),
                               ("prefill", args.batches_prefill,
                                ["flashgen-portable"] + (["flashgen-sm90"] if hopper else []) + peers)):
        for batch in (int(b) for b in batches.split(",")):
            for peer in who:
                try:
                    plan_us, run_us = (decode if kind == "decode" else prefill)(batch, peer)
                except Exception as exc:  # noqa: BLE001 - a peer failing is reported, never fatal
                    print(f"{kind} {batch} {peer} failed: {exc!r}"[:300], flush=True)
                    continue
                rows.append({"kind": kind, "batch": batch, "peer": peer, "plan_us": plan_us, "run_host_us": run_us})
                print(f"{kind:7} B={batch:4} {peer:17} plan {plan_us:8.1f} us  run {run_us:6.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
