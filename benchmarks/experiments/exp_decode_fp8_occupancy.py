"""Experiment: fp8 (e4m3) decode, bf16 q, page 16, with the planner's CTAs per SM and the pipeline depth varied
(2 or 3 CTAs an SM; 4 or 6 stages), each variant in a process and kernel cache of its own. Run from the
repository root on a GPU:

    python3 benchmarks/experiments/exp_decode_fp8_occupancy.py
"""
import os
import subprocess
import sys
import tempfile

VARIANTS = [(2, 4), (3, 4), (2, 6)]
SHAPES = [(64, 16384), (256, 16384), (64, 4096)]

if len(sys.argv) == 1:
    for ctas, stages in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, FLASHGEN_CACHE_DIR=cache)
            subprocess.run([sys.executable, __file__, str(ctas), str(stages)], env=env, check=False)
    sys.exit(0)

from pathlib import Path  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]
import torch  # noqa: E402

import flashgen  # noqa: E402
from flashgen import AttentionSpec, Paged  # noqa: E402
from flashgen.kernels import decode as fam  # noqa: E402
from bench_decode import HKV, HQ, D, paged_table  # noqa: E402
from timing import copy_rate, timed  # noqa: E402

ctas, stages = int(sys.argv[1]), int(sys.argv[2])
fam.decode_stages = lambda hd, hvo, kv_bytes=2: stages if kv_bytes == 1 else 3
fam.decode_ctas_per_sm = lambda hd, hvo, kv_bytes=2: ctas if kv_bytes == 1 else 2
cr = copy_rate()
gen = torch.Generator().manual_seed(0)
for batch, kv_len in SHAPES:
    total, indptr, indices, last = paged_table(batch, kv_len, 16, gen)
    cache = torch.randn(total, 2, 16, HKV, D, device="cuda").to(torch.float8_e4m3fn)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_dtype="float8_e4m3fn", kv_layout=Paged(16)))
    w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices.cuda(), kv_last_page_len=last)
    out = torch.empty_like(q)
    us = timed(lambda: w.run(q, cache, out=out), 30)
    nbytes = batch * kv_len * 2 * HKV * D
    print(f"ctas {ctas} stages {stages}  B={batch:3} L={kv_len:5}  {us:7.1f} us  {100 * nbytes / us / 1e3 / cr:5.1f} % of copy",
          flush=True)
    del cache
