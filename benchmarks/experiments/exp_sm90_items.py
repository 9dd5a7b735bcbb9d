"""The sm90 kernel's per-item cost: ragged 4x4096, d128, 32 q / 8 kv heads, timed under masks whose items (32
tokens x 4 heads of one kv head) visit 1-32 KV tiles: none, causal, causal documents (1-16 a sequence) and
block-diagonal documents as custom bit masks, and an all-ones custom mask. A CTA runs ~31 items whatever the
mask, so the slope of time over tiles a CTA is the cost of a tile and the intercept the cost of 31 items.

    python3 benchmarks/experiments/exp_sm90_items.py [sm90|portable]
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # benchmarks/, the repository

import flashgen  # noqa: E402
from timing import timed  # noqa: E402
from flashgen import AttentionSpec, Causal, CustomMask, NoMask, Ragged  # noqa: E402
from flashgen.testing.masks import doc_mask  # noqa: E402

B, S, HQ, HKV, D, TQ, TK = 4, 4096, 32, 8, 128, 32, 128
backend = sys.argv[1] if len(sys.argv) > 1 else "sm90"
q = torch.randn(B * S, HQ, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B * S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
indptr = np.arange(B + 1) * S
pos = torch.arange(S)


def tiles_of(m):  # per item (32 tokens) the number of 128-key tiles with a visible pair
    t = m.view(S // TQ, TQ, S // TK, TK).any(dim=3).any(dim=1)
    return int(t.sum()) * B * HKV


def run(name, spec, custom, tiles, pairs):
    w = flashgen.BatchPrefillWrapper(spec, backend=backend)
    w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV, custom_mask=custom)
    out = torch.empty_like(q)
    us = timed(lambda: w.run(q, (k, v), out=out), 20)
    items = B * S // TQ * HKV
    tf = 4 * pairs * HQ * D / us / 1e6
    print(f"{name:14} {us:8.1f} us  items {items} tiles {tiles} tiles/CTA {tiles / 132:7.1f}  eff {tf:6.1f} TFLOP/s"
          f"  computed {tiles * 128 * 128 * 4 * D / us / 1e6:6.1f}", flush=True)


full = torch.ones(S, S, dtype=torch.bool)
causal = torch.tril(full)
run("none", AttentionSpec(D, kv_layout=Ragged(), mask=NoMask()), None, tiles_of(full), B * S * S)
run("causal", AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), None, tiles_of(causal), B * S * (S + 1) // 2)
for docs in (1, 2, 4, 8, 16):
    m = doc_mask(S, S, docs)
    run(f"doc{docs}", AttentionSpec(D, kv_layout=Ragged(), mask=CustomMask()), [m] * B, tiles_of(m), int(m.sum()) * B)
for docs in (8, 16):  # block-diagonal, no causal part: every visited tile full
    d = torch.arange(S) // (S // docs)
    m = d[:, None] == d[None, :]
    run(f"blockdiag{docs}", AttentionSpec(D, kv_layout=Ragged(), mask=CustomMask()), [m] * B, tiles_of(m), int(m.sum()) * B)
run("custom-full", AttentionSpec(D, kv_layout=Ragged(), mask=CustomMask()), [full] * B, tiles_of(full), B * S * S)
