"""The decode rows' route by host and GPU time together (flashgen/serve/route.py), on the CPU: the demo's shapes
go flat (replayed or eager) without deriving levels; a long shared prefix under a big batch goes through the
cascade; the host costs weigh against the reads saved; a replayable step derives no more levels than a cascade
graph runs; the engine hands the route its layers and whether the step would replay."""

from __future__ import annotations

import doctest
from unittest import mock

import numpy as np
import pytest
import torch

from flashgen.kvcache.tables import build_tables
from flashgen.plan.cascade_cost import CascadePolicy
from flashgen.serve import (Engine, EngineConfig, ModelConfig, ReferenceAttention, Request, StepPlan, TinyLlama,
                            route)
from flashgen.serve.backends import specs
from flashgen.serve.route import HostCosts, route_decode

PAGE = 16
DEMO = dict(num_qo_heads=32, num_kv_heads=8, layers=8)  # flashgen demo on a GPU: 8 layers, 32 q / 8 kv heads x 128
SPEC = specs(128, PAGE, "bfloat16")[0]


def decode_tables(shared_pages: int, sharers: int, own: tuple[int, int], batch: int = 128, seed: int = 0):
    """Page tables of ``batch`` decode rows, the first ``sharers`` starting with the same ``shared_pages`` pages
    (the engine puts requests that share leading pages next to each other), each with ``own`` pages of its own."""
    rng = np.random.default_rng(seed)
    lists, nxt = [], shared_pages
    for b in range(batch):
        k = int(rng.integers(own[0], own[1] + 1))
        lists.append((list(range(shared_pages)) if b < sharers else []) + list(range(nxt, nxt + k)))
        nxt += k
    return build_tables(lists, [len(p) * PAGE - int(rng.integers(0, PAGE)) for p in lists], PAGE)


def test_the_demo_s_decode_steps_go_flat_without_deriving_levels():
    # 128 rows, a third sharing the 512-token system prompt (32 pages), 1-48 pages of their own
    tables = decode_tables(32, 43, (1, 48))
    with mock.patch.object(route, "derive_levels", side_effect=AssertionError("levels derived")):
        for graph in (True, False):
            found = route_decode(tables, SPEC, **DEMO, graph=graph)
            assert found.name == "flat" and found.levels is None and found.cascade_us is None, graph
    # the GPU-time model alone would take the cascade here: the shared level does save reads
    assert route_decode(tables, SPEC, **DEMO, policy=CascadePolicy(fold="never")).name == "cascade"


def test_a_long_shared_prefix_under_a_big_batch_goes_through_the_cascade():
    tables = decode_tables(2048, 128, (16, 16))  # 32k shared keys, 256 of each request's own
    for graph in (True, False):
        found = route_decode(tables, SPEC, **DEMO, graph=graph)
        assert found.name == "cascade", graph
        assert found.cascade_us < found.flat_us / 5
        assert [int(t.kv_lens.sum()) for t in found.levels[:-1]] == [2048 * PAGE]
    assert route_decode(tables, SPEC, **DEMO, policy=CascadePolicy(fold="always")).name == "flat"


def test_the_step_model_weighs_the_host_against_the_reads_saved():
    # a 2k shared prefix saves ~230 us of reads a layer: over 8 layers more than the cascade's derivation, second
    # plan and (eager) two more launches a layer; over one layer less
    tables = decode_tables(128, 128, (4, 8))
    for graph in (True, False):
        found = route_decode(tables, SPEC, **DEMO, graph=graph)
        assert found.name == "cascade" and found.cascade_us < found.flat_us, graph
    one = route_decode(tables, SPEC, 32, 8, layers=1, graph=True)
    assert one.name == "flat" and one.cascade_us is None  # settled by the bound, no levels derived
    # a slow host: the eager cascade pays its plans and launches, a replayed one only its plans
    slow = HostCosts(plan_us=300.0, launch_us=100.0)
    eager, replayed = (route_decode(tables, SPEC, **DEMO, graph=graph, host_costs=slow) for graph in (False, True))
    assert (eager.name, replayed.name) == ("flat", "cascade")
    # free host work: the GPU-time model's answer, one layer too
    free = HostCosts(*(0.0,) * len(HostCosts._fields))
    assert route_decode(tables, SPEC, 32, 8, layers=1, graph=True, host_costs=free).name == "cascade"


def test_a_replayable_step_derives_at_most_the_graph_s_levels():
    # requests 0-3 share 64 pages, 0-1 another 64 beneath: three levels eager, two for a cascade graph (the
    # deeper shared pages stay in the last level)
    lists = [list(range(64)) + ([1000 + i for i in range(64)] if b < 2 else []) + [2000 + b] for b in range(4)]
    tables = build_tables(lists, [len(p) * PAGE for p in lists], PAGE)
    never = CascadePolicy(fold="never")
    assert len(route_decode(tables, SPEC, **DEMO, policy=never).levels) == 3
    capped = route_decode(tables, SPEC, **DEMO, policy=never, max_levels=route.CASCADE_LEVELS).levels
    assert len(capped) == 2 and capped[0].kv_lens.tolist() == [64 * PAGE]
    assert capped[1].kv_lens.tolist() == [65 * PAGE, 65 * PAGE, PAGE, PAGE]
    backend = ReferenceAttention(128, PAGE, 32, 8, cascade_policy=never)
    assert backend.route(StepPlan(tables, None, 8, graph=True)) == "cascade" and len(backend.levels) == 2
    assert backend.route(StepPlan(tables, None, 8, graph=False)) == "cascade" and len(backend.levels) == 3


