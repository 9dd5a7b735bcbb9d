"""Mixed prefill batches (requests of different lengths in one call, as a serving engine's step has them):
flashgen's backends against FlashInfer (FA2, and FA3 on Hopper) in one run, ragged KV, bf16, 32 q / 8 kv heads.

The uniform shapes of bench_prefill.py give every work item the same length, so the order in which a kernel
starts its items and the last wave's fill barely matter there; here they do. Batches (qo tokens x kv tokens):

  long+short   1 x (8192 x 8192) + 31 x (256 x 256): one long prompt among short ones
  append       4 x (1024 x 16384): chunked prefill, 1024 new tokens onto 15k of context each
  mixed        8 x (2048 x 2048) + 64 x (128 x 128)

Masks: none, and causal aligned to the KV end (query i of a request sees kv_len - qo_len + i + 1 keys). TFLOP/s
counts the visible pairs exactly (4 * heads * head_dim * pairs). Each row's calls are timed round-robin after an
L2 flush (timing.timed_interleaved): the median of --reps. Output: JSON, markdown table.

    python3 benchmarks/bench_prefill_mixed.py --out benchmarks/results/prefill-mixed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import commit, timed_interleaved  # noqa: E402
from flashgen import AttentionSpec, Causal, NoMask, Ragged  # noqa: E402

HQ, HKV, D = 32, 8, 128
BATCHES = {
    "long+short": ([8192] + [256] * 31, [8192] + [256] * 31),
    "append": ([1024] * 4, [16384] * 4),
    "mixed": ([2048] * 8 + [128] * 64, [2048] * 8 + [128] * 64),
}


def visible_pairs(qo: list[int], kv: list[int], causal: bool) -> int:
    if not causal:
        return sum(a * b for a, b in zip(qo, kv))
    # query i sees kv - qo + i + 1 keys (capped at kv, at least 0)
    return sum(int(np.clip(np.arange(a) + b - a + 1, 0, b).sum()) for a, b in zip(qo, kv))


def bench_flashgen(q, k, v, qo_indptr, kv_indptr, causal, backend):
    spec = AttentionSpec(D, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
    wrapper = flashgen.BatchPrefillWrapper(spec, backend=backend)
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k, v), out=out)


def bench_flashinfer(q, k, v, qo_indptr, kv_indptr, causal, backend):
    import flashinfer

    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(torch.as_tensor(qo_indptr, dtype=torch.int32).cuda(), torch.as_tensor(kv_indptr, dtype=torch.int32).cuda(),
           HQ, HKV, D, causal=causal, q_data_type=torch.bfloat16)
    return lambda: w.run(q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="prefill-mixed.json")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batches", default=",".join(BATCHES))
    parser.add_argument("--peers", default="flashinfer,flashinfer-fa3", help="some of flashinfer, flashinfer-fa3")
    parser.add_argument("--backends", default=None, help="flashgen backends (default: portable, and sm90 on Hopper)")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")
    args = parser.parse_args()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    backends = args.backends.split(",") if args.backends else ["portable"] + (["sm90"] if hopper else [])
    peers = set(args.peers.split(",")) if args.peers else set()
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
        print(f"flashinfer not importable: {exc!r}")
        peers.clear()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.batches.split(","):
        qo, kv = BATCHES[name]
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
        q = torch.randn(int(qo_indptr[-1]), HQ, D, generator=gen).to("cuda", torch.bfloat16)
        k, v = (torch.randn(int(kv_indptr[-1]), HKV, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            calls = [(f"flashgen-{b}", bench_flashgen(q, k, v, qo_indptr, kv_indptr, causal, b)) for b in backends]
            for peer, backend in (("flashinfer", "fa2"), ("flashinfer-fa3", "fa3")):
                if peer in peers and (backend == "fa2" or hopper):
                    try:
                        calls.append((peer, bench_flashinfer(q, k, v, qo_indptr, kv_indptr, causal, backend)))
                    except Exception as exc:  # noqa: BLE001 - a peer failing is reported, never fatal
                        print(f"{peer} failed: {exc!r}"[:300])
            times = timed_interleaved([fn for _, fn in calls], args.reps)
            flops = 4 * HQ * D * visible_pairs(qo, kv, causal)
            mask = "causal" if causal else "none"
            for (peer, _), us in zip(calls, times):
                rows.append({"batch": name, "mask": mask, "peer": peer, "us": us, "TFLOPs": flops / us / 1e6})
                print(f"{name:11} {mask:6} {peer:17} {us:9.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "commit": commit(args.commit), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    peers_seen = sorted({r["peer"] for r in rows})
    lines = ["| batch | mask | " + " | ".join(peers_seen) + " |", "|---|---|" + "---|" * len(peers_seen)]
    for name in args.batches.split(","):
        for mask in ("none", "causal"):
            cell = {r["peer"]: r["TFLOPs"] for r in rows if r["batch"] == name and r["mask"] == mask}
            lines.append(f"| {name} | {mask} | " + " | ".join(f"{cell[p]:.0f}" if p in cell else "-" for p in peers_seen) + " |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
