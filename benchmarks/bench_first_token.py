"""Time from a fresh process to its first served token: `flashgen demo` serving one request, in new processes,
with the kernel cache in three states:

  cold      an empty cache: every kernel the loop needs is compiled (JIT) before its first use
  warm      the same cache again: every kernel is found there and loaded
  deployed  FLASHGEN_DISABLE_JIT=1 with an empty writable cache and, on FLASHGEN_EXTRA_CACHE_DIRS, a copy of the
            warm cache in a folder of its own (what `flashgen build --out DIR` ships): a miss would raise

Each figure is the demo's own `first token` line (the process's age when the first output token was sampled, read
from /proc), the median over --runs processes (cold: one process per run, each with a new empty cache). Without a
GPU the demo runs its CPU path and no kernel is loaded, so the three states agree. Prints a table, writes JSON.

    python3 benchmarks/bench_first_token.py --runs 3 --out benchmarks/results/first-token.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"first token\s+([\d.]+) s after the process started \(([\d.]+) s to the loop")
DEMO = ["-m", "flashgen.cli", "demo", "--requests", "1", "--check-requests", "1", "--system-prompt", "0"]


def first_token(env: dict) -> tuple[float, float]:
    """(seconds to the first token, seconds to the loop's start) of one fresh `flashgen demo` process."""
    run = subprocess.run([sys.executable, *DEMO], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    match = LINE.search(run.stdout)
    if run.returncode != 0 or match is None:
        raise RuntimeError(f"flashgen demo failed (exit {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return float(match.group(1)), float(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="processes a state (median)")
    parser.add_argument("--out", help="JSON file for the figures")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")
    args = parser.parse_args()
    base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for key in ("FLASHGEN_DISABLE_JIT", "FLASHGEN_EXTRA_CACHE_DIRS"):
        base.pop(key, None)
    figures: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": [], "deployed": []}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        for i in range(args.runs):
            cache = warm if i == args.runs - 1 else Path(tmp) / f"cold{i}"  # the last cold cache stays for warm
            figures["cold"].append(first_token(dict(base, FLASHGEN_CACHE_DIR=str(cache))))
        for _ in range(args.runs):
            figures["warm"].append(first_token(dict(base, FLASHGEN_CACHE_DIR=str(warm))))
        shipped = Path(tmp) / "shipped"
        warm.mkdir(exist_ok=True)  # without a GPU nothing was cached
        shutil.copytree(warm, shipped)
        for i in range(args.runs):
            empty = Path(tmp) / f"empty{i}"
            figures["deployed"].append(first_token(dict(base, FLASHGEN_CACHE_DIR=str(empty), FLASHGEN_DISABLE_JIT="1",
                                                        FLASHGEN_EXTRA_CACHE_DIRS=str(shipped))))
    rows = {state: {"first_token_s": statistics.median(t for t, _ in runs),
                    "to_loop_s": statistics.median(s for _, s in runs), "runs": runs}
            for state, runs in figures.items()}
    print("| cache | first token (s) | of it before the loop (s) |")
    print("|---|---|---|")
    for state, row in rows.items():
        print(f"| {state} | {row['first_token_s']:.2f} | {row['to_loop_s']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": args.commit, "demo": DEMO[2:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
