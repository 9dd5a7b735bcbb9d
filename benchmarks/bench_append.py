"""KV-cache write benchmark: flashgen.append_kv against FlashInfer's append_paged_kv_cache (and its fused RoPE +
fp8 quantise + append, rope_quantize_fp8_append_paged_kv_cache, where RoPE and fp8 are both on) in one run.

8 kv heads, head_dim 128, page 16 (NHD, shuffled pages), bf16 new K/V into a bf16 or fp8 e4m3 cache, with and
without RoPE on K: a decode step of 64 and of 256 requests (one token each, at position 1000) and a 4096-token
prefill chunk of one request. Every timed call follows an L2 flush; the median of --reps calls is reported, in
µs, GB/s of K/V bytes read and written, and % of 4.3 TB/s (the H200's copy rate; docs/performance.md). The
fused FlashInfer op also rotates and quantises q: its row carries q's bytes too. Two floors share each bf16 shape's
table: a one-element torch kernel (what a launch between two events costs, with no bytes) and one torch copy of
the same K/V bytes (read and written once, contiguous: what the bytes cost without a page table).

Then fused append + decode (``BatchDecodeWrapper(kernel_options={"append": True}).run(..., k_new=, v_new=)``)
against append_kv followed by a plain decode run, and the plain decode alone (what fusing can at best reach), at
B=64 and 256 requests of L=4096 tokens (the new one included), 32 q / 8 kv heads, page 16, a bf16 or fp8 cache
holding rotated K (RoPE(500000, k_rotated=True), Llama-3.1 scaling): flashgen only (FlashInfer has no fused
decode). Prints tables; writes nothing.

    python3 benchmarks/bench_append.py                 # both tables
    python3 benchmarks/bench_append.py --only fused
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
from timing import timed, timed_interleaved  # noqa: E402
from flashgen.testing import cos_sin_table  # noqa: E402

HKV, HQ, D, PAGE = 8, 32, 128, 16
COPY_RATE = 4.3e12  # bytes/s, read + write
SHAPES = [("decode B=64", [1] * 64), ("decode B=256", [1] * 256), ("prefill 4096", [4096])]


def flashinfer():
    try:
        import flashinfer as fi  # noqa: PLC0415
        return fi
    except ImportError:
        return None


def setup(new_lens: list[int], fp8: bool, gen: torch.Generator) -> dict:
    cached = 1000 if len(new_lens) > 1 else 0
    pages_per = [-(-(cached + n) // PAGE) for n in new_lens]
    total = sum(pages_per)
    indptr = torch.tensor([0] + pages_per, dtype=torch.int32).cumsum(0).to(torch.int32)
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    batch = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, n in enumerate(new_lens)])
    pos = torch.cat([torch.arange(cached, cached + n, dtype=torch.int32) for n in new_lens])
    last = torch.tensor([(cached + n - 1) % PAGE + 1 for n in new_lens], dtype=torch.int32)
    tokens = int(batch.numel())
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return dict(
        k=torch.randn(tokens, HKV, D, generator=gen).bfloat16().cuda(),
        v=torch.randn(tokens, HKV, D, generator=gen).bfloat16().cuda(),
        q=torch.randn(tokens, HQ, D, generator=gen).bfloat16().cuda(),
        cache=(torch.zeros(total, PAGE, HKV, D, dtype=dtype, device="cuda"),
               torch.zeros(total, PAGE, HKV, D, dtype=dtype, device="cuda")),
        kv_indptr=indptr.cuda(), kv_indices=indices.cuda(), kv_last_page_len=last.cuda(), batch_indices=batch.cuda(),
        positions=pos.cuda(), tokens=tokens,
        cos_sin=cos_sin_table(cached + max(new_lens) + 1, D).cuda(),
    )


def moved_bytes(s: dict, fp8: bool, with_q: bool = False) -> int:
    rows = s["tokens"] * HKV * D
    total = rows * 2 * 2 + rows * 2 * (1 if fp8 else 2) + s["tokens"] * 8  # K/V read, written, indices
    if with_q:
        total += s["tokens"] * HQ * D * (2 + (1 if fp8 else 2))
    return total


def peers(fi, s: dict, fp8: bool, rope: bool) -> list[tuple[str, object, bool]]:
    out = []
    if fi is None:
        return out
    if not rope and not fp8:  # its append writes the input's dtype: no quantising peer without RoPE
        out.append(("flashinfer append_paged_kv_cache", lambda: fi.append_paged_kv_cache(
            s["k"], s["v"], s["batch_indices"], s["positions"], s["cache"], s["kv_indices"], s["kv_indptr"],
            s["kv_last_page_len"]), False))
    if rope and fp8 and hasattr(fi, "rope_quantize_fp8_append_paged_kv_cache"):
        out.append(("flashinfer rope_quantize_fp8_append (k, v, q)", lambda: fi.rope_quantize_fp8_append_paged_kv_cache(
            s["q"], s["k"], None, None, s["v"], s["cos_sin"], s["positions"], s["cache"], s["kv_indices"],
            s["kv_indptr"], s["batch_indices"], s["positions"], page_size=PAGE), True))
    return out


def floors(s: dict) -> list[tuple[str, object, bool]]:
    """The launch floor (a one-element kernel) and the bytes floor (one contiguous copy of the K/V bytes)."""
    one = torch.zeros(1, device="cuda")
    src = torch.stack([s["k"], s["v"]])
    dst = torch.empty_like(src)
    return [("floor: one-element kernel (launch)", lambda: one.add_(1.0), None),  # no bytes to rate
            ("floor: contiguous copy of the K/V bytes", lambda: dst.copy_(src), False)]


FUSED_SHAPES = [(64, 4096), (256, 4096)]


def fused_rows(reps: int, gen: torch.Generator) -> None:
    """append_kv then decode against the fused launch, same cache, same plan."""
    rope = flashgen.RoPE(500000.0, scaling=flashgen.Llama31Scaling(), k_rotated=True)
    print(f"\n{'shape':<16} {'cache':<6} {'kernel':<34} {'µs':>8} {'vs append+decode':>17}")
    for batch, kv_len in FUSED_SHAPES:
        for fp8 in (False, True):
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            spec = flashgen.AttentionSpec(D, kv_dtype="float8_e4m3fn" if fp8 else "bfloat16",
                                          kv_layout=flashgen.Paged(PAGE), pos_encoding=rope)
            pages = -(-kv_len // PAGE)
            indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
            indices = torch.randperm(batch * pages, generator=gen).to(torch.int32).cuda()
            last = torch.full((batch,), (kv_len - 1) % PAGE + 1, dtype=torch.int32)
            cache = tuple(torch.randn(batch * pages, PAGE, HKV, D, generator=gen).to(dtype).cuda() for _ in range(2))
            q = torch.randn(batch, HQ, D, generator=gen).bfloat16().cuda()
            k_new, v_new = (torch.randn(batch, HKV, D, generator=gen).bfloat16().cuda() for _ in range(2))
            table = dict(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
            plain = flashgen.BatchDecodeWrapper(spec)
            fused = flashgen.BatchDecodeWrapper(spec, kernel_options={"append": True})
            for w in (plain, fused):
                w.plan(**table)
            scales = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
            where = dict(kv_indptr=indptr.cuda(), kv_indices=indices,
                         batch_indices=torch.arange(batch, dtype=torch.int32, device="cuda"),
                         positions=torch.full((batch,), kv_len - 1, dtype=torch.int32, device="cuda"))

            def sequential():
                flashgen.append_kv(k_new, v_new, cache, rope=rope, **where, **scales)
                plain.run(q, cache)

            rows = [("append_kv, then decode", sequential),
                    ("fused append + decode", lambda: fused.run(q, cache, k_new=k_new, v_new=v_new)),
                    ("decode alone (the floor)", lambda: plain.run(q, cache))]
            for _, fn in rows:
                fn()
            times = timed_interleaved([fn for _, fn in rows], reps)  # A/B interleaved: same clocks, same L2 state
            for (name, _), us in zip(rows, times):
                print(f"{f'B={batch} L={kv_len}':<16} {'fp8' if fp8 else 'bf16':<6} {name:<34} {us:8.2f} "
                      f"{times[0] / us:16.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--only", choices=("append", "fused"), default=None, help="one of the two tables")
    args = parser.parse_args()
    fi = flashinfer()
    gen = torch.Generator().manual_seed(0)
    if args.only != "fused":
        append_rows(fi, args.reps, gen)
    if args.only != "append":
        fused_rows(args.reps, gen)


def append_rows(fi, reps: int, gen: torch.Generator) -> None:
    print(f"{'shape':<14} {'cache':<6} {'rope':<5} {'kernel':<46} {'µs':>8} {'GB/s':>8} {'% 4.3 TB/s':>10}")
    for label, lens in SHAPES:
        for fp8 in (False, True):
            for rope in (False, True):
                s = setup(lens, fp8, gen)
                extra = dict(cos_sin_cache=s["cos_sin"]) if rope else {}
                if fp8:
                    extra.update(k_scale=1.0, v_scale=1.0)
                ours = ("flashgen append_kv", lambda: flashgen.append_kv(
                    s["k"], s["v"], s["cache"], kv_indptr=s["kv_indptr"], kv_indices=s["kv_indices"],
                    batch_indices=s["batch_indices"], positions=s["positions"], **extra), False)
                rows = [ours, *peers(fi, s, fp8, rope)]
                if not fp8 and not rope:
                    rows += floors(s)
                for name, fn, with_q in rows:
                    fn()
                    us = timed(fn, reps)
                    rate = None if with_q is None else moved_bytes(s, fp8, with_q) / (us * 1e-6)
                    rated = f"{'-':>8} {'-':>10}" if rate is None else f"{rate / 1e9:8.0f} {100 * rate / COPY_RATE:9.1f}%"
                    print(f"{label:<14} {'fp8' if fp8 else 'bf16':<6} {'yes' if rope else 'no':<5} {name:<46} "
                          f"{us:8.2f} {rated}")


if __name__ == "__main__":
    main()
