"""Batch decode benchmark: flashgen against torch SDPA (flash, cuDNN), FlexAttention and FlashInfer, in one run.

bf16 q, 32 q heads / 8 kv heads, head_dim 128, K/V in bf16 or (--kv-dtypes) fp8 e4m3 / e5m2 (flashgen and FlashInfer
only: the other peers take no fp8 cache). For each (batch, kv_len) and page size the KV cache is a pool of pages
in random order (paged layouts), the page table CSR. Every timed call follows an L2 flush; the
median of --reps calls is reported, with GB/s of K+V read and % of the device copy rate measured in the
same run. Output: JSON, a markdown table (same stem) and a PNG plot (bandwidth vs page size).

    python3 benchmarks/bench_decode.py --out benchmarks/results/decode.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import timing
from ..api import BatchDecodeWrapper
from ..jit import ensure_compiled
from ..spec import AttentionSpec, Paged
from .timing import commit, copy_rate, host_calls_us, median, pyplot, save_results, timed

HQ, HKV, D = 32, 8, 128
BYTES_PER_TOKEN = 2 * HKV * D * 2  # K + V, bf16
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def paged_table(batch: int, kv_len: int, page_size: int, gen: torch.Generator):
    pages_per = -(-kv_len // page_size)
    total = batch * pages_per
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    last = torch.full((batch,), kv_len - (pages_per - 1) * page_size, dtype=torch.int32)
    return total, indptr, indices, last


def kv_pages(pool, total, page_size, kv_dtype):
    """``total`` pages of K/V in ``kv_dtype`` over the pool's first bytes (fp8: random bytes, the time does not
    depend on the values)."""
    dtype = KV_DTYPES[kv_dtype]
    n = total * page_size * 2 * HKV * D
    return pool.view(torch.uint8)[: n * dtype.itemsize].view(dtype).view(total, 2, page_size, HKV, D)


def kv_spec(page_size: int, kv_dtype: str = "bf16") -> AttentionSpec:
    return AttentionSpec(D, kv_layout=Paged(page_size), kv_dtype=str(KV_DTYPES[kv_dtype]).split(".")[1])


def bench_flashgen(q, pool, batch, kv_len, page_size, gen, reps, kv_dtype="bf16"):
    spec = kv_spec(page_size, kv_dtype)
    total, indptr, indices, last = paged_table(batch, kv_len, page_size, gen)
    cache = kv_pages(pool, total, page_size, kv_dtype)
    wrapper = BatchDecodeWrapper(spec)
    indices = indices.cuda()
    # the first plan allocates the wrapper's buffers: report the steady state (median of the next 20)
    plan_times = host_calls_us(lambda: wrapper.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr,
                                                    kv_indices=indices, kv_last_page_len=last), 21)
    out = torch.empty_like(q)
    us = timed(lambda: wrapper.run(q, cache, out=out), reps)
    torch.cuda.synchronize()
    host_us = median(host_calls_us(lambda: wrapper.run(q, cache, out=out), 200))  # back to back, the GPU behind
    torch.cuda.synchronize()
    return us, {"plan_us": median(plan_times[1:]), "run_host_us": host_us}


def bench_flashinfer(q, pool, batch, kv_len, page_size, gen, reps, use_tensor_cores, kv_dtype="bf16"):
    import flashinfer

    total, indptr, indices, last = paged_table(batch, kv_len, page_size, gen)
    cache = kv_pages(pool, total, page_size, kv_dtype)
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(indptr.cuda(), indices.cuda(), last.cuda(), HQ, HKV, D, page_size, q_data_type=torch.bfloat16,
                 kv_data_type=KV_DTYPES[kv_dtype])
    return timed(lambda: wrapper.run(q, cache), reps)


def bench_sdpa(q, pool, batch, kv_len, backend, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k = pool[: batch * kv_len * HKV * D].view(batch, HKV, kv_len, D)
    v = pool[batch * kv_len * HKV * D: 2 * batch * kv_len * HKV * D].view(batch, HKV, kv_len, D)
    q4 = q.view(batch, HQ, 1, D)
    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def call():
        with sdpa_kernel(kind):
            torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    return timed(call, reps)


_flex = None


def bench_flex(q, pool, batch, kv_len, reps):
    global _flex
    from torch.nn.attention.flex_attention import flex_attention

    if _flex is None:
        # one compiled entry per shape: raise dynamo's limit, or it falls back to eager after 8 shapes
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _flex = torch.compile(flex_attention, dynamic=False)
    k = pool[: batch * kv_len * HKV * D].view(batch, HKV, kv_len, D)
    v = pool[batch * kv_len * HKV * D: 2 * batch * kv_len * HKV * D].view(batch, HKV, kv_len, D)
    q4 = q.view(batch, HQ, 1, D)
    return timed(lambda: _flex(q4, k, v, enable_gqa=True), reps)


def configs(max_kv_gb: float, batches=(1, 16, 64, 256), kv_lens=(1024, 4096, 16384, 65536)):
    for batch in batches:
        for kv_len in kv_lens:
            if batch * kv_len * BYTES_PER_TOKEN <= max_kv_gb * 1e9:
                yield batch, kv_len


PEERS = ("sdpa", "flex", "flashinfer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="decode.json")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--max-kv-gb", type=float, default=18.0)
    parser.add_argument("--page-sizes", default="1,16,64,256")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--kv-lens", default="1024,4096,16384,65536")
    parser.add_argument("--peers", default="sdpa,flex,flashinfer")
    parser.add_argument("--kv-dtypes", default="bf16", help="K/V dtypes, comma-separated: bf16, e4m3, e5m2")
    parser.add_argument("--flashinfer-modes", default="tc,cc", help="FlashInfer decodes: tc (tensor cores), cc")
    parser.add_argument("--flush", choices=("write", "read", "none"), default="write",
                        help="how L2 is emptied before each timed call (timing.FLUSH): write (the anchors' way, "
                        "leaves L2 dirty), read (leaves it clean) or none")
    parser.add_argument("--commit", default="", help="the commit measured (the device copy has no .git)")


def config(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed command line as ``measure`` takes it: lists of ints, a set of peers."""
    return argparse.Namespace(reps=args.reps, max_kv_gb=args.max_kv_gb, flush=args.flush,
                              page_sizes=[int(p) for p in args.page_sizes.split(",")],
                              batches=[int(b) for b in args.batches.split(",")],
                              kv_lens=[int(n) for n in args.kv_lens.split(",")],
                              peers=set(args.peers.split(",")) if args.peers else set(),
                              kv_dtypes=_kv_dtypes(getattr(args, "kv_dtypes", "bf16")),
                              flashinfer_modes=getattr(args, "flashinfer_modes", "tc,cc").split(","))


