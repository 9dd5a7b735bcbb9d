"""Planner speed on the host: median plan time (µs) for decode and prefill batches of 1 to 4096 requests.

Kinds: ``decode`` and ``prefill`` (``HEADS``), ``prefill_tail`` (the prefill batches with the portable prefill
wrapper's options, ``balance_tail`` on).

Mixed lengths (log-uniform KV lengths 16..32768, prefill query lengths 1..512), Llama-3-8B heads (32 q,
8 kv), page size 16, 132 SMs; inputs are CPU int32 tensors. ``median_us`` is the realistic call: the plan
reuses one host buffer, as a wrapper's plan() does; ``new_buffer_us`` lets every call allocate its own
(a plain CPU tensor here; pinned, and far slower, where CUDA is available). Prints a table; ``--json PATH``
also writes the records. The host is small and shared: other processes on its CPUs inflate every number
(1.5-2x under a load of 2), so the 1-minute load average before and after is printed to stderr.
``--mask-tiles`` also times the custom-mask tile classification of a 16k x 16k document mask (8 causal
documents, 512 items of 32 tokens; ``flashgen.plan.mask_tiles``). ``--against DIR`` times another tree's
planner (``DIR/flashgen/plan``, e.g. main exported with ``git archive main flashgen | tar -x -C DIR``)
interleaved with this one's, ``--rounds`` times each, and prints both medians. ``--native`` times the wrappers'
small plans (``NATIVE_CASES``: prefill 1 x 128 tokens, decode of 1, 8, 24 requests; numpy int32 inputs, as a
wrapper passes them) with the native planner and with the Python list paths (``flashgen.plan.native.use``),
interleaved ``--rounds`` times in this process.

    python3 benchmarks/plan_bench.py --json plan_bench.json
    python3 benchmarks/plan_bench.py --against /tmp/plan_old --rounds 3
    python3 benchmarks/plan_bench.py --native --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
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
# the portable prefill wrapper's call without a mask (d128: 128-row tiles, 64-token KV tiles, 2 CTAs an SM):
# batches of 1-64 requests split, at 4096 the last wave's items split (balance_tail)
TAIL = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=128, kv_granularity=64, num_sms=264, balance_tail=True)
KINDS = (("decode", "decode", HEADS), ("prefill", "prefill", HEADS), ("prefill_tail", "prefill", TAIL))  # the
# tail kind plans the prefill kind's batches


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


def batch_inputs(seen: dict, kind: str, batch: int, rng: np.random.Generator):
    # one batch per (workload kind, batch), drawn in the order of first use (decode, then prefill: as before
    # the tail kind was added); the tail kind plans the prefill batches
    if (kind, batch) not in seen:
        seen[kind, batch] = workload(kind, batch, rng)
    return seen[kind, batch]


def run(batches=BATCHES) -> list[dict]:
    rng = np.random.default_rng(0)
    batches_seen = {}  # (workload kind, batch) -> inputs
    host_buffer = torch.empty(1 << 22, dtype=torch.int32)
    records = []
    for kind, planner_kind, options in KINDS:
        planner = plan_decode if planner_kind == "decode" else plan_prefill
        for batch in batches:
            args = batch_inputs(batches_seen, planner_kind, batch, rng)
            plan = planner(*args, **options)
            reused = median_us(lambda: planner(*args, host_buffer=host_buffer, **options))
            new = median_us(lambda: planner(*args, **options))
            records.append({"kind": kind, "batch": batch, "median_us": round(reused, 1),
                            "new_buffer_us": round(new, 1), "items": plan.info.num_items,
                            "kv_chunk": plan.info.kv_chunk})
    return records


def load_planners(tree: Path):
    """``(plan_decode, plan_prefill)`` of ``tree/flashgen/plan``, imported as a package of its own (the planner
    imports nothing of flashgen outside it)."""
    spec = importlib.util.spec_from_file_location("_plan_ref", tree / "flashgen" / "plan" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "flashgen" / "plan")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["_plan_ref"] = module
    spec.loader.exec_module(module)
    return module.plan_decode, module.plan_prefill


def compare(reference: Path, rounds: int, batches=BATCHES) -> list[dict]:
    """Median µs (reused host buffer) of the reference tree's planner and this one's, alternating ``rounds``
    times per batch: the smallest of the rounds' medians (the least disturbed by other processes); each record
    keeps every round's pair."""
    ref = dict(zip(("decode", "prefill"), load_planners(reference)))
    new = {"decode": plan_decode, "prefill": plan_prefill}
    rng = np.random.default_rng(0)
    batches_seen = {}  # (workload kind, batch) -> inputs
    buffers = [torch.empty(1 << 22, dtype=torch.int32) for _ in range(2)]  # one each: they cache views on it
    records = []
    for kind, planner_kind, options in KINDS:
        for batch in batches:
            args = batch_inputs(batches_seen, planner_kind, batch, rng)
            pairs = []
            for _ in range(rounds):
                pair = []
                for planner, buf in zip((ref[planner_kind], new[planner_kind]), buffers):
                    pair.append(median_us(lambda: planner(*args, host_buffer=buf, **options), 0.1))
                pairs.append(pair)
            records.append({"kind": kind, "batch": batch, "ref_us": min(p[0] for p in pairs),
                            "new_us": min(p[1] for p in pairs), "rounds": pairs})
    return records