def test_small_batches_and_nothing_shared_go_flat():
    assert route_decode(decode_tables(32, 1, (1, 4), batch=1), SPEC, **DEMO).name == "flat"
    assert route_decode(decode_tables(0, 0, (2048, 2048), batch=16), SPEC, **DEMO).name == "flat"


def test_route_errors_name_the_argument():
    tables = decode_tables(4, 4, (1, 2), batch=4)
    with pytest.raises(ValueError, match="layers: got 0, expected an int >= 1"):
        route_decode(tables, SPEC, 32, 8, layers=0)
    with pytest.raises(TypeError, match="host_costs: expected a HostCosts, got dict"):
        route_decode(tables, SPEC, 32, 8, host_costs={"launch_us": 1.0})
    with pytest.raises(ValueError, match=r"host_costs.layer_us: got -1.0, expected a finite number >= 0"):
        route_decode(tables, SPEC, 32, 8, host_costs=HostCosts(layer_us=-1.0))


def test_the_engine_hands_the_route_its_layers_and_whether_the_step_would_replay():
    config = ModelConfig(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, hidden=64, intermediate=128,
                         vocab=64, seed=1)
    seen = []

    class Recording(ReferenceAttention):
        def route(self, step):
            seen.append((step.layers, step.graph))
            return super().route(step)

    engine = Engine(TinyLlama(config), EngineConfig(num_pages=32, page_size=4), Recording(64, 4, 4, 2))
    engine.submit([Request(0, [1, 2, 3], 3), Request(1, [4, 5], 2)])
    engine.run(50)
    assert engine.idle and seen and set(seen) == {(3, False)}  # no CUDA graphs on the CPU


def test_docstring_examples():
    from flashgen.plan import cascade_cost

    for module in (route, cascade_cost):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_the_cpu_path_decodes_the_same_tokens_whichever_route():
    """The reference backend routes as the GPU loop does; both routes give the dense loop's tokens (the cascade
    forced here: the CPU demo's sizes route flat)."""
    from flashgen.serve import check_against_dense

    config = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, hidden=64, intermediate=128,
                         vocab=64, seed=2)
    model = TinyLlama(config)
    system = list(range(1, 14))
    reqs = [Request(rid, system + [20 + rid, 30 + rid], 4) for rid in range(4)]
    routes = {}
    for fold in ("cost", "never"):
        engine = Engine(model, EngineConfig(num_pages=48, page_size=4, max_tokens_per_step=64),
                        ReferenceAttention(64, 4, 4, 2, cascade_policy=CascadePolicy(fold=fold)))
        engine.submit([Request(r.rid, list(r.prompt), r.max_new_tokens) for r in reqs])
        engine.run(100)
        routes[fold] = {r.route for r in engine.records}
        result = check_against_dense(model, engine.finished, tol=1e-3)
        assert result.ok, result.failures
    assert "cascade" not in routes["cost"] and "cascade" in routes["never"]


def test_a_cascade_graph_bucket_plans_the_route_s_levels_with_kernels_stubbed(shared_prefix_cache):
    """A replayable cascade step: the route's levels (at most CASCADE_LEVELS) plan the bucket's graph-mode
    CascadeWrapper (its merge and the capture need CUDA: tests/serve/test_studies.py runs them on a GPU)."""
    from types import SimpleNamespace

    from stub_cuda import stubbed_cuda

    from flashgen.api import cascade as cascade_module
    from flashgen.serve import WrapperAttention
    from flashgen.serve.graphs import DecodeGraphs

    cache = shared_prefix_cache
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731

    def capture(self, bucket):
        bucket.graph, bucket.logits = SimpleNamespace(replay=lambda: None), torch.zeros(bucket.size, 8)

    with stubbed_cuda(), mock.patch.object(cascade_module, "resolve_device", cpu), \
            mock.patch.object(DecodeGraphs, "_capture", capture):
        backend = WrapperAttention(64, 4, 4, 2, device="cpu", cascade_policy=CascadePolicy(fold="never"))
        step = StepPlan(cache.page_tables([0, 1, 2, 5]), None, 2, graph=True)
        assert backend.route(step) == "cascade" and len(backend.levels) == 2
        engine = SimpleNamespace(backend=backend, cache=cache, config=SimpleNamespace(max_batch=8),
                                 model=SimpleNamespace(device=torch.device("cpu"),
                                                       config=SimpleNamespace(num_heads=4, num_kv_heads=2)))
        graphs = DecodeGraphs(engine)
        logits = graphs.forward([1, 2, 3, 4], np.arange(4), torch.arange(4, dtype=torch.int32), step.decode,
                                backend.levels)
        assert logits.shape == (4, 8) and graphs.replays == 1
        bucket = graphs._built["cascade", 4]
        assert [level.runs for level in bucket.wrapper.levels] == ["portable", "decode"]
        assert bucket.wrapper.levels[0].kv_tokens == 8  # the two shared pages, once
        # a flat step of the same size has its own bucket
        graphs.forward([1, 2, 3], np.arange(3), torch.arange(3, dtype=torch.int32),
                       cache.page_tables([0, 1, 5], "cpu"), None)
        assert set(graphs._built) == {("cascade", 4), ("flat", 4)}
