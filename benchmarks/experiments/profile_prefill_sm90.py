"""One prefill call of flashgen's sm90 kernel and (if importable) FlashInfer's FA3 backend on the same ragged
batch, for a profiler. bf16, 32 q / 8 kv heads, d=128.

    ncu --set full --clock-control none -k regex:'prefill_sm90|Prefill' -c 2 -o $OUT/sm90 \\
        python3 benchmarks/experiments/profile_prefill_sm90.py --batch 4 --seqlen 4096 --mask causal
    ncu --import $OUT/sm90.ncu-rep --page details --csv > $OUT/sm90.csv   # tensor pipe, issue, stall reasons
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # benchmarks/, the repository
import flashgen  # noqa: E402
from flashgen import AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, SlidingWindow  # noqa: E402
from flashgen.testing.masks import doc_mask  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--mask", choices=("none", "causal", "window", "doc"), default="causal",
                        help="doc: --docs causal documents a sequence, as a custom bit mask (FlashInfer is then skipped)")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--backend", choices=("sm90", "portable"), default="sm90",
                        help="flashgen's kernel: the Hopper one, or the portable mma.sync one (ncu -k regex:prefill)")
    parser.add_argument("--page-size", type=int, default=0, help="0: ragged KV; else a paged cache of shuffled pages "
                        "(FlashInfer is then skipped)")
    args = parser.parse_args()
    total = args.batch * args.seqlen
    q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = {"none": NoMask(), "causal": Causal(), "window": SlidingWindow(args.window), "doc": CustomMask()}[args.mask]
    custom = None
    if args.mask == "doc":
        custom = [doc_mask(args.seqlen, args.seqlen, args.docs)] * args.batch
    indptr = np.arange(args.batch + 1, dtype=np.int32) * args.seqlen
    if args.page_size:
        ps = args.page_size
        pages_per = -(-args.seqlen // ps)
        ids = torch.randperm(args.batch * pages_per, dtype=torch.int32)
        cache = torch.randn(ids.numel(), 2, ps, HKV, D, device="cuda", dtype=torch.bfloat16)
        wrapper = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Paged(ps), mask=mask), backend=args.backend)
        wrapper.plan(qo_indptr=indptr, kv_indptr=np.arange(args.batch + 1, dtype=np.int32) * pages_per,
                     kv_indices=ids.cuda(), kv_last_page_len=np.full(args.batch, args.seqlen - (pages_per - 1) * ps),
                     num_qo_heads=HQ, num_kv_heads=HKV)
        for _ in range(2):
            wrapper.run(q, cache)
        torch.cuda.synchronize()
        return
    wrapper = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=mask), backend=args.backend)
    wrapper.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV, custom_mask=custom)
    for _ in range(2):
        wrapper.run(q, (k, v))
    if custom is not None:
        torch.cuda.synchronize()
        return
    try:
        import flashinfer

        fi = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(2**28, dtype=torch.uint8, device="cuda"), "NHD",
                                                             backend="fa3" if args.backend == "sm90" else "fa2")
        window = args.window if args.mask == "window" else -1
        fi.plan(torch.from_numpy(indptr).cuda(), torch.from_numpy(indptr).cuda(), HQ, HKV, D,
                causal=args.mask != "none", window_left=window, q_data_type=torch.bfloat16)
        for _ in range(2):
            fi.run(q, k, v)
    except Exception as exc:  # noqa: BLE001  (not installed, or no FA3 build here)
        print(f"flashinfer skipped: {exc!r}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
