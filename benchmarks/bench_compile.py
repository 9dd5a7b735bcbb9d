"""Compile time of the variants against the built-in spec they extend, on this machine (no GPU needed).

For each family (decode over pages of 16, the portable prefill and the Hopper prefill over ragged K/V, all d128
bf16 at sm_90a), the built-in spec (causal where the example is causal, else no mask) and the same spec with
each shipped example's variant (``flashgen/variants/examples.py``) are compiled one at a time into a fresh,
empty cache: render, key and nvcc, what a first use pays. Each run compiles the built-in spec and then the variant,
so that a shared machine's drift in speed hits both; the medians of --runs compiles are reported, with the median
of the runs' ratios (the goal: a variant within 20 % of its built-in spec).

    python3 benchmarks/bench_compile.py --runs 3 --out benchmarks/results/compile-variants.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flashgen import ensure_compiled  # noqa: E402
from flashgen.api.backends import kernels_for  # noqa: E402
from flashgen.cache.store import CacheStore  # noqa: E402
from flashgen.spec import AttentionSpec, Causal, NoMask, Paged, Ragged  # noqa: E402
from flashgen.variants.examples import EXAMPLES  # noqa: E402

FAMILIES = {"decode": (Paged(16), "decode"), "portable": (Ragged(), "prefill"), "sm90": (Ragged(), "prefill_sm90")}
NON_CAUSAL = ("prefix_lm", "sigmoid")  # attend past the diagonal (prefix-LM) or are compared without a mask


def spec(family: str, example: str | None, causal: bool) -> AttentionSpec:
    layout, op = FAMILIES[family]
    mask = Causal() if causal else NoMask()
    return AttentionSpec(128, kv_layout=layout, mask=mask, variant=None if example is None else EXAMPLES[example][0])


def compile_seconds(family: str, example: str | None, causal: bool) -> float:
    """One compile into a fresh, empty cache of every kernel the family's backend runs for the spec, side by side
    as a wrapper's first use compiles them (the Hopper backend: its K pre-pass too, for a k_transform)."""
    the_spec, op = spec(family, example, causal), FAMILIES[family][1]
    kernels = kernels_for(the_spec, "sm90") if op == "prefill_sm90" else ((op, the_spec),)
    with tempfile.TemporaryDirectory() as root, ThreadPoolExecutor(len(kernels)) as pool:
        store = CacheStore(Path(root))
        start = time.perf_counter()
        list(pool.map(lambda job: ensure_compiled(job[1], job[0], arch="sm_90a", store=store), kernels))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--out", help="JSON output")
    args = parser.parse_args()
    rows = []
    print(f"{'family':<9} {'spec':<24} {'compile s':>9} {'built-in s':>10} {'x built-in':>10}  built-in spec")

    def row(family: str, name: str, seconds: float, base: float, ratio: float, against: str) -> None:
        rows.append(dict(family=family, spec=name, seconds=seconds, builtin_seconds=base, ratio=ratio,
                         builtin=against))
        print(f"{family:<9} {name:<24} {seconds:9.2f} {base:10.2f} {ratio:9.2f}x  {against}", flush=True)

    for family in args.families.split(","):
        for example in args.examples.split(","):
            causal = example not in NON_CAUSAL and family != "decode"  # a decode step has no mask to apply
            base, times = [], []
            try:
                for _ in range(args.runs):  # built-in and variant in turn: the machine's drift hits both alike
                    base.append(compile_seconds(family, None, causal))
                    times.append(compile_seconds(family, example, causal))
            except Exception as exc:  # a family that refuses a hook says why; the row records it
                print(f"{family:<9} {example:<24} refused: {exc}"[:160], flush=True)
                continue
            ratio = statistics.median(t / b for t, b in zip(times, base))
            row(family, example, statistics.median(times), statistics.median(base), ratio,
                "built-in" + (" causal" if causal else ", no mask"))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": args.runs, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
