"""Planner speed on the host: median plan time (µs) for decode and prefill batches of 1 to 4096 requests.

Mixed lengths (log-uniform KV lengths 16..32768, prefill query lengths 1..512), Llama-3-8B heads (32 q,
8 kv), page size 16, 132 SMs; inputs are CPU int32 tensors. ``median_us`` is the realistic call: the plan
reuses one host buffer, as a wrapper's plan() does; ``new_buffer_us`` lets every call allocate its own
(a plain CPU tensor here; pinned, and far slower, where CUDA is available). Prints a table; ``--json PATH``
also writes the records. The host is small and shared: other processes on its CPUs inflate every number
(1.5-2x under a load of 2), so the 1-minute load average before and after is printed to stderr.

    python3 benchmarks/plan_bench.py --json plan_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.plan import plan_decode, plan_prefill  # noqa: E402

BATCHES = (1, 4, 16, 64, 256, 1024, 4096)
HEADS = dict(num_qo_heads=32, num_kv_heads=8, kv_granularity=16, num_sms=132)


def median_us(fn, min_seconds: float = 0.2, min_runs: int = 20) -> float:
    warm = time.perf_counter()
    while time.perf_counter() - warm < 0.05:
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def workload(kind: str, batch: int, rng: np.random.Generator):
    kv_lens = np.exp(rng.uniform(np.log(16), np.log(32768), batch)).astype(np.int32)
    if kind == "decode":
        return (torch.from_numpy(kv_lens),)
    qo_lens = np.minimum(np.exp(rng.uniform(0, np.log(512), batch)).astype(np.int32), kv_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    return torch.from_numpy(qo_indptr), torch.from_numpy(kv_lens)


def run(batches=BATCHES) -> list[dict]:
    rng = np.random.default_rng(0)
    host_buffer = torch.empty(1 << 22, dtype=torch.int32)
    records = []
    for kind, planner in (("decode", plan_decode), ("prefill", plan_prefill)):
        for batch in batches:
            args = workload(kind, batch, rng)
            plan = planner(*args, **HEADS)
            reused = median_us(lambda: planner(*args, host_buffer=host_buffer, **HEADS))
            new = median_us(lambda: planner(*args, **HEADS))
            records.append({"kind": kind, "batch": batch, "median_us": round(reused, 1),
                            "new_buffer_us": round(new, 1), "items": plan.info.num_items,
                            "kv_chunk": plan.info.kv_chunk})
    return records


def table(records: list[dict]) -> str:
    lines = ["| kind | batch | median µs (reused host buffer) | median µs (new buffer per call) | items | kv_chunk |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['batch']} | {r['median_us']:.1f} | {r['new_buffer_us']:.1f} | {r['items']} | "
              f"{r['kv_chunk']} |" for r in records]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records as a JSON list to this path")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    records = run()
    print(table(records))
    print(f"load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