def _kv_dtypes(text: str) -> list[str]:
    names = text.split(",")
    for name in names:
        if name not in KV_DTYPES:
            raise ValueError(f"--kv-dtypes: {name!r} is not one of {sorted(KV_DTYPES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    timing.FLUSH = args.flush
    copy_gbps = copy_rate()
    print(f"copy rate {copy_gbps:.0f} GB/s", flush=True)
    cfg = config(args)
    build(cfg)
    rows = measure(cfg, copy_gbps)
    save_results(result(rows, copy_gbps, commit(args.commit), args.flush), Path(args.out), markdown, plot)


def build(cfg: argparse.Namespace, progress_class=None) -> None:
    """Compile (or find in the cache) the decode kernel of each page size before anything is timed;
    ``progress_class``: flashgen.progress.Progress, one step a kernel."""
    kernels = len(cfg.page_sizes) * len(cfg.kv_dtypes)
    progress = progress_class(kernels) if progress_class is not None else None
    try:
        for page_size in cfg.page_sizes:
            for kv_dtype in cfg.kv_dtypes:
                entry = ensure_compiled(kv_spec(page_size, kv_dtype), "decode")
                if progress is not None:
                    progress.write(entry.uri)
    finally:
        if progress is not None:
            progress.close()


def result(rows: list[dict], copy_gbps: float, commit_id: str, flush: str = "write") -> dict:
    return {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit_id,
            "copy_GBps": copy_gbps, "flush": flush,
            "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D}, "rows": rows}


def measure(cfg: argparse.Namespace, copy_gbps: float, progress=None) -> list[dict]:
    """The rows of one run over ``cfg``'s grid (``config``): one per (shape, page size, peer) measured.
    ``progress``: a flashgen.progress.Progress over the grid's shapes (else lines on stdout)."""
    write = progress.note if progress is not None else (lambda line: print(line, flush=True))
    peers = set(cfg.peers)
    gen = torch.Generator().manual_seed(0)
    timing.FLUSH = cfg.flush
    grid = list(configs(cfg.max_kv_gb, cfg.batches, cfg.kv_lens))
    if not grid:
        raise ValueError(f"decode: no (batch, kv_len) of batches {cfg.batches} x kv_lens {cfg.kv_lens} fits in "
                         f"max_kv_gb={cfg.max_kv_gb}")
    max_tokens = max(b * n for b, n in grid)
    pool = torch.randn(max_tokens * BYTES_PER_TOKEN // 2 + 2**20, device="cuda", dtype=torch.bfloat16)
    if "flashinfer" in peers:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
            write(f"flashinfer not importable: {exc!r}")
            peers.discard("flashinfer")
    rows = []
    for batch, kv_len in grid:
        q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)

        def record(peer, page_size, us, kv_dtype="bf16", **extra):
            gbytes = batch * kv_len * BYTES_PER_TOKEN * KV_DTYPES[kv_dtype].itemsize / 2 / 1e9
            gbps = gbytes / us * 1e6
            name = peer if kv_dtype == "bf16" else f"{peer}-{kv_dtype}"
            rows.append({"peer": name, "batch": batch, "kv_len": kv_len, "page_size": page_size, "us": us,
                         "GBps": gbps, "pct_copy": 100 * gbps / copy_gbps, "kv_dtype": kv_dtype, **extra})
            write(f"B={batch:4} L={kv_len:6} page={page_size!s:5} {name:19} {us:9.1f} us "
                  f"{gbps:7.0f} GB/s {100 * gbps / copy_gbps:6.1f} %")

        for kv_dtype in cfg.kv_dtypes:
            for page_size in cfg.page_sizes:
                us, extra = bench_flashgen(q, pool, batch, kv_len, page_size, gen, cfg.reps, kv_dtype)
                record("flashgen", page_size, us, kv_dtype, **extra)
                if "flashinfer" in peers:
                    for tc in [mode == "tc" for mode in cfg.flashinfer_modes]:
                        try:
                            us = bench_flashinfer(q, pool, batch, kv_len, page_size, gen, cfg.reps, tc, kv_dtype)
                            record("flashinfer-tc" if tc else "flashinfer-cc", page_size, us, kv_dtype)
                        except Exception as exc:  # noqa: BLE001
                            write(f"flashinfer failed ({kv_dtype}): {exc!r}")
                            if kv_dtype == "bf16":
                                peers.discard("flashinfer")
                            break
        if "sdpa" in peers:
            for backend in ("flash", "cudnn"):
                record(f"sdpa-{backend}", "contig", bench_sdpa(q, pool, batch, kv_len, backend, cfg.reps))
        if "flex" in peers:
            try:
                record("flex", "contig", bench_flex(q, pool, batch, kv_len, cfg.reps))
            except Exception as exc:  # noqa: BLE001
                write(f"flex failed: {exc!r}")
                peers.discard("flex")
        if progress is not None:
            progress.write(f"decode B={batch} L={kv_len} done")
    return rows


def markdown(result: dict) -> str:
    rows = result["rows"]
    peers = sorted({(r["peer"], str(r["page_size"])) for r in rows}, key=lambda x: (x[0] != "flashgen", x))
    lines = [f"# Decode, {result['device']}, {result['date']}, commit {result['commit']}",
             f"bf16, {HQ} q / {HKV} kv heads, d={D}; copy rate {result['copy_GBps']:.0f} GB/s; "
             "cells: % of copy rate on the row's own K/V bytes (µs); -e4m3, -e5m2: an fp8 cache", "",
             "| B | L | " + " | ".join(f"{p} p{s}" for p, s in peers) + " |",
             "|---|---|" + "---|" * len(peers)]
    for batch, kv_len in sorted({(r["batch"], r["kv_len"]) for r in rows}):
        cells = []
        for peer, size in peers:
            hit = [r for r in rows if (r["peer"], str(r["page_size"]), r["batch"], r["kv_len"]) == (peer, size, batch, kv_len)]
            cells.append(f"{hit[0]['pct_copy']:.0f} ({hit[0]['us']:.0f})" if hit else "–")
        lines.append(f"| {batch} | {kv_len} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if isinstance(r["page_size"], int) and r["batch"] >= 64 and r["kv_len"] >= 4096]
    fig, ax = plt.subplots(figsize=(7, 4))
    for peer in sorted({r["peer"] for r in rows}):
        for batch, kv_len in sorted({(r["batch"], r["kv_len"]) for r in rows}):
            pts = sorted((r["page_size"], r["pct_copy"]) for r in rows if r["peer"] == peer and (r["batch"], r["kv_len"]) == (batch, kv_len))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{peer} B={batch} L={kv_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (tokens)")
    ax.set_ylabel("% of copy bandwidth")
    ax.set_title(f"Decode bandwidth vs page size ({result['device']})")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios(result: dict) -> list[tuple[str, str, float]]:
    """(shape, peer, flashgen/peer) for every peer row: the ratio of rates (the peer's µs over flashgen's, same
    bytes). A paged peer meets flashgen at its page size; a contiguous one (SDPA, Flex) meets flashgen at every
    page size measured, so each bar says what paging at that page size costs or gains against a contiguous
    cache. Shapes in the grid's order."""
    rows = result["rows"]
    ours = {(r["batch"], r["kv_len"], r["page_size"]): r["us"] for r in rows if r["peer"] == "flashgen"}
    out = []
    for (batch, kv_len, page), us in sorted(ours.items()):
        label = f"B{batch} L{_tokens(kv_len)} p{page}"
        for r in rows:
            if (r["peer"] != "flashgen" and (r["batch"], r["kv_len"]) == (batch, kv_len)
                    and r["page_size"] in (page, "contig")):
                out.append((label, r["peer"], r["us"] / us))
    return out


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
