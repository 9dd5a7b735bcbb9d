"""Host time of the serving loop's decode route on the CPU: ``derive_levels`` alone (CSR, and with the block
table), the route's decision (``WrapperAttention.route``, 8 layers, for a step that would replay a CUDA graph
and for an eager one) and the cascade's whole host path (route + ``plan()``, the cascade forced; CUDA calls
stubbed, tests/stub_cuda.py), on decode batches shaped like
``flashgen demo``'s (128 requests, a third sharing a 32-page system prompt, 1-48 pages of their own) and like a
long shared prefix (128 requests sharing 64-2048 pages, 16 pages each of their own: 80-2064 pages a request).

    PYTHONPATH=$PWD python benchmarks/experiments/exp_cascade_route_host.py [--profile CASE]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from flashgen.kvcache.tables import build_tables
from flashgen.plan.cascade_cost import CascadePolicy
from flashgen.plan.cascade import derive_levels
from flashgen.serve.backends import StepPlan, WrapperAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from stub_cuda import stubbed_cuda  # noqa: E402  (tests/stub_cuda.py)

PAGE = 16


def batch(shared_pages: int, sharers: int, own: tuple[int, int], n: int = 128, seed: int = 0) -> list[list[int]]:
    """Page lists of ``n`` requests, the first ``sharers`` starting with the same ``shared_pages`` pages (as the
    engine orders them: sharers next to each other), each with ``own`` (low, high) pages of its own."""
    rng = np.random.default_rng(seed)
    shared = list(range(shared_pages))
    nxt = shared_pages
    lists = []
    for b in range(n):
        k = int(rng.integers(own[0], own[1] + 1))
        mine = list(range(nxt, nxt + k))
        nxt += k
        lists.append((shared if b < sharers else []) + mine)
    return lists


CASES = {
    "demo": lambda: batch(32, 43, (1, 48)),
    **{f"shared-{p}": (lambda p=p: batch(p, 128, (16, 16))) for p in (64, 512, 2048)},
}


def low_us(fn, reps: int = 200, quantile: float = 0.1) -> float:
    """µs of ``fn``: the ``quantile`` of ``reps`` timings (a low one filters out a shared machine's preemptions)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.quantile(times, quantile) * 1e6)


def setup(name: str, policy: CascadePolicy | None = None):
    lists = CASES[name]()
    tables = build_tables(lists, [len(p) * PAGE for p in lists], PAGE)
    backend = WrapperAttention(128, PAGE, 32, 8, device="cpu", cascade_policy=policy)
    num_pages = int(tables.kv_indices_host.max()) + 1
    return backend, tables, num_pages


def step(tables, graph: bool) -> StepPlan:
    out = StepPlan(tables, None)
    out.layers, out.graph = 8, graph  # the demo's 8 layers; whether a flat step would replay a graph
    return out


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", help="a case to profile (the cascade's route + plan) with cProfile")
    args = parser.parse_args()
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    from flashgen.api import cascade as cascade_module

    never = CascadePolicy(fold="never")
    with stubbed_cuda(), mock.patch.object(cascade_module, "resolve_device", cpu):
        if args.profile:
            backend, tables, num_pages = setup(args.profile, never)
            s = step(tables, False)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                backend.route(s)
                backend.plan(s, num_pages)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumtime").print_stats(30)
            return
        for name in CASES:
            backend, tables, num_pages = setup(name)
            line = [f"{name:12} pages {int(tables.kv_indptr[-1]):6d}"]
            csr = (np.arange(129), tables.kv_indptr.numpy(), tables.kv_indices_host.numpy(),
                   tables.kv_last_page_len.numpy(), PAGE)
            line.append("derive_levels %6.1f" % low_us(lambda: derive_levels(*csr)))
            try:
                rows = tables.block_table_host.numpy()
                line.append("(block table %6.1f)" % low_us(lambda: derive_levels(*csr, block_table=rows)))
            except TypeError:  # a tree without derive_levels(block_table=)
                pass
            for graph in (True, False):
                s = step(tables, graph)
                line.append(f"route({'graph' if graph else 'eager'}) %7.1f ({backend.route(s)})"
                            % low_us(lambda: backend.route(s)))
            forced, _, _ = setup(name, never)
            s = step(tables, False)

            def cascade():
                forced.route(s)
                forced.plan(s, num_pages)

            line.append("cascade route+plan %7.1f" % low_us(cascade))
            print("  ".join(line) + "  (us)", flush=True)


if __name__ == "__main__":
    main()
