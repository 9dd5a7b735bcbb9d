"""Host time of the wrappers' ``plan()`` and ``run()``: flashgen beside FlashInfer for the same batches, in one
process, on a GPU machine.

Cases (bf16, 32 q / 8 kv heads, head_dim 128):
  decode    B = 1, 8, 64, 256 requests of --kv-len (4096) KV tokens, page 16, pages in random order; page ids
            (``kv_indices``) on the device, lengths (``kv_indptr``, ``kv_last_page_len``) on the host.
            flashgen.BatchDecodeWrapper against FlashInfer's BatchDecodeWithPagedKVCacheWrapper (tensor cores).
  prefill   1 x 128 and 16 x 1024 (requests x tokens, q len = kv len), ragged KV, causal; indptr arrays on the host.
            flashgen.BatchPrefillWrapper, backends portable and (on a compute-capability 9.0 GPU) sm90, against
            FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, backends fa2 and (on Hopper) fa3.

Every contender of a case is set up first (wrapper built, planned, run once); then --rounds rounds, each timing
every contender in turn: --calls back-to-back ``plan()`` calls, then --calls back-to-back ``run()`` calls (the
GPU runs behind; nothing synchronises inside a block, the blocks are separated by a synchronize). Before the
rounds each contender makes --warmup ``plan()`` and ``run()`` calls. Reported: the median over all timed calls,
and the range of the rounds' medians. ``run()`` is given ``out=`` on both sides (FlashInfer's where its
``run()`` takes it), so neither allocates its output.

Host timings on the H200 machine move 1.5-2x between processes with the core the process lands on
(docs/performance.md, "Host time"): ``--pin CPU`` pins the process to one core (os.sched_setaffinity, before
CUDA starts; threads started later inherit it); compare trees by alternating processes pinned to the same core.
Only flashgen's public API is used. FlashInfer is optional: where it does not import, only flashgen is timed.
Carry FlashInfer's wheels to the GPU machine as for the other benchmarks (benchmarks/gpu_session.sh; the peers'
anchor figures used 0.6.8.post1); the version imported is recorded in the JSON. Its fa3 backend builds its
module on first use (minutes, once a machine).

    python3 benchmarks/bench_host.py --out benchmarks/results/host.json --pin 3
    python3 benchmarks/bench_host.py --decode-batches 8 --prefill-shapes 1x128 --peers fa2   # a quick look
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import commit, host_calls_us, median, save_results  # noqa: E402
from flashgen import AttentionSpec, Causal, Paged, Ragged  # noqa: E402

HQ, HKV, D = 32, 8, 128
WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's float workspace, as bench_decode.py and bench_prefill.py give it


@dataclass
class Contender:
    name: str  # flashgen, flashgen-portable, flashgen-sm90, flashinfer, flashinfer-fa2, flashinfer-fa3
    plan: Callable[[], object]
    run: Callable[[], object]


def flashinfer_module():
    """FlashInfer, or None (with a note) where it does not import."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
        print(f"flashinfer not importable ({exc!r}): timing flashgen only", flush=True)
        return None
    return flashinfer


def takes_out(run) -> bool:
    """Whether a FlashInfer ``run`` accepts ``out=`` (it does from 0.2 on; checked, not assumed)."""
    try:
        return "out" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False


def decode_contenders(batch: int, kv_len: int, page: int, fi) -> list[Contender]:
    """flashgen's and FlashInfer's decode wrappers for ``batch`` requests of ``kv_len`` tokens in pages of ``page``."""
    pages_per = -(-kv_len // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(batch * pages_per, generator=torch.Generator().manual_seed(batch)).to(torch.int32).cuda()
    last = torch.full((batch,), kv_len - (pages_per - 1) * page, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(batch * pages_per, 2, page, HKV, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    found = []

    def ours():
        w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(page)))
        return Contender("flashgen",
                         lambda: w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices,
                                        kv_last_page_len=last),
                         lambda: w.run(q, cache, out=out))

    def theirs():
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        extra = {"out": out} if takes_out(w.run) else {}
        return Contender("flashinfer",
                         lambda: w.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=torch.bfloat16),
                         lambda: w.run(q, cache, **extra))

    attempt(found, "flashgen", ours)
    if fi is not None:
        attempt(found, "flashinfer", theirs)
    return found


