"""Shared-prefix decode: flashgen's CascadeWrapper against flashgen's flat decode over the same pages, FlashInfer's
MultiLevelCascadeAttentionWrapper and its flat tensor-core decode (where flashinfer imports), in one run.

Batch 128 decoding requests, each with its own 256-token suffix after one shared prefix of 1k / 4k / 32k tokens;
bf16, 32 q / 8 kv heads, head_dim 128, page 16, pages in random order (one K+V tensor ``[pages, 2, 16, 8, 128]``).
flashgen's cascade derives its levels from the per-request page tables (host ids); FlashInfer's gets the two levels
(prefix, suffixes) by hand. Calls are timed round-robin after an L2 flush (timing.timed_interleaved, median of
--reps). Reported per prefix: µs, the speed-up over flashgen's flat decode and over FlashInfer's cascade (above 1:
faster), and % of the copy rate for the bytes a cascade must move (the unique KV read once, q read, out written);
also plan() host time and the levels the cost model ran (``sm90x4``: a shared level split into 4 chunks of its keys
on the Hopper kernel). ``--check`` first compares the cascade's output with flat decode's (and exits non-zero past
a bf16 bound); ``--prefill-backend portable`` gives the shared levels to the portable kernel (no split), as before
the split; ``--chunks S`` fixes the split (``CascadePolicy.chunks``) to compare with the rule's.

    PYTHONPATH=$PWD python3 benchmarks/bench_cascade.py --out cascade.json --check
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
import timing  # noqa: E402
from timing import commit, copy_rate, host_calls_us, median, save_results, timed_interleaved  # noqa: E402
from flashgen import AttentionSpec, Causal, Paged  # noqa: E402

HQ, HKV, D = 32, 8, 128
BYTES_PER_TOKEN = 2 * HKV * D * 2  # K + V, bf16


def shared_batch(batch: int, prefix: int, suffix: int, page_size: int, gen: torch.Generator) -> dict:
    """Page tables of ``batch`` requests over one shared prefix (whole pages) then a suffix each, pages in random
    order."""
    if prefix % page_size:
        raise SystemExit(f"--prefixes: {prefix} is not a multiple of the page size {page_size} (a shared prefix "
                         "is whole pages)")
    prefix_pages, suffix_pages = prefix // page_size, -(-suffix // page_size)
    total = prefix_pages + batch * suffix_pages
    perm = torch.randperm(total, generator=gen).numpy().astype(np.int32)
    shared, own = perm[:prefix_pages], perm[prefix_pages:].reshape(batch, suffix_pages)
    indices = np.concatenate([np.concatenate([shared, own[b]]) for b in range(batch)])
    last = suffix - (suffix_pages - 1) * page_size
    return {"num_pages": total, "prefix_pages": prefix_pages, "shared": shared, "own": own,
            "kv_indptr": np.arange(batch + 1, dtype=np.int32) * (prefix_pages + suffix_pages),
            "kv_indices": indices, "kv_last_page_len": np.full(batch, last, np.int32), "suffix_last": last}


def flashgen_cascade(q, cache, t, batch, page_size, prefill_backend="auto", chunks=None):
    wrapper = flashgen.CascadeWrapper(AttentionSpec(D, kv_layout=Paged(page_size), mask=Causal()),
                                      prefill_backend=prefill_backend)
    args = dict(qo_indptr=np.arange(batch + 1), kv_indptr=t["kv_indptr"], kv_indices=t["kv_indices"],
                kv_last_page_len=t["kv_last_page_len"], num_qo_heads=HQ, num_kv_heads=HKV,
                policy=flashgen.CascadePolicy(chunks=chunks))
    plan_us = median(host_calls_us(lambda: wrapper.plan(**args), 11)[1:])
    out = torch.empty_like(q)
    return wrapper, (lambda: wrapper.run(q, cache, out=out)), plan_us


def flashgen_flat(q, cache, t, page_size):
    wrapper = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(page_size)))
    indices = torch.from_numpy(t["kv_indices"]).cuda()
    wrapper.plan(kv_indptr=t["kv_indptr"], kv_indices=indices, kv_last_page_len=t["kv_last_page_len"],
                 num_qo_heads=HQ, num_kv_heads=HKV)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, cache, out=out)


def flashinfer_cascade(q, cache, t, batch, page_size, workspace):
    import flashinfer

    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
    cuda = lambda a: torch.as_tensor(np.asarray(a, np.int32)).cuda()  # noqa: E731
    suffix_pages = t["own"].shape[1]
    wrapper.plan([cuda([0, batch]), cuda(np.arange(batch + 1))],
                 [cuda([0, t["prefix_pages"]]), cuda(np.arange(batch + 1) * suffix_pages)],
                 [cuda(t["shared"]), cuda(t["own"].reshape(-1))],
                 [cuda([page_size]), cuda(np.full(batch, t["suffix_last"]))],
                 HQ, HKV, D, page_size, causal=True, q_data_type=torch.bfloat16)
    return lambda: wrapper.run(q, cache)


def flashinfer_flat(q, cache, t, page_size, workspace):
    import flashinfer

    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    cuda = lambda a: torch.as_tensor(np.asarray(a, np.int32)).cuda()  # noqa: E731
    wrapper.plan(cuda(t["kv_indptr"]), cuda(t["kv_indices"]), cuda(t["kv_last_page_len"]), HQ, HKV, D, page_size,
                 q_data_type=torch.bfloat16)
    return lambda: wrapper.run(q, cache)


def check(cascade, flat) -> float:
    """Max |cascade - flat| over max |flat|; exits past 4 bf16 roundoffs of the output (a wrong level shows as
    O(1))."""
    got, want = cascade().float(), flat().float()
    rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    bad = not rel <= 4 * 2.0**-8 or bool(got.isnan().any())
    print(f"  check: max |cascade - flat| / max |flat| = {rel:.2e}" + ("  FAILED" if bad else ""), flush=True)
    if bad:
        raise SystemExit("bench_cascade --check: the cascade's output differs from flat decode's")
    return rel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="cascade.json")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--prefixes", default="1024,4096,32768")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--peers", default="flashinfer", help="flashinfer, or empty for flashgen alone")
    parser.add_argument("--check", action="store_true", help="compare the cascade with flat decode before timing")
    parser.add_argument("--flush", choices=("write", "read", "none"), default="write")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")
    parser.add_argument("--prefill-backend", choices=("auto", "portable", "sm90"), default="auto",
                        help="CascadeWrapper's prefill_backend (the shared levels' kernel)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="CascadePolicy.chunks: the chunks a shared level splits into on sm90 (default: the rule)")
    args = parser.parse_args()
    timing.FLUSH = args.flush
    peers = set(filter(None, args.peers.split(",")))
    if "flashinfer" in peers:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
            print(f"flashinfer not importable: {exc!r}")
            peers.discard("flashinfer")
    gen = torch.Generator().manual_seed(0)
    copy_gbps = copy_rate()
    print(f"copy rate {copy_gbps:.0f} GB/s", flush=True)
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if "flashinfer" in peers else None
    batch, page = args.batch, args.page_size
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    rows = []
    for prefix in (int(p) for p in args.prefixes.split(",")):
        t = shared_batch(batch, prefix, args.suffix, page, gen)
        cache = torch.randn(t["num_pages"], 2, page, HKV, D, device="cuda", dtype=torch.bfloat16)
        wrapper, cascade, plan_us = flashgen_cascade(q, cache, t, batch, page, args.prefill_backend, args.chunks)
        calls = {"flashgen-cascade": cascade, "flashgen-flat": flashgen_flat(q, cache, t, page)}
        if "flashinfer" in peers:
            try:
                calls["flashinfer-cascade"] = flashinfer_cascade(q, cache, t, batch, page, workspace)
                calls["flashinfer-flat-tc"] = flashinfer_flat(q, cache, t, page, workspace)
            except Exception as exc:  # noqa: BLE001 - report and go on without the peer
                print(f"flashinfer failed: {exc!r}")
                peers.discard("flashinfer")
                calls = {k: v for k, v in calls.items() if not k.startswith("flashinfer")}
        levels = [r.runs if r.chunks == 1 else f"{r.runs}x{r.chunks}" for r in wrapper.levels]
        print(f"prefix {prefix}: levels {levels}, plan {plan_us:.0f} us", flush=True)
        rel = check(cascade, calls["flashgen-flat"]) if args.check else None
        times = dict(zip(calls, timed_interleaved(list(calls.values()), args.reps)))
        moved = (prefix + batch * args.suffix) * BYTES_PER_TOKEN + 2 * q.numel() * q.element_size()
        for peer, us in times.items():
            row = {"peer": peer, "prefix": prefix, "batch": batch, "suffix": args.suffix, "page_size": page, "us": us,
                   "vs_flat": times["flashgen-flat"] / us, "pct_copy_once": 100 * moved / us / 1e3 / copy_gbps}
            if "flashinfer-cascade" in times:
                row["vs_flashinfer_cascade"] = times["flashinfer-cascade"] / us
            if peer == "flashgen-cascade":
                row.update(levels=levels, plan_us=plan_us, check_rel_err=rel)
            rows.append(row)
            print(f"  {peer:20} {us:9.1f} us  {row['vs_flat']:6.2f}x flat  "
                  f"{row['pct_copy_once']:6.1f} % of copy (bytes once)", flush=True)
        del cache
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit(args.commit),
              "copy_GBps": copy_gbps, "flush": args.flush, "prefill_backend": args.prefill_backend,
              "chunks": args.chunks,
              "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D}, "rows": rows}
    save_results(result, Path(args.out), markdown, lambda result, path: None)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# Cascade decode, {result['device']}, {result['date']}, commit {result['commit']}",
             f"bf16, {HQ} q / {HKV} kv heads, d={D}, batch {rows[0]['batch']}, suffix {rows[0]['suffix']}, "
             f"page {rows[0]['page_size']}; copy rate {result['copy_GBps']:.0f} GB/s", "",
             "| prefix | peer | µs | x flat | x FlashInfer cascade | % copy (bytes once) | levels | plan µs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fi = f"{r['vs_flashinfer_cascade']:.2f}" if "vs_flashinfer_cascade" in r else "–"
        levels = "/".join(r.get("levels", [])) or "–"
        plan = f"{r['plan_us']:.0f}" if "plan_us" in r else "–"
        lines.append(f"| {r['prefix']} | {r['peer']} | {r['us']:.1f} | {r['vs_flat']:.2f} | {fi} | "
                     f"{r['pct_copy_once']:.1f} | {levels} | {plan} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
