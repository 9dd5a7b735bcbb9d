"""User-defined variants at prefill: each shipped example (flashgen/variants/examples.py) in flashgen's Hopper
(sm90) and portable prefill against FlexAttention with the same score_mod / mask_mod (a block mask for masks), in
one process, timed round-robin after L2 flushes as bench_prefill.py times (flashgen/bench/timing.py).

bf16, 32 q / 8 kv heads, head_dim 128, ragged, 4x4096 and 1x16384 tokens, causal where the example applies
(every one but prefix-LM, whose mask is its own). TFLOP/s count the visible (query, key) pairs, causal as half
(FlashAttention's convention): documents of --doc-len tokens count their causal blocks, prefix-LM its prefix
square on top. Flex has no sink and no normaliser-free softmax: the sink's row is Flex's output scaled by
sigmoid(lse - sink) (one extra elementwise kernel, timed with it); sigmoid attention has no Flex row; Flex has no
load transform: its qk_gain row multiplies q and k by their gains in torch first (timed with it). flashgen's
Hopper backend runs the k_transform in its K pre-pass (timed with it). The tree
example's ancestor bits cover 64 tokens, so it is not run at these lengths. ``document_tiled`` is the
document mask with its tile predicate (the issue's 1k-token document row): the portable prefill never loads the
empty tiles at either end of a CTA's range and skips the compute of the empty ones inside it; the Hopper prefill
classifies each item's tiles by the predicate in a pre-pass kernel (timed with it) and never loads the empty ones,
running the full ones without the mask hook. prefix-LM has a tile predicate too (the empty upper triangle past
the prefix is skipped the same way).

    PYTHONPATH=$PWD python3 benchmarks/bench_variants.py --out benchmarks/results/variants.json
    PYTHONPATH=$PWD python3 benchmarks/bench_variants.py --examples document --shapes 1x16384 --reps 20
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

HQ, HKV, D = 32, 8, 128
SHAPES = "4x4096,1x16384"
EXAMPLE_NAMES = ("sink", "document", "document_tiled", "t5_bias", "alibi", "sigmoid", "prefix_lm",
                 "qk_gain")  # tree: <= 64 tokens


def visible_pairs(name: str, seqlen: int, doc_len: int, prefix: int) -> float:
    """Pairs one sequence attends (causal = s^2 / 2, as bench_prefill.py counts)."""
    if name in ("document", "document_tiled"):
        docs, last = divmod(seqlen, doc_len)
        return docs * doc_len * doc_len / 2 + last * last / 2
    if name == "prefix_lm":
        return seqlen * seqlen / 2 + prefix * prefix / 2
    return seqlen * seqlen / 2


def example_inputs(name: str, batch: int, seqlen: int, doc_len: int, prefix: int) -> dict:
    """The run() arguments of an example at one shape (on the GPU)."""
    g = torch.Generator().manual_seed(0)
    args = {
        "sink": lambda: {"sinks": torch.randn(HQ, generator=g)},
        "document": lambda: {"doc_ids": (torch.arange(seqlen) // doc_len).int()},
        "document_tiled": lambda: {"doc_ids": (torch.arange(seqlen) // doc_len).int()},
        "t5_bias": lambda: {"rel_bias": torch.randn(HQ, 32, generator=g)},
        "alibi": lambda: {"slopes": torch.rand(HQ, generator=g) * 0.1},
        "sigmoid": lambda: {"bias": -math.log(seqlen)},
        "prefix_lm": lambda: {"prefix_len": torch.full((batch,), prefix, dtype=torch.int32)},
        "qk_gain": lambda: {"q_gain": torch.rand(HQ, D, generator=g) + 0.5, "k_gain": torch.rand(HKV, D, generator=g) + 0.5},
    }[name]()
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def spec_of(name: str):
    from flashgen.spec import AttentionSpec, Causal, NoMask, Ragged
    from flashgen.variants.examples import EXAMPLES

    mask = NoMask() if name == "prefix_lm" else Causal()
    return AttentionSpec(D, kv_layout=Ragged(), mask=mask, variant=EXAMPLES[name][0])


def t5_bucket_torch(rel: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """flashgen.variants.examples.t5_bucket on torch tensors (for Flex's score_mod)."""
    half = num_buckets // 2
    exact = half // 2
    n = rel.abs()
    large = exact + torch.log((n + 1e-6) / exact) / math.log(max_distance / exact) * (half - exact)
    large = torch.clamp(large, 0.0, half - 1.0)
    bucket = torch.where(n < exact, n.float(), large)
    return torch.where(rel > 0, half, 0) + torch.floor(bucket).long()


def flex_call(name: str, q, k, v, batch: int, seqlen: int, args: dict):
    """(call, compile seconds) of FlexAttention with the example's score_mod / mask_mod, or None (no Flex form)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if name == "sigmoid":
        return None
    # each example and shape compiles its own graph: past dynamo's default limit of 8 Flex would run eager
    # (materialised scores, ~40x slower) and time the wrong thing
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    flex = torch.compile(flex_attention, dynamic=False)
    causal = lambda b, h, qi, ki: ki <= qi  # noqa: E731
    mask_mod, score_mod = causal, None
    if name in ("document", "document_tiled"):  # Flex's block mask skips tiles from the mask itself
        ids = args["doc_ids"]
        mask_mod = lambda b, h, qi, ki: (ki <= qi) & (ids[qi] == ids[ki])  # noqa: E731
    elif name == "prefix_lm":
        plen = args["prefix_len"]
        mask_mod = lambda b, h, qi, ki: (ki <= qi) | (ki < plen[b])  # noqa: E731
    elif name == "alibi":
        slopes = args["slopes"]
        score_mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)  # noqa: E731
    elif name == "t5_bias":
        table = args["rel_bias"]
        score_mod = lambda s, b, h, qi, ki: s + table[h, t5_bucket_torch(ki - qi)]  # noqa: E731
    block_mask = create_block_mask(mask_mod, batch if name == "prefix_lm" else None, None, seqlen, seqlen)
    q4, k4, v4 = (x.view(batch, seqlen, -1, D).transpose(1, 2) for x in (q, k, v))
    if name == "qk_gain":
        q_gain, k_gain = args["q_gain"].view(1, HQ, 1, D), args["k_gain"].view(1, HKV, 1, D)

        def call():
            return flex((q4 * q_gain).to(q4.dtype), (k4 * k_gain).to(k4.dtype), v4, block_mask=block_mask,
                        enable_gqa=True)
    elif name == "sink":
        sinks = args["sinks"].view(1, HQ, 1, 1)

        def call():
            out, lse = flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True, return_lse=True)
            return out * torch.sigmoid(lse.unsqueeze(-1) - sinks)
    else:
        def call():
            return flex(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return call, time.perf_counter() - start


def flashgen_call(name: str, backend: str, q, k, v, batch: int, seqlen: int, args: dict):
    import numpy as np

    from flashgen import BatchPrefillWrapper

    wrapper = BatchPrefillWrapper(spec_of(name), backend=backend)
    indptr = np.arange(batch + 1) * seqlen
    wrapper.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k, v), out=out, **args)


def build(names: list[str], backends: list[str]) -> None:
    """Every flashgen kernel of the run, compiled in parallel before anything is timed."""
    from flashgen import ensure_compiled
    from flashgen.api.backends import kernels_for

    jobs = [(spec, op) for n in names for b in backends for op, spec in kernels_for(spec_of(n), b)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: ensure_compiled(*job), jobs))
    print(f"compiled {len(jobs)} flashgen kernels in {time.perf_counter() - start:.0f} s", flush=True)


def measure(args: argparse.Namespace) -> list[dict]:
    from flashgen.bench.timing import timed_interleaved

    names = args.examples.split(",")
    backends = args.backends.split(",")
    build(names, backends)
    rows = []
    for shape in args.shapes.split(","):
        batch, seqlen = (int(x) for x in shape.split("x"))
        q = torch.randn(batch * seqlen, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch * seqlen, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name in names:
            inputs = example_inputs(name, batch, seqlen, args.doc_len, args.prefix)
            flops = 4 * batch * HQ * D * visible_pairs(name, seqlen, args.doc_len, args.prefix)
            calls, extra = [], {}
            for backend in backends:
                try:
                    calls.append((f"flashgen-{backend}", flashgen_call(name, backend, q, k, v, batch, seqlen, inputs)))
                except Exception as exc:  # noqa: BLE001 - a row failing is reported, never fatal
                    print(f"{name} {shape} flashgen-{backend} failed: {exc!r}"[:300], flush=True)
            if not args.no_flex:
                try:
                    flex = flex_call(name, q, k, v, batch, seqlen, inputs)
                    if flex is not None:
                        calls.append(("flex", flex[0]))
                        extra["flex"] = {"compile_s": flex[1]}
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} {shape} flex failed: {exc!r}"[:300], flush=True)
            for _, fn in calls:
                fn()
            torch.cuda.synchronize()
            times = timed_interleaved([fn for _, fn in calls], args.reps)
            for (peer, _), us in zip(calls, times):
                tf = flops / us / 1e6
                rows.append({"example": name, "peer": peer, "batch": batch, "seqlen": seqlen, "us": us, "TFLOPs": tf,
                             **extra.get(peer, {})})
                print(f"{name:10} {shape:8} {peer:18} {us:10.1f} us {tf:6.0f} TFLOP/s", flush=True)
        del q, k, v
    return rows


def markdown(rows: list[dict]) -> str:
    peers = sorted({r["peer"] for r in rows})
    keys = sorted({(r["example"], r["batch"], r["seqlen"]) for r in rows}, key=lambda x: (x[0], x[2]))
    lines = ["| example | shape | " + " | ".join(f"{p} TFLOP/s" for p in peers) + " | best flashgen / flex |",
             "|---|---|" + "---|" * (len(peers) + 1)]
    for name, batch, seqlen in keys:
        tf = {r["peer"]: r["TFLOPs"] for r in rows if (r["example"], r["batch"], r["seqlen"]) == (name, batch, seqlen)}
        best = max((v for p, v in tf.items() if p.startswith("flashgen")), default=None)
        ratio = f"{best / tf['flex']:.2f}x" if best and tf.get("flex") else "n/a"
        cells = " | ".join(f"{tf[p]:.0f}" if p in tf else "-" for p in peers)
        lines.append(f"| {name} | {batch}x{seqlen} | {cells} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", default=",".join(EXAMPLE_NAMES), help="comma-separated example names")
    parser.add_argument("--shapes", default=SHAPES, help="BATCHxSEQLEN, comma-separated")
    parser.add_argument("--backends", default="sm90,portable", help="flashgen prefill backends")
    parser.add_argument("--doc-len", type=int, default=1024, help="document example: tokens a document")
    parser.add_argument("--prefix", type=int, default=1024, help="prefix-LM example: the bidirectional prefix")
    parser.add_argument("--reps", type=int, default=30, help="timed calls a row (median)")
    parser.add_argument("--no-flex", action="store_true", help="flashgen rows only")
    parser.add_argument("--out", default="benchmarks/results/variants.json", help="JSON output (.md beside it)")
    parser.add_argument("--commit", default="unknown", help="the measured tree's commit, recorded in the results")
    args = parser.parse_args(argv)
    unknown = set(args.examples.split(",")) - set(EXAMPLE_NAMES)
    if unknown:
        parser.error(f"--examples: unknown {sorted(unknown)}, expected some of {', '.join(EXAMPLE_NAMES)}")
    rows = measure(args)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": args.commit,
              "command": "benchmarks/bench_variants.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__,
              "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"},
              "doc_len": args.doc_len, "prefix": args.prefix, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = markdown(rows)
    header = (f"# Variants against FlexAttention, {result['device']}, {result['date']}, commit {args.commit}\n"
              f"`{result['command']}`; bf16, {HQ} q / {HKV} kv heads, d{D}, ragged; {args.doc_len}-token documents, "
              f"{args.prefix}-token prefix; TFLOP/s over the visible pairs; "
              + ("no FlexAttention" if args.no_flex else f"FlexAttention (torch {torch.__version__}) in the same process")
              + ".\n\n")
    out.with_suffix(".md").write_text(header + table)
    print(table)


if __name__ == "__main__":
    main()
