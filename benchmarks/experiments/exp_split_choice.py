"""Experiment: the portable prefill's split-KV chunk on mixed batches, forced, against the planner's own choice
and FlashInfer's FA2, all timed round-robin in one process (timing.timed_interleaved); ragged bf16, 32 q / 8 kv
heads, head_dim 128. Each variant's plan() passes its own split_policy= (and split_min_waves) to the planner
(see --variants), so every variant runs the same kernel binary. Prints TFLOP/s and the ratio to FA2.

    python3 benchmarks/exp_split_choice.py --variants auto,notail,old,chunk2048 --rounds 2
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
import flashgen.api.portable as api_prefill  # noqa: E402
from flashgen.plan import SplitPolicy, plan_prefill  # noqa: E402
from bench_prefill_mixed import BATCHES, D, HKV, HQ, bench_flashinfer, visible_pairs  # noqa: E402
from flashgen import AttentionSpec, Causal, NoMask, Ragged  # noqa: E402
from timing import timed_interleaved  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="long+short")
    ap.add_argument("--masks", default="none,causal")
    ap.add_argument("--variants", default="auto,notail,old,chunk2048", help="auto, notail, old, chunkN")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flashinfer  # noqa: F401  (fails early where FlashInfer is missing)

    results = []
    for batch in args.batches.split(","):
        qo, kv = BATCHES[batch]
        qi, ki = [0], [0]
        for a, b in zip(qo, kv):
            qi.append(qi[-1] + a)
            ki.append(ki[-1] + b)
        q = torch.randn(qi[-1], HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(ki[-1], HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        for mask in args.masks.split(","):
            causal = mask == "causal"
            flops = 4 * HQ * D * visible_pairs(qo, kv, causal)
            spec = AttentionSpec(D, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
            fns, names, outs = [], [], []
            for variant in args.variants.split(","):
                # auto: the planner as it is; notail: no last-wave split; old: no split_min_waves (the planner's
                # chunk choice before fills_waves); chunkN: split_min_waves off and the chunk forced to N tokens
                options = {}
                if variant == "notail":
                    options["split_policy"] = SplitPolicy(tail_split=lambda *a, **kw: None)
                if variant == "old" or variant.startswith("chunk"):
                    options["split_min_waves"] = None
                if variant.startswith("chunk"):
                    options["split_policy"] = SplitPolicy(candidates=lambda *a, _c=int(variant[5:]): [_c])
                # the wrapper's plan() calls api_prefill.plan_prefill: this variant's options for its plan() only
                api_prefill.plan_prefill = lambda *a, _o=options, **kw: plan_prefill(*a, **{**kw, **_o})
                w = flashgen.BatchPrefillWrapper(spec, backend="portable")
                w.plan(qo_indptr=qi, kv_indptr=ki, num_qo_heads=HQ, num_kv_heads=HKV)
                api_prefill.plan_prefill = plan_prefill
                out = torch.empty_like(q)
                fns.append(lambda w=w, out=out: w.run(q, (k, v), out=out))
                names.append(variant)
                outs.append(fns[-1]().float().clone())
            for n, o in zip(names, outs):
                err = (o - outs[0]).abs().max().item()
                if err > 2e-2:
                    raise SystemExit(f"{batch} {mask} {n}: differs from the first variant by {err}")
            fns.append(bench_flashinfer(q, k, v, qi, ki, causal, "fa2"))
            names.append("fa2")
            for rnd in range(args.rounds):
                us = timed_interleaved(fns, args.reps)
                tf = [flops / (t * 1e-6) / 1e12 for t in us]
                results.append({"batch": batch, "mask": mask, "round": rnd, **dict(zip(names, tf))})
                print(batch, mask, rnd, "  ".join(f"{n}={x:.0f}({x / tf[-1]:.3f})" for n, x in zip(names, tf)),
                      flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
