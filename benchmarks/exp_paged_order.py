"""Does page order change the portable prefill's speed? The same 4x4096 d128 batch (32 q / 8 kv heads, bf16) as
ragged K/V, as a page-16 cache in request order, and as a page-16 cache in random order (bench_prefill's
paged16), causal and not, one backend (portable or sm90).

    python3 benchmarks/exp_paged_order.py [portable|sm90]
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

B, S, HQ, HKV, D, PAGE = 4, 4096, 32, 8, 128, 16
backend = sys.argv[1] if len(sys.argv) > 1 else "portable"
gen = torch.Generator().manual_seed(0)
q = torch.randn(B * S, HQ, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B * S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
indptr = np.arange(B + 1) * S
pages = B * S // PAGE
for causal in (False, True):
    mask = Causal() if causal else NoMask()
    flops = 4 * B * HQ * D * (S * (S + 1) // 2 if causal else S * S)
    out = torch.empty_like(q)
    w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=mask), backend=backend)
    w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    us = timed(lambda: w.run(q, (k, v), out=out), 20)
    print(f"{backend} {'causal' if causal else 'none':6} ragged          {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
    for order in ("sequential", "random"):
        perm = torch.arange(pages) if order == "sequential" else torch.randperm(pages, generator=gen)
        kv, table = page_cache(k, v, B, S, PAGE, perm)
        w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Paged(PAGE), mask=mask), backend=backend)
        w.plan(qo_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV, **table)
        us = timed(lambda: w.run(q, kv, out=out), 20)
        print(f"{backend} {'causal' if causal else 'none':6} paged16 {order:10} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s",
              flush=True)
