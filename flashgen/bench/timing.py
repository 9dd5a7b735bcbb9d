"""Helpers shared by the GPU benchmarks (``flashgen bench`` and benchmarks/*.py, which import it as ``timing``):
L2-flushed median timing of GPU work, per-call host timing, the device's ceilings, the commit, a shuffled page
cache, the writers of a result."""

from __future__ import annotations

import gc
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

_flush: torch.Tensor | None = None
# How timed() empties L2 before each call: "write" (zero a 1 GiB buffer, as the peers' anchors were measured:
# L2 is left full of dirty lines, which the timed call's reads then evict and write back), "read" (sum a 1 GiB
# buffer: L2 is left full of clean lines) or "none" (no flush).
FLUSH = "write"
WARMUP_MS = 30.0  # GPU time spent in untimed calls before the timed ones (at most 500 calls)


def timed(fn, reps: int) -> float:
    """Median µs of ``fn`` over ``reps`` calls, each after an L2 flush (flush not timed; its ~250 µs of GPU
    time also covers the host time of the peers' calls, so a peer with 100+ µs of Python overhead is
    still measured on the GPU). Warmed up first for WARMUP_MS of GPU time (the first configuration timed
    after seconds of host work, planning or building page tables, otherwise ran 2-4 % slow while the clocks
    came back up; docs/performance.md, "Method")."""
    return timed_interleaved([fn], reps)[0]


def _flush_l2() -> None:
    global _flush
    if _flush is None:
        _flush = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    if FLUSH == "write":
        _flush.zero_()
    elif FLUSH == "read":
        _flush.view(torch.int32).sum(dtype=torch.int32)


_nvml = None


def sm_clock() -> float | None:
    """The SM clock now, MHz, through NVML where nvidia-ml-py is importable (else None)."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
        except Exception:  # noqa: BLE001 - no NVML: no clock readings
            _nvml = False
    if not _nvml:
        return None
    pynvml, handle = _nvml
    return float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))


def timed_interleaved(fns: list, reps: int, clocks: list | None = None) -> list[float]:
    """Median µs of each of ``fns``, timed round-robin: each is warmed up as timed() does, then every rep times
    each function once, in turn, after an L2 flush. Under sustained tensor-core load the H200's clocks drift
    by 5-10 % within seconds (the same kernel 712 then 648 TFLOP/s seconds apart in one process, 2026-11-29),
    so peers timed one after another would each meet a different clock; interleaved, they meet the same.
    ``clocks``, if given, receives each function's median SM clock (MHz, read by NVML right after each timed
    call; None without NVML)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def ms(fn) -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for fn in fns:
        warm_ms, calls = 0.0, 0
        while (warm_ms < WARMUP_MS and calls < 500) or calls < 2:
            warm_ms, calls = warm_ms + ms(fn), calls + 1
    times: list[list[float]] = [[] for _ in fns]
    mhz: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t, c in zip(fns, times, mhz):
            _flush_l2()
            t.append(ms(fn) * 1e3)
            clock = sm_clock() if clocks is not None else None
            if clock is not None:
                c.append(clock)
    if clocks is not None:
        clocks[:] = [sorted(c)[len(c) // 2] if c else None for c in mhz]
    return [sorted(t)[len(t) // 2] for t in times]


def host_calls_us(fn, calls: int, no_gc: bool = False) -> list[float]:
    """Host time of each of ``calls`` back-to-back calls of ``fn``, µs (``time.perf_counter`` around each call;
    nothing synchronises with the GPU, which runs behind). ``no_gc``: the garbage collector off meanwhile."""
    if no_gc:
        gc.disable()
    try:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        if no_gc:
            gc.enable()
    return times


def host_loop_us(fn, calls: int = 2000, repeats: int = 5, sync=None) -> float:
    """Host µs a call of ``fn``: ``calls`` back-to-back calls timed together, the best of ``repeats`` loops (a
    ``sync()`` after each, untimed; default torch.cuda.synchronize). For calls of a few µs, where timing each call
    alone would add its own cost."""
    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        sync()
    return best


def median(values: list[float]) -> float:
    """The median of ``values`` (the upper one of the middle two for an even count)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def page_cache(k: torch.Tensor, v: torch.Tensor, batch: int, seqlen: int, page: int, perm: torch.Tensor):
    """``k`` and ``v`` ``[batch * seqlen, heads, d]`` (seqlen a multiple of ``page``) copied into a page cache
    ``[pages, page, heads, d]`` with the batch's logical page i at slot ``perm[i]``; returns ``((k_cache,
    v_cache), table)``, table holding the page-table arguments of ``BatchPrefillWrapper.plan``."""
    shape = (batch * seqlen // page, page, *k.shape[1:])
    slots = perm.to(k.device)
    kp = torch.empty(shape, dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    kp[slots] = k.view(shape)
    vp[slots] = v.view(shape)
    table = {"kv_indptr": np.arange(batch + 1) * (seqlen // page), "kv_indices": perm.to(torch.int32).to(k.device),
             "kv_last_page_len": np.full(batch, page)}
    return (kp, vp), table


def copy_rate() -> float:
    """Device copy rate, GB/s of bytes read plus written, on a 2 GiB buffer."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 20) / 1e3


def matmul_rate() -> float:
    """bf16 8192³ matmul rate, TFLOP/s (median of 20, random data)."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / timed(lambda: a @ b, 20) / 1e6


def commit(given: str = "") -> str:
    """The commit measured: given on the command line (the device copy has no .git), else HEAD of the checkout
    flashgen is imported from, else (an installed flashgen) its version."""
    if given:
        return given
    root = Path(__file__).resolve().parents[2]
    if (root / "flashgen").is_dir() and (root / "pyproject.toml").is_file():
        try:
            out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
        except OSError:  # no git
            out = None
        if out is not None and out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    from .._version import __version__

    return f"v{__version__}"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def save_results(result: dict, out: Path, markdown, plot) -> None:
    """Write ``result`` as JSON at ``out``, its markdown table beside it (.md) and its plot (.png); print the table."""
    out = Path(out)
    out.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    plot(result, out.with_suffix(".png"))
    print(table)
