"""Experiment: B=1 decode time against the split (the wrapper's num_sms scales the planner's slots).

    python3 benchmarks/experiments/exp_decode_split.py   # on a GPU; prints one line per (kv_len, num_sms)
"""
import sys, torch
sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parents[i]) for i in (1, 2)]
from bench_decode import BYTES_PER_TOKEN, HKV, HQ, D, paged_table
from timing import timed
import flashgen
from flashgen import AttentionSpec, Paged
gen = torch.Generator().manual_seed(0)
for L in (4096, 16384, 65536):
    total, indptr, indices, last = paged_table(1, L, 16, gen)
    cache = torch.randn(total, 2, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    for sms in (33, 66, 132, 264, 528):
        w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(16)), num_sms=sms)
        w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices.cuda(), kv_last_page_len=last)
        us = timed(lambda: w.run(q, cache), 30)
        gb = L * BYTES_PER_TOKEN / 1e9
        print(f"L={L} num_sms={sms} chunk={w._planned['info'].kv_chunk} items={w._planned['info'].num_items} {us:.1f} us {gb/us*1e6:.0f} GB/s")
