"""The host time of the wrappers' plan() without a GPU: the CUDA calls (pinned allocation, events, the async
copy, kernel loading) are stubbed, so what is timed is the Python and numpy work around the planner. On the
H200 host add one ``copy_`` (~5 µs) and one event record per plan; benchmarks/bench_host.py times the real
thing there.

    PYTHONPATH=$PWD python benchmarks/experiments/plan_host_stubbed.py [--profile decode-64] [--stages]

``decode-dev-B`` cases hand the page ids over as a "device" tensor (a CPU tensor that says it is a CUDA one), as
bench_host.py does on the GPU; ``decode-B`` cases pass them on the host (validated in full and uploaded).
``--stages`` times each stage of plan() (page-table intake, planner, upload, params...) by wrapping it with
a timer (~0.3 us of overhead each); the stages' medians need not add up to the total's.
"""

from __future__ import annotations

import argparse
import sys
import cProfile
import pstats
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import flashgen
from flashgen.api import decode, portable, prefill, sm90, staging, wrapper
from flashgen.kernels import params
from flashgen.spec import AttentionSpec, Causal, Paged, Ragged

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from stub_cuda import stubbed_cuda  # noqa: E402  (tests/stub_cuda.py)


class _DeviceIds(torch.Tensor):
    """A CPU tensor that the wrappers take for a device one (page ids read in place, never validated)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = True


def decode_case(batch: int, seed: int = 0, device_ids: bool = False):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 4096, batch)
    pages = -(-lens // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = (lens - (pages - 1) * 16).astype(np.int32)
    w = flashgen.BatchDecodeWrapper(AttentionSpec(128, kv_layout=Paged(16)), num_sms=132)
    indices = torch.from_numpy(rng.permutation(int(indptr[-1])).astype(np.int32))
    if device_ids:
        indices = torch.Tensor._make_subclass(_DeviceIds, indices)
    kw = dict(kv_indptr=indptr, kv_indices=indices if device_ids else indices.numpy(), kv_last_page_len=last,
              num_qo_heads=32, num_kv_heads=8)
    return w, kw


def prefill_case(batch: int, qo_len: int, backend: str):
    qo = np.arange(batch + 1, dtype=np.int32) * qo_len
    w = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), num_sms=132,
                                     backend=backend)
    return w, dict(qo_indptr=qo, kv_indptr=qo.copy(), num_qo_heads=32, num_kv_heads=8)


CASES = {
    **{f"decode-{b}": (lambda b=b: decode_case(b)) for b in (1, 8, 64, 256)},
    **{f"decode-dev-{b}": (lambda b=b: decode_case(b, device_ids=True)) for b in (1, 8, 64, 256)},
    **{f"{backend}-{b}x{n}": (lambda b=b, n=n, backend=backend: prefill_case(b, n, backend))
       for backend in ("portable", "sm90") for b, n in ((1, 128), (16, 1024))},
}


def median_us(fn, warmup: int = 20, reps: int = 300) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


# (stage, module or class, attribute): what --stages wraps with a timer
STAGES = (
    ("page_table", decode, "page_table"), ("page_table", prefill, "page_table"),
    ("qo_indptr", prefill, "host_array"), ("runtime", wrapper.WrapperCore, "runtime"),
    ("planner", staging.HostStaging, "plan"), ("table_extras", decode, "table_extras"),
    ("table_extras", portable, "table_extras"), ("table_extras", sm90, "table_extras"),
    ("upload", wrapper.WrapperCore, "upload"), ("page_fields", decode, "page_fields"),
    ("page_fields", portable, "page_fields"), ("page_fields", sm90, "page_fields"),
    ("buffers", staging.DeviceBuffer, "get"), ("buffers", wrapper.WrapperCore, "counters"),
    ("split_kv_fields", decode, "split_kv_fields"), ("split_kv_fields", portable, "split_kv_fields"),
    ("pack", params.BoundParams, "pack"), ("set_planned", wrapper.WrapperCore, "set_planned"),
)


def stage_times(w, kw, reps: int = 300, quantile: float = 0.5) -> dict[str, float]:
    """µs of each stage over ``reps`` plans (each stage's calls within one plan summed): the ``quantile`` of
    the plans' times (a low one filters out the preemptions of a shared machine)."""
    now = time.perf_counter
    acc: dict[str, float] = defaultdict(float)

    def timed(stage, fn):
        def call(*args, **kwargs):
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[stage] += now() - t0
        return call

    per: dict[str, list] = defaultdict(list)
    with ExitStack() as stack:
        for stage, owner, name in STAGES:
            stack.enter_context(mock.patch.object(owner, name, timed(stage, getattr(owner, name))))
        for i in range(reps + 20):
            acc.clear()
            t0 = now()
            w.plan(**kw)
            acc["total"] = now() - t0
            if i >= 20:
                for stage, t in acc.items():
                    per[stage].append(t)
    return {stage: float(np.quantile(ts, quantile) * 1e6) for stage, ts in per.items()}


def main() -> None:
    torch.set_num_threads(1)  # the stand-in device copies are CPU copies: keep them off a thread pool
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", help="a case to profile with cProfile instead of timing all")
    parser.add_argument("--stages", action="store_true", help="time each stage of plan() (medians, us)")
    parser.add_argument("--quantile", type=float, default=0.5, help="--stages: the quantile of the plans' times")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    names = args.cases.split(",") if args.cases else list(CASES)
    with stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
        if args.profile:
            w, kw = CASES[args.profile]()
            for _ in range(20):
                w.plan(**kw)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                w.plan(**kw)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        for name in names:
            w, kw = CASES[name]()
            if args.stages:
                times = stage_times(w, kw, quantile=args.quantile)
                print(f"{name:18} " + " ".join(f"{k}={v:.1f}" for k, v in times.items()), flush=True)
                continue
            print(f"{name:20} plan() {median_us(lambda: w.plan(**kw)):7.1f} us (CUDA calls stubbed)")


if __name__ == "__main__":
    main()
