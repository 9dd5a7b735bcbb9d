"""Why does sm90 ragged prefill run below paged16 at 1x16384 (and above it at 4x4096)? One d128 batch (32 q / 8 kv
heads, bf16) timed over the same K/V values laid out five ways: ragged (contiguous [tokens, 8, 128]), ragged
with padded rows ([tokens, 9, 128][:, :8]: same values, another address pattern), page-16 caches in request
order (the same bytes at the same offsets as ragged, read as 16-row boxes instead of one box a tile) and in
random order (bench_prefill's paged16), and pages of 64. Causal and not.

    python3 benchmarks/exp_kv_layout.py [sm90|portable] [BxS ...]
"""
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import page_cache, timed  # noqa: E402
from flashgen import AttentionSpec, Causal, NoMask, Paged, Ragged  # noqa: E402

HQ, HKV, D = 32, 8, 128
backend = sys.argv[1] if len(sys.argv) > 1 else "sm90"
shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[2:] or ["1x16384", "4x4096"])]
gen = torch.Generator().manual_seed(0)
for B, S in shapes:
    q = torch.randn(B * S, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B * S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kpad, vpad = (torch.empty(B * S, HKV + 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kpad[:, :HKV], vpad[:, :HKV] = k, v
    indptr = np.arange(B + 1) * S
    out = torch.empty_like(q)
    for causal in (False, True):
        mask = Causal() if causal else NoMask()
        flops = 4 * B * HQ * D * (S * (S + 1) // 2 if causal else S * S)

        def report(name, us):
            print(f"{backend} {B}x{S} {'causal' if causal else 'none':6} {name:18} {us:8.1f} us "
                  f"{flops / us / 1e6:6.0f} TFLOP/s", flush=True)

        w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=mask), backend=backend)
        w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
        for name, kv in (("ragged", (k, v)), ("ragged-padded", (kpad[:, :HKV], vpad[:, :HKV])), ("ragged", (k, v))):
            report(name, timed(lambda: w.run(q, kv, out=out), 10))
        for page in (16, 64):
            pages = B * S // page
            for order in ("sequential", "random"):
                perm = torch.arange(pages) if order == "sequential" else torch.randperm(pages, generator=gen)
                cache, table = page_cache(k, v, B, S, page, perm)
                w2 = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Paged(page), mask=mask), backend=backend)
                w2.plan(qo_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV, **table)
                report(f"paged{page}-{order}", timed(lambda: w2.run(q, cache, out=out), 10))
                del cache
