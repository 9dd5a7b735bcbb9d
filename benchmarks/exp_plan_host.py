"""Wrapper ``plan()`` host time on a GPU machine, steady state: BatchDecodeWrapper (page 16, 4096 KV tokens a
request, B = 1, 16, 64, 256) and the sm90 BatchPrefillWrapper (ragged causal, 512 tokens a request, B = 1, 4, 16,
64); bf16, d128, 32 q / 8 kv heads. 20 warm-up plans, then the median of 300. ``nogc``: the garbage collector off
while timed. One line: d<B>:<us> for decode, p<B>:<us> for prefill.

Host timings on the device machine move 1.5-2x between processes with the core they land on: pin the process
and alternate the trees compared, e.g. (session 14)

    for t in new old new old; do (cd $t && PYTHONPATH=$PWD taskset -c 3 python3 benchmarks/exp_plan_host.py); done
"""
import gc
import sys
import time

import numpy as np
import torch

import flashgen
from flashgen import AttentionSpec, Causal, Paged, Ragged

HQ, HKV, D, PAGE = 32, 8, 128, 16
nogc = len(sys.argv) > 1 and sys.argv[1] == "nogc"


def median_us(plan) -> float:
    """20 warm-up calls, then the median of 300 (the garbage collector off while timed with ``nogc``)."""
    for _ in range(20):
        plan()
    if nogc:
        gc.disable()
    ts = []
    for _ in range(300):
        t0 = time.perf_counter()
        plan()
        ts.append(time.perf_counter() - t0)
    gc.enable()
    return float(np.median(ts)) * 1e6


out = []
for batch in (1, 16, 64, 256):
    pages_per = 4096 // PAGE
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(batch * pages_per).to(torch.int32).cuda()
    last = torch.full((batch,), PAGE, dtype=torch.int32)
    w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(PAGE)))
    us = median_us(lambda: w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices,
                                  kv_last_page_len=last))
    out.append(f"d{batch}:{us:.0f}")
for batch in (1, 4, 16, 64):
    indptr = np.arange(batch + 1) * 512
    w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), backend="sm90")
    us = median_us(lambda: w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV))
    out.append(f"p{batch}:{us:.0f}")
print(("nogc " if nogc else "gc   ") + " ".join(out), flush=True)
