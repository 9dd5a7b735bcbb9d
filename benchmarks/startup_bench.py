"""What a fresh server process pays before its first kernel runs, on the CPU (no GPU needed):

  import    ``import flashgen`` after ``import torch`` (``-X importtime``'s cumulative figure for flashgen).
  load      a kernel already in the cache, found in a new process, up to the cubin read (the CUDA module load
            itself, ~0.1 ms on the H200, is not timed: ``build``'s work before it is): ``warm`` through the
            lookup index (no render, no nvcc), ``unindexed`` through the render-and-key path the index skips,
            as every load did before it (the Jinja import, the render, the header tree, ``nvcc --version``).
            Both after ``import flashgen.jit``; the first ``load`` call compiles the kernel if needed.

Each figure is the median over --runs fresh processes. Prints a table and writes JSON (--out); never asserts.

    python3 benchmarks/startup_bench.py --runs 15 --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

LOAD = """
import sys, time, torch
import flashgen, flashgen.jit as jit
from flashgen.spec import AttentionSpec, Paged
spec = AttentionSpec(128, kv_layout=Paged(16))
store = jit.default_store()
start = time.perf_counter()
if sys.argv[1] == "warm":
    hit = jit.lookup_indexed(spec, "decode", store, "sm_90a")
    entry = hit.entry
    hit.fam.entry_points(hit.spec), hit.fam.launch(hit.spec)  # what build() takes from the family on a hit
else:
    req = jit.prepare(spec, "decode", "sm_90a")
    entry = jit._ensure_unindexed(req, store)
elapsed = time.perf_counter() - start
assert entry is not None and entry.cubin
print(elapsed * 1e3)
"""


def _run(code: str, *args: str, env: dict, flags: tuple[str, ...] = ()) -> str:
    done = subprocess.run([sys.executable, *flags, "-c", code, *args], capture_output=True, text=True, env=env,
                          check=True)
    return done.stdout + done.stderr


def import_ms(env: dict) -> float:
    out = _run("import torch; import flashgen", env=env, flags=("-X", "importtime"))
    line = [ln for ln in out.splitlines() if re.search(r"\|\s*flashgen$", ln)][-1]
    return int(line.split("|")[1]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FLASHGEN_CACHE_DIR": cache}
        env.pop("FLASHGEN_EXTRA_CACHE_DIRS", None)
        subprocess.run([sys.executable, "-c", "import flashgen\nfrom flashgen.spec import AttentionSpec, Paged\n"
                        "flashgen.ensure_compiled(AttentionSpec(128, kv_layout=Paged(16)), 'decode', 'sm_90a')"],
                       env=env, check=True)  # compiles once, and records the index
        results = {
            "import_ms": [import_ms(env) for _ in range(args.runs)],
            "load_warm_ms": [float(_run(LOAD, "warm", env=env).split()[-1]) for _ in range(args.runs)],
            "load_unindexed_ms": [float(_run(LOAD, "unindexed", env=env).split()[-1]) for _ in range(args.runs)],
        }
    summary = {name: {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
               for name, v in results.items()}
    print(f"{'figure':<20} {'median ms':>10} {'min':>8} {'max':>8}   ({args.runs} fresh processes each)")
    for name, s in summary.items():
        print(f"{name:<20} {s['median']:>10.2f} {s['min']:>8.2f} {s['max']:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": args.runs, "cpus": os.cpu_count(), "summary": summary, "samples": results}, f, indent=1)


if __name__ == "__main__":
    main()