def prefill_contenders(batch: int, seqlen: int, backends: list[str], fi_backends: list[str], fi) -> list[Contender]:
    """flashgen's prefill wrapper per backend and FlashInfer's ragged wrapper per backend, ragged causal KV."""
    tokens = batch * seqlen
    indptr = np.arange(batch + 1) * seqlen
    indptr_t = torch.from_numpy(indptr).to(torch.int32)  # on the host, as FlashInfer's plan() wants it
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    found = []

    def ours(backend):
        w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=Causal()), backend=backend)
        return Contender(f"flashgen-{backend}",
                         lambda: w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV),
                         lambda: w.run(q, (k, v), out=out))

    def theirs(backend):
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        extra = {"out": out} if takes_out(w.run) else {}
        return Contender(f"flashinfer-{backend}",
                         lambda: w.plan(indptr_t, indptr_t, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16),
                         lambda: w.run(q, k, v, **extra))

    for backend in backends:
        attempt(found, f"flashgen-{backend}", lambda: ours(backend))
    for backend in fi_backends if fi is not None else []:
        attempt(found, f"flashinfer-{backend}", lambda: theirs(backend))
    return found


def attempt(found: list, name: str, setup) -> None:
    """Build a contender, plan and run it once; a failure is reported and the contender left out, never fatal."""
    try:
        contender = setup()
        contender.plan()
        contender.run()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"{name} failed: {exc!r}"[:300], flush=True)
        return
    found.append(contender)


def measure(contenders: list[Contender], args) -> dict[str, dict]:
    """Per contender: ``plan_us`` and ``run_us``, the median of every timed call, and ``plan_round_us`` and
    ``run_round_us``, each round's median."""
    for c in contenders:
        for fn in (c.plan, c.run):
            host_calls_us(fn, args.warmup)
            torch.cuda.synchronize()
    blocks: dict[tuple[str, str], list[list[float]]] = {(c.name, w): [] for c in contenders for w in ("plan", "run")}
    for _ in range(args.rounds):
        for c in contenders:
            for what, fn in (("plan", c.plan), ("run", c.run)):
                torch.cuda.synchronize()
                blocks[c.name, what].append(host_calls_us(fn, args.calls, args.no_gc))
            torch.cuda.synchronize()
    got: dict[str, dict] = {c.name: {} for c in contenders}
    for (name, what), timed in blocks.items():
        got[name][f"{what}_us"] = median([t for block in timed for t in block])
        got[name][f"{what}_round_us"] = [median(block) for block in timed]
    return got


def cases(args, hopper: bool, fi):
    """(case name, fields, contenders) for each decode batch and prefill shape asked for."""
    for batch in args.decode_batches:
        yield f"decode B={batch}", {"kind": "decode", "batch": batch, "kv_len": args.kv_len}, \
            lambda b=batch: decode_contenders(b, args.kv_len, args.page_size, fi)
    fi_backends = [b for b in args.peers if b == "fa2" or (b == "fa3" and hopper)]
    for batch, seqlen in args.prefill_shapes:
        yield f"prefill {batch}x{seqlen}", {"kind": "prefill", "batch": batch, "seqlen": seqlen}, \
            lambda b=batch, s=seqlen: prefill_contenders(b, s, args.backends, fi_backends, fi)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="host.json", help="JSON path; the markdown table goes beside it (.md)")
    parser.add_argument("--decode-batches", default="1,8,64,256")
    parser.add_argument("--prefill-shapes", default="1x128,16x1024", help="requests x tokens, comma-separated")
    parser.add_argument("--kv-len", type=int, default=4096, help="decode KV tokens a request")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--backends", default=None,
                        help="flashgen prefill backends (default: portable, and sm90 on compute capability 9.0)")
    parser.add_argument("--peers", default="fa2,fa3",
                        help="FlashInfer prefill backends: fa2, fa3 (fa3 on Hopper only); '' for none")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100, help="timed calls a block (plan or run) a round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pin", type=int, default=None, help="pin the process to this CPU core")
    parser.add_argument("--no-gc", action="store_true", help="the garbage collector off while timed")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")
    args = parser.parse_args()
    args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
    args.prefill_shapes = [tuple(int(n) for n in s.split("x")) for s in args.prefill_shapes.split(",") if s]
    args.peers = [p for p in args.peers.split(",") if p]
    unknown = set(args.peers) - {"fa2", "fa3"}
    if unknown:
        parser.error(f"--peers: unknown {sorted(unknown)}, expected some of fa2, fa3")
    return args


