"""Batch prefill benchmark: flashgen against torch SDPA (flash, cuDNN), FlexAttention and FlashInfer (FA2, and FA3 on
Hopper), in one run.

flashgen runs once per backend of ``--backends`` (default: portable, and on a Hopper GPU also sm90, for the
specs the sm90 kernel supports), each its own labelled row: ``flashgen-portable``, ``flashgen-sm90``.

bf16, 32 q heads / 8 kv heads, head_dim 64/128/256, 16k tokens as batch x seqlen (1x16384, 4x4096, 16x1024),
causal and not, KV ragged or paged (page 16 and 1, pages in random order); for head_dim 128 also a sliding
window of 1024 and a document mask (8 causal documents per sequence, as a custom bit mask). The peers of a row
(one shape and mask) are set up first, then timed round-robin, so that they meet the same clocks (the H200's
drift by 5-10 % under sustained load). Every timed call follows an L2 flush (1 GiB zeroed); the median of --reps
calls is reported as TFLOP/s (4·b·h·sq·sk·d, halved
for causal; visible pairs for window and document masks) and % of the bf16 matmul rate (8192³) measured in
the same run. FlexAttention's compile time is reported separately. Output: JSON, markdown table, PNG.
``--kv-dtypes bf16,e4m3,e5m2``: flashgen also over an fp8 cache (the bf16 K/V rounded, scale 1), rows
``flashgen-<backend>-e4m3`` timed round-robin with the bf16 ones (the sm90 backend dequantises fp8 K/V in its
pre-pass, timed with it, then runs the 16-bit kernel; the peers stay bf16).
``--ropes none,rope,krot,krot-l31``: flashgen with RoPE too (theta 500000): ``rope`` turns q and unrotated K (the
sm90 backend in its K pre-pass, timed with it; FlashInfer's FA2 in its kernel, ``pos_encoding_mode="ROPE_LLAMA"``,
row ``flashinfer-rope``), ``krot`` a cache of rotated K (``RoPE(k_rotated=True)``: q alone turns, on sm90 in the
kernel), ``krot-l31`` the same with Llama-3.1 frequencies; rows ``flashgen-<backend>[-<kv>]-<rope>``.

    python3 benchmarks/bench_prefill.py --out benchmarks/results/prefill.json
    python3 benchmarks/bench_prefill.py --head-dims 128 --shapes 4x4096 --masks causal --layouts ragged,paged16 \
        --peers "" --backends portable,sm90 --kv-dtypes bf16,e4m3,e5m2
    python3 benchmarks/bench_prefill.py --head-dims 128 --shapes 4x4096,1x16384 --masks causal \
        --layouts ragged,paged16 --peers flashinfer --ropes none,rope,krot,krot-l31
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..api import BatchPrefillWrapper
from ..api.backends import check_sm90, kernels_for
from ..jit import ensure_compiled
from ..kernels import family
from ..spec import (AttentionSpec, Causal, CustomMask, Llama31Scaling, NoMask, Paged, Ragged, RoPE, SlidingWindow,
                    SpecError)
from ..testing.masks import doc_mask
from .timing import commit, matmul_rate, page_cache, pyplot, save_results, timed_interleaved

HQ, HKV, TOKENS, WINDOW, DOCS = 32, 8, 16384, 1024, 8
KV_DTYPES = {"bf16": "bfloat16", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # --kv-dtypes
ROPE_THETA = 500000.0
ROPES = {"none": None, "rope": RoPE(ROPE_THETA), "krot": RoPE(ROPE_THETA, k_rotated=True),  # --ropes
         "krot-l31": RoPE(ROPE_THETA, scaling=Llama31Scaling(), k_rotated=True)}
OPS = {"portable": "prefill", "sm90": "prefill_sm90"}  # the kernel family of each BatchPrefillWrapper backend


def runs(spec: AttentionSpec, backend: str) -> bool:
    """Whether ``backend`` runs ``spec`` (the sm90 backend a subset; the portable one every spec here)."""
    try:
        if backend == "sm90":
            check_sm90(spec)
        else:
            family(OPS[backend]).check(spec)
        return True
    except SpecError:
        return False


def visible_pairs(mask: str, seqlen: int) -> float:
    """Query-key pairs of one sequence that the mask keeps (causal counts half, the FlashAttention convention)."""
    if mask == "none":
        return seqlen * seqlen
    if mask == "causal":
        return seqlen * seqlen / 2
    if mask == "window":
        i = np.arange(seqlen)
        return float(np.minimum(i + 1, WINDOW + 1).sum())
    doc = seqlen // DOCS
    return DOCS * doc * (doc + 1) / 2


def spec_for(d: int, layout: str, mask: str, kv: str = "bf16", rope: str = "none") -> AttentionSpec:
    kv_layout = Ragged() if layout == "ragged" else Paged(int(layout[5:]))
    m = {"none": NoMask(), "causal": Causal(), "window": SlidingWindow(WINDOW), "doc": CustomMask()}[mask]
    return AttentionSpec(d, kv_layout=kv_layout, mask=m, kv_dtype=KV_DTYPES[kv], pos_encoding=ROPES[rope])


def bench_flashgen(q, k, v, batch, seqlen, d, layout, mask, gen, backend, kv_dtype="bf16", rope="none"):
    spec = spec_for(d, layout, mask, kv_dtype, rope)
    wrapper = BatchPrefillWrapper(spec, backend=backend)
    indptr = np.arange(batch + 1) * seqlen
    custom = None
    if mask == "doc":
        custom = [doc_mask(seqlen, seqlen, DOCS)] * batch
    if layout == "ragged":
        table, kv = {"kv_indptr": indptr}, (k, v)
    else:
        page = spec.kv_layout.page_size
        kv, table = page_cache(k, v, batch, seqlen, page, torch.randperm(batch * seqlen // page, generator=gen))
    if kv_dtype != "bf16":
        kv = tuple(x.to(getattr(torch, KV_DTYPES[kv_dtype])) for x in kv)  # values of N(0, 1): scale 1
    wrapper.plan(qo_indptr=indptr, num_qo_heads=HQ, num_kv_heads=HKV, custom_mask=custom, **table)
    out = torch.empty_like(q)
    return (lambda: wrapper.run(q, kv, out=out)), {"kv_dtype": kv_dtype, "rope": rope}


def bench_sdpa(q, k, v, batch, seqlen, d, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q4, k4, v4 = (x.view(batch, seqlen, -1, d).transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(kind):
            torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
    return call


_flex = None


def bench_flex(q, k, v, batch, seqlen, d, mask):
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _flex = torch.compile(flex_attention, dynamic=False)
    doc = seqlen // DOCS
    mods = {
        "none": None,
        "causal": lambda b, h, qi, ki: ki <= qi,
        "window": lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= WINDOW),
        "doc": lambda b, h, qi, ki: (ki <= qi) & (qi // doc == ki // doc),
    }
    block_mask = None if mods[mask] is None else create_block_mask(mods[mask], None, None, seqlen, seqlen)
    q4, k4, v4 = (x.view(batch, seqlen, -1, d).transpose(1, 2) for x in (q, k, v))
    start = time.perf_counter()
    _flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    return (lambda: _flex(q4, k4, v4, block_mask=block_mask, enable_gqa=True)), {"compile_s": compile_s}


def bench_flashinfer(q, k, v, batch, seqlen, d, layout, mask, gen, backend="fa2", rope=False):
    import flashinfer

    # rope: q and K turned in its kernel (FA2's pos_encoding_mode), as flashgen's "rope" rows
    turn = {"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": ROPE_THETA} if rope else {}
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32) * seqlen
    causal, window = mask in ("causal", "window"), (WINDOW if mask == "window" else -1)
    if layout == "ragged":
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(indptr.cuda(), indptr.cuda(), HQ, HKV, d, causal=causal, window_left=window,
               q_data_type=torch.bfloat16, **turn)
        return lambda: w.run(q, k, v)
    page = int(layout[5:])
    pages = batch * seqlen // page
    perm = torch.randperm(pages, generator=gen)
    kv = torch.empty(pages, 2, page, HKV, d, dtype=k.dtype, device="cuda")
    kv[perm.cuda(), 0] = k.view(pages, page, HKV, d)
    kv[perm.cuda(), 1] = v.view(pages, page, HKV, d)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(indptr.cuda(), (torch.arange(batch + 1, dtype=torch.int32) * (seqlen // page)).cuda(),
           perm.to(torch.int32).cuda(), torch.full((batch,), page, dtype=torch.int32).cuda(), HQ, HKV, d, page,
           causal=causal, window_left=window, q_data_type=torch.bfloat16, **turn)
    return lambda: w.run(q, kv)


def grid(args):
    for d in args.head_dims:
        for batch, seqlen in args.shapes:
            for mask in ("none", "causal") + (("window", "doc") if d == 128 else ()):
                if args.masks is None or mask in args.masks:
                    yield d, batch, seqlen, mask


PEERS = ("sdpa", "flex", "flashinfer", "flashinfer-fa3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="prefill.json")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--shapes", default="1x16384,4x4096,16x1024")
    parser.add_argument("--layouts", default="ragged,paged16,paged1")
    parser.add_argument("--peers", default="sdpa,flex,flashinfer",
                        help="some of sdpa, flex, flashinfer (its FA2 backend), flashinfer-fa3 (Hopper, ragged, "
                             "none and causal; its first call JIT-builds the module: minutes)")
    parser.add_argument("--backends", default=None,
                        help="flashgen backends, one row each (default: portable,sm90 on Hopper, else portable)")
    parser.add_argument("--masks", default=None, help="a subset of none,causal,window,doc (window, doc: d128 only)")
    parser.add_argument("--kv-dtypes", default="bf16",
                        help="flashgen's K/V dtypes, comma-separated: bf16, e4m3, e5m2 (fp8 rows: "
                             "flashgen-<backend>-e4m3)")
    parser.add_argument("--ropes", default="none",
                        help="flashgen's RoPE, comma-separated: none, rope (q and K turn), krot (a cache of rotated "
                             "K: q alone turns), krot-l31 (with Llama-3.1 frequencies); rows "
                             "flashgen-<backend>[-<kv>]-<rope>, and flashinfer-rope with --peers flashinfer")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")


def config(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed command line as ``build`` and ``measure`` take it (lists, sets; ValueError naming a bad
    --backends)."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    backends = args.backends.split(",") if args.backends else ["portable"] + (["sm90"] if hopper else [])
    unknown = set(backends) - set(OPS)
    if unknown:
        raise ValueError(f"--backends: unknown {sorted(unknown)}, expected some of {sorted(OPS)}")
    kv_dtypes = getattr(args, "kv_dtypes", "bf16").split(",")
    unknown = set(kv_dtypes) - set(KV_DTYPES)
    if unknown:
        raise ValueError(f"--kv-dtypes: unknown {sorted(unknown)}, expected some of {sorted(KV_DTYPES)}")
    ropes = getattr(args, "ropes", "none").split(",")
    unknown = set(ropes) - set(ROPES)
    if unknown:
        raise ValueError(f"--ropes: unknown {sorted(unknown)}, expected some of {sorted(ROPES)}")
    return argparse.Namespace(
        reps=args.reps, ropes=ropes, head_dims=[int(x) for x in args.head_dims.split(",")],
        shapes=[tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")],
        layouts=args.layouts.split(","), peers=set(args.peers.split(",")) if args.peers else set(),
        backends=backends, masks=set(args.masks.split(",")) if args.masks else None, kv_dtypes=kv_dtypes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config(args)
    except ValueError as exc:
        parser.error(str(exc))
    build(cfg)
    mm = matmul_rate()
    print(f"bf16 matmul 8192^3: {mm:.0f} TFLOP/s", flush=True)
    rows = measure(cfg, mm)
    save_results(result(rows, mm, commit(args.commit)), Path(args.out), markdown, plot)


def result(rows: list[dict], mm: float, commit_id: str) -> dict:
    return {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit_id,
            "matmul_TFLOPs": mm, "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "tokens": TOKENS}, "rows": rows}


def build(cfg: argparse.Namespace, progress_class=None) -> None:
    """Compile (or find in the cache) every flashgen kernel of the grid before anything is timed, in parallel;
    ``progress_class``: flashgen.progress.Progress, one step a kernel (else one line at the end)."""
    specs = {spec_for(d, layout, mask, kv, rope) for d, _, _, mask in grid(cfg) for layout in cfg.layouts
             for kv in cfg.kv_dtypes for rope in cfg.ropes}
    jobs = [(kernel_spec, op) for s in specs for b in cfg.backends if runs(s, b)
            for op, kernel_spec in kernels_for(s, b)]
    start = time.perf_counter()
    progress = progress_class(len(jobs)) if progress_class is not None else None
    try:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            for entry in pool.map(lambda job: ensure_compiled(*job), jobs):
                if progress is not None:
                    progress.write(f"{entry.uri}")
    finally:
        if progress is not None:
            progress.close()
    print(f"compiled {len(jobs)} flashgen kernels in {time.perf_counter() - start:.0f} s", flush=True)


def measure(cfg: argparse.Namespace, mm: float, progress=None) -> list[dict]:
    """The rows of one run over ``cfg``'s grid (``config``; its kernels built first by ``build``): one per
    (shape, mask, layout, peer) measured, the peers of a shape and mask timed round-robin. ``progress``: a
    flashgen.progress.Progress over the grid's rows (else lines on stdout)."""
    write = progress.note if progress is not None else (lambda line: print(line, flush=True))
    hopper = torch.cuda.get_device_capability() == (9, 0)
    gen = torch.Generator().manual_seed(0)
    if cfg.peers & {"flashinfer", "flashinfer-fa3"}:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
            write(f"flashinfer not importable: {exc!r}")
            cfg.peers = cfg.peers - {"flashinfer", "flashinfer-fa3"}
    rows = []
    for d, batch, seqlen, mask in grid(cfg):
        q = torch.randn(batch * seqlen, HQ, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch * seqlen, HKV, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * batch * HQ * d * visible_pairs(mask, seqlen)

        def record(peer, layout, us, **extra):
            tf = flops / us / 1e6
            rows.append({"peer": peer, "head_dim": d, "batch": batch, "seqlen": seqlen, "mask": mask, "layout": layout,
                         "us": us, "TFLOPs": tf, "pct_matmul": 100 * tf / mm, **extra})
            mhz = f" {extra['sm_mhz']:5.0f} MHz" if extra.get("sm_mhz") else ""
            write(f"d={d:3} {batch:2}x{seqlen:5} {mask:6} {layout:7} {peer:17} {us:9.1f} us {tf:6.0f} TFLOP/s "
                  f"{100 * tf / mm:5.1f} %{mhz}")

        calls = []  # (peer, layout, fn, extra): every peer of the row set up first, then timed round-robin

        def attempt(peer, layout, setup):
            try:
                out = setup()
                fn, extra = out if isinstance(out, tuple) else (out, {})
                calls.append((peer, layout, fn, extra))
            except Exception as exc:  # noqa: BLE001 - a peer failing is reported, never fatal
                write(f"{peer} {layout} failed: {exc!r}"[:300])

        for layout in cfg.layouts:
            for backend, kv, rope in ((b, kv, r) for r in cfg.ropes for kv in cfg.kv_dtypes for b in cfg.backends):
                if runs(spec_for(d, layout, mask, kv, rope), backend):
                    peer = "-".join(["flashgen", backend] + [x for x in (kv, rope) if x not in ("bf16", "none")])
                    attempt(peer, layout, lambda: bench_flashgen(q, k, v, batch, seqlen, d, layout, mask, gen, backend,
                                                                 kv, rope))
            if "flashinfer" in cfg.peers and mask != "doc":
                for rope in [r for r in cfg.ropes if r in ("none", "rope")]:
                    attempt("flashinfer" + ("-rope" if rope == "rope" else ""), layout,
                            lambda: bench_flashinfer(q, k, v, batch, seqlen, d, layout, mask, gen, rope=rope == "rope"))
            # FA3: ragged, none and causal (the Hopper issue's bar); each further variant is another JIT module
            if "flashinfer-fa3" in cfg.peers and mask in ("none", "causal") and layout == "ragged" and hopper:
                attempt("flashinfer-fa3", layout,
                        lambda: bench_flashinfer(q, k, v, batch, seqlen, d, layout, mask, gen, "fa3"))
        if "sdpa" in cfg.peers and mask in ("none", "causal"):
            for backend in ("flash", "cudnn"):
                attempt(f"sdpa-{backend}", "contig",
                        lambda: bench_sdpa(q, k, v, batch, seqlen, d, mask == "causal", backend))
        if "flex" in cfg.peers:
            attempt("flex", "contig", lambda: bench_flex(q, k, v, batch, seqlen, d, mask))
        good = []
        for peer, layout, fn, extra in calls:  # a peer failing in its first call is reported and left out
            try:
                fn()
                torch.cuda.synchronize()
                good.append((peer, layout, fn, extra))
            except Exception as exc:  # noqa: BLE001
                write(f"{peer} {layout} failed: {exc!r}"[:300])
        clocks: list = []
        times = timed_interleaved([fn for _, _, fn, _ in good], cfg.reps, clocks)
        for (peer, layout, _, extra), us, mhz in zip(good, times, clocks):
            record(peer, layout, us, sm_mhz=mhz, **extra)
        del q, k, v
        if progress is not None:
            progress.write(f"prefill d={d} {batch}x{seqlen} {mask} done")
    return rows


def markdown(result: dict) -> str:
    rows = result["rows"]
    cols = sorted({(r["peer"], r["layout"]) for r in rows},
                  key=lambda x: (not x[0].startswith("flashgen"), x))
    lines = [f"# Prefill, {result['device']}, {result['date']}, commit {result['commit']}",
             f"bf16, {HQ} q / {HKV} kv heads, {TOKENS} tokens; bf16 matmul {result['matmul_TFLOPs']:.0f} TFLOP/s; "
             "cells: TFLOP/s (% of matmul)", "",
             "| d | b x s | mask | " + " | ".join(f"{p} {lay}" for p, lay in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for d, batch, seqlen, mask in sorted({(r["head_dim"], r["batch"], r["seqlen"], r["mask"]) for r in rows}):
        cells = []
        for peer, layout in cols:
            hit = [r for r in rows if (r["peer"], r["layout"], r["head_dim"], r["batch"], r["seqlen"], r["mask"])
                   == (peer, layout, d, batch, seqlen, mask)]
            cells.append(f"{hit[0]['TFLOPs']:.0f} ({hit[0]['pct_matmul']:.0f}%)" if hit else "–")
        lines.append(f"| {d} | {batch}x{seqlen} | {mask} | " + " | ".join(cells) + " |")
    flex = [r for r in rows if "compile_s" in r]
    if flex:
        lines += ["", f"FlexAttention compile time per shape: {min(r['compile_s'] for r in flex):.1f}-"
                      f"{max(r['compile_s'] for r in flex):.1f} s (not in the timings)"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r["head_dim"] == 128 and r["mask"] in ("none", "causal")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mask in zip(axes, ("none", "causal")):
        for peer, layout in sorted({(r["peer"], r["layout"]) for r in rows}):
            pts = sorted((r["batch"], r["TFLOPs"]) for r in rows if (r["peer"], r["layout"], r["mask"]) == (peer, layout, mask))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{peer} {layout}")
        ax.axhline(result["matmul_TFLOPs"], color="grey", linestyle=":", label="bf16 matmul")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (16k tokens total)")
        ax.set_title(f"d=128, {mask}")
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=6)
    fig.suptitle(f"Prefill ({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios(result: dict) -> list[tuple[str, str, float]]:
    """(shape, peer, flashgen/peer) for every peer row: the ratio of rates (the peer's µs over flashgen's, same
    FLOPs), flashgen being its fastest backend for the shape, mask and layout. A paged or ragged peer meets
    flashgen at its layout; a contiguous one (SDPA, Flex) meets flashgen at every layout measured. Shapes in
    sorted order."""
    rows = result["rows"]
    ours: dict[tuple, float] = {}
    for r in rows:
        if r["peer"].startswith("flashgen") and r.get("kv_dtype", "bf16") == "bf16":  # the peers' K/V dtype
            key = (r["head_dim"], r["batch"], r["seqlen"], r["mask"], r["layout"])
            ours[key] = min(r["us"], ours.get(key, float("inf")))
    out = []
    for (d, batch, seqlen, mask, layout), us in sorted(ours.items()):
        seq = f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen)
        label = f"d{d} {batch}x{seq} {mask} {layout}"
        for r in rows:
            if (not r["peer"].startswith("flashgen") and r["layout"] in (layout, "contig")
                    and (r["head_dim"], r["batch"], r["seqlen"], r["mask"]) == (d, batch, seqlen, mask)):
                out.append((label, r["peer"], r["us"] / us))
    return out
