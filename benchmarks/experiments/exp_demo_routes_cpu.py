"""The decode route of ``flashgen demo``'s GPU workload, on the CPU: the demo's requests (256, a third after one
512-token system prompt), pool (2048 pages of 16), budget and batch (2048 tokens, 128 requests) and attention
shape (8 layers, 32 q / 8 kv heads x 128) through the engine's scheduler and the backend's route, as on the GPU
(a decode-only step a bucket holds is marked replayable, as ``Engine`` marks it where CUDA graphs run); the
model is a narrow stand-in and attention returns zeros, so only the scheduling and the routes are real.
Prints the steps by route and the route's host time (it runs between CPU model steps: cold caches).

    PYTHONPATH=$PWD python benchmarks/experiments/exp_demo_routes_cpu.py      # ~70 s on the 2-core CI host
"""

from __future__ import annotations

import collections
import time

import torch

from flashgen.serve import Engine, EngineConfig, ModelConfig, ReferenceAttention, TinyLlama
from flashgen.serve.demo import workload
from flashgen.serve.graphs import buckets_for

MAX_BATCH = 128


class RoutesOnly(ReferenceAttention):
    """The reference backend's route (the GPU loop's), timed; attention a stand-in."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.times = collections.defaultdict(list)

    def route(self, step):
        step.graph = step.prefill is None and step.decode is not None and step.num_decode <= buckets_for(MAX_BATCH)[-1]
        t0 = time.perf_counter()
        route = super().route(step)
        self.times[route, step.graph].append(time.perf_counter() - t0)
        return route

    def run(self, q, kv):
        return torch.zeros_like(q)


def main() -> None:
    torch.set_num_threads(1)
    config = ModelConfig(num_layers=8, num_heads=32, num_kv_heads=8, head_dim=128, hidden=32, intermediate=32,
                         vocab=256)
    backend = RoutesOnly(128, 16, 32, 8)
    engine = Engine(TinyLlama(config), EngineConfig(num_pages=2048, page_size=16, max_tokens_per_step=2048,
                                                    max_batch=MAX_BATCH), backend)
    engine.submit(workload(256, config.vocab, 512, 0, long=True))
    engine.run()
    records = engine.records
    print(f"{len(records)} steps, mean batch {sum(r.live_seqs for r in records) / len(records):.1f}")
    for (route, graph), times in sorted(backend.times.items()):
        times.sort()
        print(f"{route or '(no decode rows)':8} {'replayable' if graph else 'eager':10} {len(times):4d} steps, route "
              f"median {times[len(times) // 2] * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
