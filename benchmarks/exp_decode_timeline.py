"""EXPERIMENT: per-CTA timeline of the decode kernel at batch 1 (where the fixed cost of a small batch goes).

Needs a scratch copy of the tree with the instrumentation patch applied (the patch adds a `fg_timeline` array
that each CTA fills with %globaltimer stamps: entry, first tile landed, stream end, exit; and its SM id):

    rm -rf /tmp/tl && mkdir /tmp/tl && git archive HEAD | tar -x -C /tmp/tl
    (cd /tmp/tl && git apply benchmarks/exp_decode_timeline.patch && python3 benchmarks/exp_decode_timeline.py)

Prints, for B=1, page 16, L = 16k and 4k, after a write flush and after a read flush (see timing.FLUSH), the
percentiles of each phase over the CTAs, and the merging CTAs' merge time. Session 6's run is in NOTES.md.
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402
from flashgen import AttentionSpec, Paged  # noqa: E402

HQ, HKV, D = 32, 8, 128
SLOTS = 16384


def pct(x):
    return " ".join(f"{np.percentile(x, q):5.1f}" for q in (0, 10, 50, 90, 100))


def main():
    flush = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    for kv_len in (16384, 4096):
        ps = 16
        pages = kv_len // ps
        cache = torch.randn(pages, 2, ps, HKV, D, device="cuda", dtype=torch.bfloat16)
        ids = torch.randperm(pages, dtype=torch.int32).cuda()
        w = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(ps)))
        w.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=np.array([0, pages], np.int32), kv_indices=ids,
               kv_last_page_len=np.array([ps], np.int32))
        q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = w.run(q, cache)
        module = cu.cuFuncGetModule(w._decode.handle)[1]
        _, dptr, size = cu.cuModuleGetGlobal(module, b"fg_timeline")
        for mode in ("write", "read", "write", "read"):
            host = np.zeros(SLOTS * 6, dtype=np.uint64)
            cu.cuMemsetD8(dptr, 0, size)
            torch.cuda.synchronize()
            if mode == "write":
                flush.zero_()
            else:
                flush.view(torch.int32).sum(dtype=torch.int32)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            w.run(q, cache, out=out)
            end.record()
            end.synchronize()
            event_us = start.elapsed_time(end) * 1e3
            cu.cuMemcpyDtoH(host.ctypes.data, dptr, size)
            t = host.reshape(SLOTS, 6)
            t = t[t[:, 0] > 0].astype(np.int64)
            t0 = t[:, 0].min()
            begin, first, done, leave = [(t[:, i] - t0) / 1e3 for i in range(4)]
            merged = t[:, 5] == 1
            print(f"L={kv_len} {mode:5} event {event_us:5.1f} us, {len(t)} CTAs, span {leave.max():5.1f} us; "
                  "percentiles 0/10/50/90/100:")
            print(f"   start      {pct(begin)}")
            print(f"   first tile {pct(first)}   (latency {pct(first - begin)})")
            print(f"   stream end {pct(done)}   (stream {pct(done - first)})")
            print(f"   exit       {pct(leave)}   merging CTAs: n={merged.sum()} exit {pct(leave[merged])} "
                  f"merge {pct((leave - done)[merged])}")
            print(f"   CTAs an SM: {np.bincount(np.bincount(t[:, 4], minlength=132))}")


if __name__ == "__main__":
    main()
