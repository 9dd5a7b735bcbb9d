"""Experiment: bf16 vs fp8 (e4m3) decode at B=64, L=16k, page 16: GPU time, wrapper plan() time (median of
30 re-plans) and run() host time (300 back-to-back calls). Run from the repository root on a GPU."""
import sys, time, statistics, torch
sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parents[i]) for i in (1, 2)]
from bench_decode import HKV, HQ, D, paged_table
from timing import copy_rate, timed
import flashgen
from flashgen import AttentionSpec, Paged
gen = torch.Generator().manual_seed(0)
cr = copy_rate()
print(f"copy {cr:.0f} GB/s")
B, L, P = 64, 16384, 16
total, indptr, indices, last = paged_table(B, L, P, gen)
q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
for kv_dtype in ("bfloat16", "float8_e4m3fn"):
    cache = torch.randn(total, 2, P, HKV, D, device="cuda").to(getattr(torch, kv_dtype))
    w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_dtype=kv_dtype, kv_layout=Paged(P)))
    ind = indices.cuda()
    ts = []
    for _ in range(31):
        t0 = time.perf_counter(); w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=ind, kv_last_page_len=last); ts.append((time.perf_counter() - t0) * 1e6)
    out = torch.empty_like(q)
    us = timed(lambda: w.run(q, cache, out=out), 20)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(300): w.run(q, cache, out=out)
    host = (time.perf_counter() - t0) / 300 * 1e6; torch.cuda.synchronize()
    nbytes = total * P * 2 * HKV * D * cache.element_size()
    print(f"{kv_dtype}: {us:.1f} us, {nbytes/us/1e3:.0f} GB/s of its KV bytes ({100*nbytes/us/1e3/cr:.1f} % of copy); plan median {statistics.median(ts[1:]):.1f} us; run host {host:.1f} us")