# (kind, label, planner arguments): a wrapper's plan() of a small batch. The portable prefill of d128 (64-token KV
# tiles, 2 CTAs an SM: 264 slots on 132 SMs; causal, so no balance_tail), the sm90 prefill (unsplit, 128-row
# tiles), the decode kernel (16-row tiles)
_ONE = (np.array([0, 128], np.int32), np.array([128], np.int32))
_DECODE_LENS = np.exp(np.random.default_rng(0).uniform(np.log(16), np.log(32768), 24)).astype(np.int32)
NATIVE_CASES = tuple(
    ("prefill", f"1x128 tile_rows={rows} num_sms={sms}{'' if split else ' unsplit'}", _ONE,
     dict(num_qo_heads=32, num_kv_heads=8, tile_rows=rows, kv_granularity=64, num_sms=sms, enable_split=split))
    for rows, sms, split in ((64, 132, True), (64, 264, True), (128, 132, True), (128, 264, True), (128, 132, False))
) + tuple(("decode", f"B={b}", (_DECODE_LENS[:b].copy(),),
           dict(num_qo_heads=32, num_kv_heads=8, tile_rows=16, kv_granularity=16, num_sms=264)) for b in (1, 8, 24))


def compare_native(rounds: int) -> list[dict]:
    """Median µs of each ``NATIVE_CASES`` plan with the Python list paths and with the native planner, alternating
    ``rounds`` times: the smallest of the rounds' medians, as ``compare``."""
    from flashgen.plan import native

    if not native.available():
        raise SystemExit(f"the native planner is unavailable: {native.failure()}")
    buffer = torch.empty(1 << 16, dtype=torch.int32)
    records = []
    for kind, label, args, options in NATIVE_CASES:
        planner = plan_decode if kind == "decode" else plan_prefill
        pairs = []
        for _ in range(rounds):
            pair = []
            for enabled in (False, True):
                with native.use(enabled):
                    pair.append(median_us(lambda: planner(*args, host_buffer=buffer, **options), 0.1))
            pairs.append(pair)
        records.append({"kind": kind, "batch": label, "ref_us": min(p[0] for p in pairs),
                        "new_us": min(p[1] for p in pairs), "rounds": pairs})
    return records


def compare_table(records: list[dict]) -> str:
    lines = ["| kind | batch | reference µs | this tree µs | speed-up | rounds (ref / new) |",
             "|---|---:|---:|---:|---:|---|"]
    for r in records:
        rounds = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in r["rounds"])
        lines.append(f"| {r['kind']} | {r['batch']} | {r['ref_us']:.1f} | {r['new_us']:.1f} | "
                     f"{r['ref_us'] / r['new_us']:.1f}x | {rounds} |")
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    lines = ["| kind | batch | median µs (reused host buffer) | median µs (new buffer per call) | items | kv_chunk |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['batch']} | {r['median_us']:.1f} | {r['new_buffer_us']:.1f} | {r['items']} | "
              f"{r['kv_chunk']} |" for r in records]
    return "\n".join(lines)


def mask_tiles_ms(reps: int = 3) -> float:
    """Best of ``reps`` of the tile classification of a 16k x 16k document mask (ms)."""
    from flashgen.plan.mask_tiles import mask_tile_lists
    from flashgen.testing.masks import doc_mask

    n = 16384
    packed = np.packbits(doc_mask(n, n, 8).numpy().reshape(-1), bitorder="little")
    request, qo_tile = np.zeros(512, np.int64), np.arange(512)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mask_tile_lists(packed, [0], [n], [n], request, qo_tile, group_size=4, tile_rows=128, tile_kv=128)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records as a JSON list to this path")
    parser.add_argument("--against", type=Path, help="a tree holding flashgen/plan to time interleaved with this one")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per batch with --against or --native")
    parser.add_argument("--mask-tiles", action="store_true", help="also time a 16k x 16k mask's tile classification")
    parser.add_argument("--native", action="store_true",
                        help="time the wrappers' small plans with the native planner against the Python list paths")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    if args.native:
        records = compare_native(args.rounds)
        print(compare_table(records).replace("reference µs", "Python lists µs").replace("this tree µs", "native µs"))
    else:
        records = compare(args.against, args.rounds) if args.against else run()
        print(compare_table(records) if args.against else table(records))
    if args.mask_tiles:
        print(f"mask tiles, 16k x 16k document mask: {mask_tiles_ms():.0f} ms")
    print(f"load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
