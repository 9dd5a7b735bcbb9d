"""Experiment: the portable prefill's last-wave split (balance_tail) at forced (m, k) against the unsplit plan and
FlashInfer's FA2, all timed round-robin in one process (timing.timed_interleaved), ragged bf16, 32 q / 8 kv heads,
head_dim 128, no mask. ``choose_tail_split`` is replaced for each variant's plan() only; every variant runs the
same kernel binary. Prints TFLOP/s and the ratio to FA2 per variant and round.

    python3 benchmarks/exp_tail_split.py --shapes 4x4096,1x16384 --ks 0,3,5,8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
import flashgen.plan.split_kv as split_kv  # noqa: E402
from bench_prefill_mixed import D, HKV, HQ, bench_flashinfer  # noqa: E402
from flashgen import AttentionSpec, NoMask, Ragged  # noqa: E402
from timing import timed_interleaved  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x4096,1x16384")
    ap.add_argument("--ks", default="0,2,3,4,5,6,8", help="chunk counts; 0 = unsplit; 'auto' = the planner's own")
    ap.add_argument("--m", type=int, default=0, help="tail items (0: the planner's own m)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flashinfer  # noqa: F401  (fails early where FlashInfer is missing)

    original = split_kv.choose_tail_split
    results = []
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        q = torch.randn(b * s, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b * s, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(b * s, HKV, D, dtype=torch.bfloat16, device="cuda")
        indptr = [i * s for i in range(b + 1)]
        flops = 4 * b * HQ * s * s * D
        fns, names = [], []
        spec = AttentionSpec(D, kv_layout=Ragged(), mask=NoMask())
        for kk in args.ks.split(","):
            auto = original(s, b * s * (HQ // HKV) // 128, HKV, num_sms=264, granularity=64)
            if kk == "auto":
                forced = auto
            elif int(kk) == 0:
                forced = None
            else:
                forced = ((args.m or (auto[0] if auto else 17)), int(kk))
            split_kv.choose_tail_split = lambda *a, _f=forced, **kw: _f
            w = flashgen.BatchPrefillWrapper(spec, backend="portable")
            w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
            split_kv.choose_tail_split = original
            out = torch.empty_like(q)
            fns.append(lambda w=w, out=out: w.run(q, (k, v), out=out))
            names.append(f"tail{forced}")
        fns.append(bench_flashinfer(q, k, v, indptr, indptr, False, "fa2"))
        names.append("fa2")
        # correctness of every variant against the unsplit one (same kernel): the split changes summation order only
        outs = []
        for fn in fns[:-1]:
            o = fn()
            outs.append(o.float().clone())
        for name, o in zip(names, outs):
            err = (o - outs[0]).abs().max().item()
            if err > 2e-2:
                raise SystemExit(f"{shape} {name}: differs from the unsplit output by {err}")
        for rnd in range(args.rounds):
            us = timed_interleaved(fns, args.reps)
            tf = [flops / (t * 1e-6) / 1e12 for t in us]
            row = {"shape": shape, "round": rnd, **{n: round(x, 1) for n, x in zip(names, tf)}}
            results.append(row)
            print(shape, rnd, "  ".join(f"{n}={x:.0f}({x / tf[-1]:.3f})" for n, x in zip(names, tf)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