def main() -> None:
    args = parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})  # before CUDA starts, so that its threads inherit the mask
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if args.backends is None:
        args.backends = ["portable"] + (["sm90"] if hopper else [])
    else:
        args.backends = [b for b in args.backends.split(",") if b]
    fi = flashinfer_module()
    rows = []
    for case, fields, setup in cases(args, hopper, fi):
        contenders = setup()
        for name, got in measure(contenders, args).items():
            rows.append({"case": case, **fields, "contender": name, **got})
            print(f"{case:17} {name:18} plan {got['plan_us']:8.1f} us  run {got['run_us']:6.1f} us", flush=True)
        del contenders
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit(args.commit),
              "flashinfer": getattr(fi, "__version__", "unknown") if fi is not None else None,
              "torch": torch.__version__, "pinned_cpu": args.pin, "no_gc": args.no_gc, "rounds": args.rounds,
              "calls": args.calls, "warmup": args.warmup, "page_size": args.page_size,
              "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D}, "rows": rows}
    save_results(result, Path(args.out), markdown, lambda result, path: None)


PAIRS = {"flashgen": ["flashinfer"], "flashgen-portable": ["flashinfer-fa2"],
         "flashgen-sm90": ["flashinfer-fa3", "flashinfer-fa2"]}  # the peer each flashgen row is set against


def cell(row: dict | None, what: str) -> str:
    if row is None:
        return "–"
    rounds = row[f"{what}_round_us"]
    return f"{row[f'{what}_us']:.1f} [{min(rounds):.0f}-{max(rounds):.0f}]"


def ratio(ours: dict, theirs: dict | None, what: str) -> str:
    return f"{ours[f'{what}_us'] / theirs[f'{what}_us']:.2f}" if theirs else "–"


def markdown(result: dict) -> str:
    pin = f"pinned to CPU {result['pinned_cpu']}" if result["pinned_cpu"] is not None else "not pinned"
    lines = [f"# Host time of plan() and run(), {result['device']}, {result['date']}, commit {result['commit']}",
             f"bf16, {HQ} q / {HKV} kv heads, d={D}; FlashInfer {result['flashinfer'] or 'not importable'}; {pin}; "
             f"{result['rounds']} rounds of {result['calls']} calls after {result['warmup']} warm-up calls. "
             "Cells: median µs of every timed call [range of the rounds' medians]; ratio = flashgen / FlashInfer "
             "(below 1: flashgen takes less host time).", "",
             "| case | flashgen | peer | plan flashgen | plan peer | ratio | run flashgen | run peer | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_case: dict[str, dict[str, dict]] = {}
    for row in result["rows"]:
        by_case.setdefault(row["case"], {})[row["contender"]] = row
    for case, got in by_case.items():
        for name, ours in got.items():
            if name not in PAIRS:
                continue
            peer = next((p for p in PAIRS[name] if p in got), None)
            theirs = got.get(peer) if peer else None
            lines.append(f"| {case} | {name} | {peer or '–'} | {cell(ours, 'plan')} | {cell(theirs, 'plan')} | "
                         f"{ratio(ours, theirs, 'plan')} | {cell(ours, 'run')} | {cell(theirs, 'run')} | "
                         f"{ratio(ours, theirs, 'run')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
