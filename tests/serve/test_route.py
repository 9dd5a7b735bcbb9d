"""The decode rows' route by host and GPU time together (flashgen/serve/route.py), on the CPU: the demo's shapes
go flat (replayed or eager) without deriving levels; a long shared prefix under a big batch goes through the
cascade; a replayable step asks more of the cascade than an eager one; the engine hands the route its layers and
whether the step would replay."""

from __future__ import annotations

import doctest
from unittest import mock

import numpy as np
import pytest

from flashgen.kvcache.tables import build_tables
from flashgen.plan.cascade_cost import CascadePolicy
from flashgen.serve import Engine, EngineConfig, ModelConfig, ReferenceAttention, Request, TinyLlama, route
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


def test_a_replayable_step_asks_more_of_the_cascade_than_an_eager_one():
    # a 2k shared prefix saves ~230 us of reads a layer: more than the cascade's extra plan and launches, less
    # than the eager layers a replayed step does not pay
    tables = decode_tables(128, 128, (4, 8))
    eager, replayed = (route_decode(tables, SPEC, **DEMO, graph=graph) for graph in (False, True))
    assert (eager.name, replayed.name) == ("cascade", "flat")
    assert replayed.cascade_us is None  # settled by the bound, no levels derived
    assert eager.cascade_us < eager.flat_us
    # one layer saves an eighth as much: the eager step goes flat too
    assert route_decode(tables, SPEC, 32, 8, layers=1).name == "flat"
    # free host work: the GPU-time model's answer
    free = HostCosts(*(0.0,) * len(HostCosts._fields))
    assert route_decode(tables, SPEC, **DEMO, graph=True, host_costs=free).name == "cascade"


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
