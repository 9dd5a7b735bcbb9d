"""Block-sparse attention benchmark: flashgen's BlockSparseWrapper against flashgen's dense prefill, FlashInfer's
block-sparse wrappers and FlexAttention with a block mask, in one run.

bf16, M = N = 16384, R = C = 64, head_dim 128, 32 q / 8 kv heads (FlashInfer's BlockSparseAttentionWrapper takes
GQA; --heads 32/32 adds equal heads), random kept blocks at densities 10 % and 100 % (every block row keeps at
least one block). Contenders, each optional (a peer that does not import or fails is reported and left out):

- ``flashgen-bsr-<backend>``: ``BlockSparseWrapper`` (backend auto: the sm90 kernel on Hopper; and portable);
- ``flashgen-dense-<backend>``: ``BatchPrefillWrapper``, one NoMask request of M x N: the baseline;
- ``flashgen-var``: ``VariableBlockSparseWrapper`` on the same pattern (every kv head the same; its q and out
  regrouping per kv head included in the time);
- ``flashinfer-bsr``: ``flashinfer.BlockSparseAttentionWrapper``; ``flashinfer-var``: its
  ``VariableBlockSparseAttentionWrapper`` (every kv head the same pattern; q, k, v in its HND layout, prepared
  outside the timing);
- ``flex``: ``torch.compile(flex_attention)`` with a ``create_block_mask`` BlockMask of R x C blocks (128 x 128,
  the default, if R x C is refused; its mask_mod reads the block table).

Every timed call follows an L2 flush; the peers of one configuration are timed round-robin (benchmarks/timing.py).
Reported: ms, effective TFLOP/s (4 x Hq x D x the kept blocks' R x C query-key pairs, clipped at the M / N edges;
dense: 4 x Hq x D x M x N), the ratio of effective TFLOP/s to FlashInfer's block-sparse wrapper and the time
relative to flashgen's dense prefill of the same backend. ``--check`` first compares flashgen's output with the
fp64 reference (dense attention under the block mask) on a sample of block rows. Prints a table; ``--out`` also
writes JSON.

    PYTHONPATH=$PWD python3 benchmarks/bench_sparse.py --check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import commit, timed_interleaved  # noqa: E402
from flashgen import AttentionSpec, Paged, Ragged  # noqa: E402
from flashgen.api.backends import kernels_for  # noqa: E402
from flashgen.spec import BlockSparse  # noqa: E402
from flashgen.testing.check import assert_matches_reference  # noqa: E402

D = 128
SPEC = AttentionSpec(D, kv_layout=Ragged())  # BlockSparseWrapper reads head_dim and dtypes; dense: ragged KV


def pattern(rows: int, cols: int, density: float, rng: np.random.Generator):
    """Random kept blocks, about ``density`` of them, every block row at least one: ``(indptr, indices, keep
    [rows, cols] bool)``."""
    keep = rng.random((rows, cols)) < density
    keep[np.arange(rows), rng.integers(0, cols, rows)] = True
    indptr = np.concatenate([[0], np.cumsum(keep.sum(1))]).astype(np.int32)
    return indptr, (np.flatnonzero(keep.reshape(-1)) % cols).astype(np.int32), keep


def kept_pairs(keep: np.ndarray, m: int, n: int, r: int, c: int) -> int:
    """Query-key pairs the kept blocks cover, clipped at the M / N edges."""
    rows = np.minimum(r, m - np.arange(keep.shape[0]) * r)
    cols = np.minimum(c, n - np.arange(keep.shape[1]) * c)
    return int(rows @ keep.astype(np.int64) @ cols)


# ---------------------------------------------------------------------------------------------- contenders


def flashgen_bsr(backend, case):
    wrapper = flashgen.BlockSparseWrapper(SPEC, backend=backend)
    wrapper.plan(case["indptr"], case["indices"], case["M"], case["N"], case["R"], case["C"], case["hq"], case["hkv"])
    out = torch.empty_like(case["q"])
    fn = lambda: wrapper.run(case["q"], case["k"], case["v"], out=out)  # noqa: E731
    return fn, {"kernel": wrapper.backend}


def flashgen_dense(backend, case):
    wrapper = flashgen.BatchPrefillWrapper(SPEC, backend=backend)
    wrapper.plan(qo_indptr=[0, case["M"]], kv_indptr=[0, case["N"]], num_qo_heads=case["hq"], num_kv_heads=case["hkv"])
    out = torch.empty_like(case["q"])
    return (lambda: wrapper.run(case["q"], (case["k"], case["v"]), out=out)), {"kernel": wrapper.backend}


def block_sizes(case):
    """Row and column block sizes ``[Hkv, MB]``, ``[Hkv, NB]`` of the uniform pattern (the last ones clipped)."""
    rows, cols = case["keep"].shape
    row_sz = np.minimum(case["R"], case["M"] - np.arange(rows) * case["R"])
    col_sz = np.minimum(case["C"], case["N"] - np.arange(cols) * case["C"])
    return np.tile(row_sz, (case["hkv"], 1)), np.tile(col_sz, (case["hkv"], 1))


def flashgen_var(case):
    wrapper = flashgen.VariableBlockSparseWrapper(SPEC)
    keep = np.broadcast_to(case["keep"], (case["hkv"], *case["keep"].shape))
    wrapper.plan(keep, *block_sizes(case), case["hq"], case["hkv"])
    out = torch.empty_like(case["q"])
    fn = lambda: wrapper.run(case["q"], case["k"], case["v"], out=out)  # noqa: E731
    return fn, {"kernel": wrapper.backend}


def flashinfer_bsr(case):
    import flashinfer

    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BlockSparseAttentionWrapper(ws)
    args = (torch.from_numpy(case["indptr"]).cuda(), torch.from_numpy(case["indices"]).cuda(), case["M"], case["N"],
            case["R"], case["C"], case["hq"], case["hkv"], D)
    try:
        w.plan(*args, q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    except TypeError:  # versions without o_data_type
        w.plan(*args, q_data_type=torch.bfloat16)
    return lambda: w.run(case["q"], case["k"], case["v"])


def flashinfer_var(case):
    import flashinfer

    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.VariableBlockSparseAttentionWrapper(ws)
    hkv, (rows, cols) = case["hkv"], case["keep"].shape
    keep = torch.from_numpy(case["keep"]).cuda()[None].expand(hkv, rows, cols).contiguous()
    row_sz, col_sz = (torch.from_numpy(x).int().cuda() for x in block_sizes(case))
    w.plan(keep, row_sz, col_sz, case["hq"], hkv, D, q_data_type=torch.bfloat16)
    q, k, v = (x.transpose(0, 1).contiguous() for x in (case["q"], case["k"], case["v"]))  # HND, outside the timing
    return lambda: w.run(q, k, v)


_flex = None


def flex(case):
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    r, c = case["R"], case["C"]
    table = torch.from_numpy(case["keep"]).cuda()

    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx // r, kv_idx // c]

    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (case["q"], case["k"], case["v"]))
    extra = {}
    for block_size in ((r, c), None):  # the pattern's own blocks, else flex's default (128)
        try:
            kwargs = {} if block_size is None else {"BLOCK_SIZE": block_size}
            block_mask = create_block_mask(mask_mod, None, None, case["M"], case["N"], **kwargs)
            start = time.perf_counter()
            _flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)
            torch.cuda.synchronize()
            extra = {"compile_s": time.perf_counter() - start, "block": "x".join(map(str, block_size or (128, 128)))}
            break
        except Exception as exc:  # noqa: BLE001 - a block size flex refuses: try its default
            if block_size is None:
                raise
            print(f"flex: BLOCK_SIZE={block_size} failed ({exc!r:.120}); trying the default")
    return (lambda: _flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)), extra


# ---------------------------------------------------------------------------------------------- check


def check(case, backend, samples: int, rng: np.random.Generator) -> str:
    """flashgen's output on ``samples`` block rows (the first, the last, random ones) against the fp64 reference of
    those rows under the block mask; raises on a mismatch."""
    wrapper = flashgen.BlockSparseWrapper(SPEC, backend=backend)
    wrapper.plan(case["indptr"], case["indices"], case["M"], case["N"], case["R"], case["C"], case["hq"], case["hkv"])
    out, lse = wrapper.run(case["q"], case["k"], case["v"], return_lse=True)
    rows = len(case["indptr"]) - 1
    picked = sorted({0, rows - 1, *rng.integers(0, rows, max(samples - 2, 0)).tolist()})
    r, indptr, indices = case["R"], case["indptr"], case["indices"]
    for row in picked:
        a, b = row * r, min((row + 1) * r, case["M"])
        blocks = indices[indptr[row]: indptr[row + 1]]
        assert_matches_reference(SPEC.replace(kv_layout=BlockSparse(r, case["C"])), case["q"][a:b],
                                 (case["k"], case["v"]), out[a:b], lse[a:b], bsr=([0, blocks.size], blocks))
    return f"{wrapper.backend}: {len(picked)} block rows match the fp64 reference"


# ---------------------------------------------------------------------------------------------- main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--M", type=int, default=16384)
    parser.add_argument("--N", type=int, default=16384)
    parser.add_argument("--R", type=int, default=64)
    parser.add_argument("--C", type=int, default=64)
    parser.add_argument("--densities", default="0.1,1.0")
    parser.add_argument("--heads", default="32/8", help="q/kv head pairs, e.g. 32/8,32/32")
    parser.add_argument("--backends", default=None, help="flashgen backends (default: auto and portable on Hopper, "
                                                         "else portable)")
    parser.add_argument("--peers", default="flashgen-var,flashinfer,flashinfer-var,flex",
                        help="besides flashgen's block-sparse and dense rows: some of flashgen-var (its "
                             "VariableBlockSparseWrapper on the same pattern), flashinfer, flashinfer-var, flex")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--check", action="store_true", help="compare flashgen's output with the fp64 reference first")
    parser.add_argument("--check-rows", type=int, default=6, help="block rows --check compares")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")
    args = parser.parse_args()
    args.densities = [float(x) for x in args.densities.split(",")]
    args.heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    hopper = torch.cuda.get_device_capability() == (9, 0)
    args.backends = args.backends.split(",") if args.backends else (["auto", "portable"] if hopper else ["portable"])
    args.peers = set(args.peers.split(",")) if args.peers else set()
    return args


def compile_kernels(args) -> None:
    """The portable kernels of the dense and the paged spec, and the sm90 ones where a backend may pick them."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    jobs = set()
    for spec in (SPEC, SPEC.replace(kv_layout=Paged(args.C))):
        jobs.add((spec, "prefill"))
        if hopper and {"auto", "sm90"} & set(args.backends):
            jobs.update((kernel_spec, op) for op, kernel_spec in kernels_for(spec, "sm90"))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda job: flashgen.ensure_compiled(*job), jobs))
    print(f"compiled {len(jobs)} flashgen kernels in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    args = parse_args()
    compile_kernels(args)
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
        print(f"flashinfer not importable: {exc!r:.200}; its rows are left out")
        args.peers -= {"flashinfer", "flashinfer-var"}
    m, n, r, c = args.M, args.N, args.R, args.C
    rng, check_rng = np.random.default_rng(0), np.random.default_rng(1)  # patterns do not depend on --check
    rows = []
    for hq, hkv in args.heads:
        gen = torch.Generator(device="cuda").manual_seed(hq * 100 + hkv)
        q = torch.randn(m, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(n, hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        for density in args.densities:
            indptr, indices, keep = pattern(-(-m // r), -(-n // c), density, rng)
            case = dict(M=m, N=n, R=r, C=c, hq=hq, hkv=hkv, q=q, k=k, v=v, indptr=indptr, indices=indices, keep=keep)
            kept = kept_pairs(keep, m, n, r, c)
            if args.check:
                for backend in args.backends:
                    result = check(case, backend, args.check_rows, check_rng)
                    print(f"check {hq}/{hkv} density {density:.2f} {backend}: {result}", flush=True)
            rows += run_case(args, case, density, kept)
        del q, k, v
    print(table(rows, args))
    if args.out:
        result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                  "commit": commit(args.commit), "shape": {"M": m, "N": n, "R": r, "C": c, "head_dim": D}, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))


def run_case(args, case, density: float, kept: int) -> list[dict]:
    calls = []  # (name, fn, extra, pairs): every contender set up first, then timed round-robin

    def attempt(name, setup, pairs):
        try:
            out = setup()
            fn, extra = out if isinstance(out, tuple) else (out, {})
            fn()
            torch.cuda.synchronize()
            calls.append((name, fn, extra, pairs))
        except Exception as exc:  # noqa: BLE001 - a contender failing is reported, never fatal
            print(f"{name} failed: {exc!r}"[:300], flush=True)

    for backend in args.backends:
        attempt(f"flashgen-bsr-{backend}", lambda: flashgen_bsr(backend, case), kept)
        attempt(f"flashgen-dense-{backend}", lambda: flashgen_dense(backend, case), case["M"] * case["N"])
    if "flashgen-var" in args.peers:
        attempt("flashgen-var", lambda: flashgen_var(case), kept)
    if "flashinfer" in args.peers:
        attempt("flashinfer-bsr", lambda: flashinfer_bsr(case), kept)
    if "flashinfer-var" in args.peers:
        attempt("flashinfer-var", lambda: flashinfer_var(case), kept)
    if "flex" in args.peers:
        attempt("flex", lambda: flex(case), kept)
    times = timed_interleaved([fn for _, fn, _, _ in calls], args.reps)
    flops = 4 * case["hq"] * D
    out = []
    for (name, _, extra, pairs), us in zip(calls, times):
        out.append({"contender": name, "heads": f"{case['hq']}/{case['hkv']}", "density": density,
                    "kept_fraction": kept / (case["M"] * case["N"]), "ms": us / 1e3,
                    "TFLOPs": flops * pairs / us / 1e6, **extra})
        print(f"{out[-1]['heads']:6} density {density:.2f} {name:22} {us / 1e3:8.3f} ms "
              f"{out[-1]['TFLOPs']:6.0f} TFLOP/s {extra}", flush=True)
    return out


def table(rows: list[dict], args) -> str:
    lines = [f"# Block-sparse, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}, "
             f"commit {commit(args.commit)}",
             f"bf16, M = {args.M}, N = {args.N}, R = {args.R}, C = {args.C}, head_dim {D}; effective TFLOP/s count the "
             "kept blocks' pairs (dense: M x N)", "",
             "| heads | density | contender | ms | TFLOP/s | vs FlashInfer bsr | time vs flashgen dense |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        same = [x for x in rows if x["heads"] == row["heads"] and x["density"] == row["density"]]
        fi = [x for x in same if x["contender"] == "flashinfer-bsr"]
        backend = row["contender"].rsplit("-", 1)[-1] if row["contender"].startswith("flashgen") else None
        dense = [x for x in same if x["contender"] == f"flashgen-dense-{backend or 'auto'}"] or \
            [x for x in same if x["contender"].startswith("flashgen-dense")]
        ratio = f"{row['TFLOPs'] / fi[0]['TFLOPs']:.2f}x" if fi else "–"
        rel = f"{row['ms'] / dense[0]['ms']:.3f}" if dense else "–"
        lines.append(f"| {row['heads']} | {row['density']:.2f} ({row['kept_fraction']:.3f} kept) | "
                     f"{row['contender']} | {row['ms']:.3f} | {row['TFLOPs']:.0f} | {ratio} | {rel} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
