"""The host time of the wrappers' plan() without a GPU: the CUDA calls (pinned allocation, events, the async
copy, kernel loading) are stubbed, so what is timed is the Python and numpy work around the planner. On the
H200 host add one ``copy_`` (~5 µs) and one event record per plan; benchmarks/bench_host.py times the real
thing there.

    PYTHONPATH=$PWD python benchmarks/experiments/plan_host_stubbed.py [--profile decode-64]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from contextlib import contextmanager
from unittest import mock

import numpy as np
import torch

import flashgen
from flashgen import jit
from flashgen.api import decode, prefill, staging
from flashgen.kernels import family
from flashgen.spec import AttentionSpec, Causal, Paged, Ragged


class _Function:
    def set_max_dynamic_shared_memory(self, nbytes):
        pass

    def launch_params(self, *args):
        pass


def fake_build(spec, op, device=None, arch=None, options=None):
    """A loaded-kernel stand-in: the family's launch config and params layouts, functions that do nothing."""
    fam = family(op, options)
    projected = fam.project(spec)
    entries = fam.entry_points(projected)
    return jit.Kernel(op, fam.uri(projected), "sm_90a", 0, None, {e.name: _Function() for e in entries},
                      fam.launch(projected), {e.name: e.params for e in entries})


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@contextmanager
def stubbed_cuda():
    """Wrappers on the CPU: pinned buffers become plain ones, events and streams no-ops, kernels fakes."""
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        return real_empty(*args, **kwargs)

    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with mock.patch.object(decode, "resolve_device", cpu), mock.patch.object(prefill, "resolve_device", cpu), \
            mock.patch.object(staging.torch, "empty", empty), \
            mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: None), \
            mock.patch.object(jit, "build", fake_build):
        yield


def decode_case(batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 4096, batch)
    pages = -(-lens // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = (lens - (pages - 1) * 16).astype(np.int32)
    w = flashgen.BatchDecodeWrapper(AttentionSpec(128, kv_layout=Paged(16)), num_sms=132)
    kw = dict(kv_indptr=indptr, kv_indices=np.arange(indptr[-1], dtype=np.int32), kv_last_page_len=last,
              num_qo_heads=32, num_kv_heads=8)
    return w, kw


def prefill_case(batch: int, qo_len: int, backend: str):
    qo = np.arange(batch + 1, dtype=np.int32) * qo_len
    w = flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), num_sms=132,
                                     backend=backend)
    return w, dict(qo_indptr=qo, kv_indptr=qo.copy(), num_qo_heads=32, num_kv_heads=8)


CASES = {
    **{f"decode-{b}": (lambda b=b: decode_case(b)) for b in (1, 8, 64, 256)},
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


def main() -> None:
    torch.set_num_threads(1)  # the stand-in device copies are CPU copies: keep them off a thread pool
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", help="a case to profile with cProfile instead of timing all")
    args = parser.parse_args()
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
        for name, make in CASES.items():
            w, kw = make()
            print(f"{name:20} plan() {median_us(lambda: w.plan(**kw)):7.1f} us (CUDA calls stubbed)")


if __name__ == "__main__":
    main()
