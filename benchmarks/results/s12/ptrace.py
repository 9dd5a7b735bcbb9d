"""Per-CTA clock64 / globaltimer stamps of the portable prefill (this tree's patched prefill_kernel.cuh)."""
import sys
from pathlib import Path
import numpy as np
import torch
REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "benchmarks"))
import flashgen, flashgen.runtime as runtime
from flashgen import AttentionSpec, NoMask, Causal, Ragged
from cuda.bindings import driver as cu
from flashgen.runtime.driver import check
from timing import timed
modules = []
_init = runtime.Module.__init__
def _rec(self, cubin, device):
    _init(self, cubin, device); modules.append(self)
runtime.Module.__init__ = _rec
HQ, HKV, D = 32, 8, 128
for B, S, maskname in [(4, 4096, "none"), (1, 16384, "none")]:
    q = torch.randn(B * S, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B * S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    indptr = np.arange(B + 1) * S
    w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=NoMask()), backend="portable")
    w.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV)
    out = torch.empty_like(q)
    us = timed(lambda: w.run(q, (k, v), out=out), 8)
    found = [cu.cuModuleGetGlobal(m.handle, b"flashgen_prefill_trace") for m in modules]
    found = [(p, s) for e, p, s in found if e == cu.CUresult.CUDA_SUCCESS]
    ptr, size = found[-1]
    check(cu.cuMemsetD8(ptr, 0, size), "memset")
    w.run(q, (k, v), out=out); torch.cuda.synchronize()
    host = np.zeros(size // 8, dtype=np.uint64)
    check(cu.cuMemcpyDtoH(host.ctypes.data, ptr, size), "DtoH")
    st = host.reshape(-1, 16).astype(np.int64)
    n = B * S // 32 * HKV
    st = st[:n]
    ok = st[:, 0] != 0
    st = st[ok]
    tiles = S // 64
    c = st[:, :11]
    d = lambda a, b: c[:, b] - c[:, a]
    print(f"{B}x{S} {maskname}: kernel {us:.1f} us, {len(st)} CTAs, {tiles} tiles a CTA; cycles, median [p10, p90]")
    for name, x in [("request_idx load", d(0, 1)), ("qo_indptr/kv_len loads", d(1, 2)), ("thread-0 src, rest loads", d(2, 3)),
                    ("q_pos + load_q issue", d(3, 4)), ("barrier", d(4, 5)), ("prologue issue + first tile in", d(5, 6)),
                    ("loop", d(6, 7)), ("loop / tile", d(6, 7) / tiles), ("stats load", d(7, 8)), ("write_rows (thread 0)", d(8, 9)),
                    ("barrier after rows", d(9, 10)), ("entry to first tile", d(0, 6)), ("total", d(0, 10))]:
        print(f"  {name:22} {np.median(x):9.0f} [{np.percentile(x, 10):9.0f}, {np.percentile(x, 90):9.0f}]")
    # per SM: the globaltimer gap between a CTA's end and the next CTA's start on the same SM (ns)
    sm, t0, t1 = st[:, 13], st[:, 14], st[:, 15]
    gaps, conc = [], []
    kstart, kend = t0.min(), t1.max()
    for s_ in np.unique(sm):
        sel = np.where(sm == s_)[0]
        starts, ends = np.sort(t0[sel]), np.sort(t1[sel])
        # each start after the first two: the gap to the latest end before it
        for st_ in starts[2:]:
            prev = ends[ends <= st_]
            if len(prev): gaps.append(st_ - prev.max())
    gaps = np.array(gaps)
    print(f"  kernel span by globaltimer {(kend - kstart) / 1e3:.1f} us; CTA start gap after a predecessor's end (ns): median {np.median(gaps):.0f} p90 {np.percentile(gaps, 90):.0f}")
    dur = (t1 - t0)
    last = t1 >= np.percentile(t1, 0)  # all
    tail_start = np.sort(t0)[-(len(t0) % 264 or 264)]
    print(f"  CTA duration (us) median {np.median(dur) / 1e3:.1f}; last-wave CTAs ({len(t0) % 264}) median {np.median(dur[t0 >= tail_start]) / 1e3:.1f}; "
          f"last start -> kernel end {(kend - t0.max()) / 1e3:.1f} us")
