"""What paging is for, measured by the loop on the CPU path: the contiguous-reservation baseline, parallel sampling
through fork, every out-of-pages policy under pressure, the page-size sweep, the plot, the cascade route; and on
a GPU the graph-replayed decode against eager decode, the cascade against flat decode, the cascade replayed from
graphs against the eager cascade, the fused RoPE write."""

from __future__ import annotations

import builtins
import random

import pytest
import torch

from flashgen.cli import main
from flashgen.kvcache import KVCacheError, PagedKVCache
from flashgen.plan.cascade_cost import CascadePolicy
from flashgen.serve import (Engine, EngineConfig, ModelConfig, ReferenceAttention, Request, TinyLlama,
                            dense_generate, studies)
from flashgen.serve.backends import cascade_tables
from flashgen.serve.engine import CHILD_STRIDE
from flashgen.serve.plot import write_plot

CONFIG = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, hidden=64, intermediate=128, vocab=128,
                     seed=5)


@pytest.fixture(scope="module")
def model():
    return TinyLlama(CONFIG)


def backend(page_size: int, policy=None):
    return ReferenceAttention(64, page_size, 4, 2, cascade_policy=policy)


def requests(n: int, seed: int = 0, system: int = 9, prompt=(2, 12), output=(2, 10), samples: int = 1):
    rng = random.Random(seed)
    shared = [rng.randrange(CONFIG.vocab) for _ in range(system)]
    return [Request(rid, (shared if rid % 2 == 0 else []) + [rng.randrange(CONFIG.vocab)
                                                             for _ in range(rng.randint(*prompt))],
                    rng.randint(*output), n=samples if rid % 3 == 1 else 1) for rid in range(n)]


def assert_dense(model, outputs: dict, reqs, temperature=0.0, seed=0):
    by_id = {r.rid: r for r in reqs}
    expected = sum(r.n for r in reqs)
    assert len(outputs) == expected, f"{len(outputs)} completions served, expected {expected}"
    for rid, out in outputs.items():
        r = by_id[rid % CHILD_STRIDE]
        want, _ = dense_generate(model, r.prompt, r.max_new_tokens, rid, temperature, seed)
        assert out == want, f"request {rid}"


def test_paged_against_a_contiguous_reservation_at_one_budget(model):
    reqs = requests(10, seed=1)
    config = EngineConfig(num_pages=40, page_size=4, max_tokens_per_step=32, max_batch=16)
    paged, contiguous = studies.compare_contiguous(model, config, backend, reqs)
    max_len = studies.max_length(reqs)
    c = contiguous.config
    assert (c.page_size, c.num_pages) == (max_len, 160 // max_len) and not c.prefix_cache
    # a reservation never grows: at most num_pages requests at once, and nothing preempted
    assert contiguous.summary.peak_batch <= c.num_pages and contiguous.summary.preemptions == 0
    assert contiguous.summary.peak_pages <= c.num_pages and paged.summary.peak_pages <= 40
    assert paged.summary.peak_batch > contiguous.summary.peak_batch
    assert paged.summary.mean_batch > contiguous.summary.mean_batch
    assert paged.summary.steps < contiguous.summary.steps
    assert paged.outputs == contiguous.outputs
    assert_dense(model, paged.outputs, reqs)
    text = studies.format_contiguous(paged, contiguous)
    assert f"fits {c.num_pages} reservation(s) of {max_len} tokens" in text and "x the tokens/s" in text
    with pytest.raises(ValueError, match="pages: a budget of 2 x 4 = 8 token slots"):
        studies.contiguous_config(EngineConfig(num_pages=2, page_size=4), max_len)


def test_forked_completions_equal_independent_requests_with_the_same_prompt(model):
    reqs = requests(6, seed=2, samples=3)
    run, engine = studies.serve(model, EngineConfig(num_pages=64, page_size=4, max_tokens_per_step=16,
                                                    temperature=0.8, seed=7), backend, reqs, "fork")
    assert engine.forks == 2 * sum(r.n > 1 for r in reqs)
    assert_dense(model, run.outputs, reqs, temperature=0.8, seed=7)
    children = [r for r in engine.finished if r.parent is not None]
    assert children and all(r.parent == r.rid % CHILD_STRIDE for r in children)
    assert len({tuple(run.outputs[r.rid]) for r in engine.finished if r.rid % CHILD_STRIDE == 1}) > 1  # they differ
    assert engine.cache.stats().pages_in_use == 0


def test_fork_shares_the_prompt_pages():
    small = TinyLlama(ModelConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64, hidden=32,
                                  intermediate=64, vocab=64))
    engine = Engine(small, EngineConfig(num_pages=32, page_size=4, max_tokens_per_step=64), backend(4))
    engine.submit([Request(0, list(range(1, 14)), 5, n=4)])
    engine.step()  # the prompt's 13 tokens: 4 pages, then 3 forks
    assert engine.forks == 3 and len(engine.running) == 4
    pages = [engine.cache.pages(r.rid) for r in engine.running]
    assert all(p == pages[0] for p in pages) and engine.cache.stats().pages_in_use == 4
    engine.step()  # each writes its own token: the shared partial last page is copied for 3 of the 4
    assert engine.cache.stats().pages_in_use == 4 + 3


@pytest.mark.parametrize("policy", ["raise", "evict", "swap", "recompute"])
def test_every_policy_serves_every_request_under_pressure(model, policy):
    reqs = requests(8, seed=3, system=8, prompt=(6, 10), output=(10, 14))
    config = EngineConfig(num_pages=12, page_size=4, max_tokens_per_step=24, max_batch=8)
    (run,) = studies.compare_policies(model, config, backend, reqs, policies=(policy,), max_steps=800)
    s = run.summary
    assert s.policy == policy and s.peak_pages <= 12
    assert_dense(model, run.outputs, reqs)
    assert s.delayed_admissions > 0
    if policy == "swap":
        assert s.swaps > 0 and s.preemptions == s.swaps
    if policy == "recompute":
        assert s.preemptions > 0 and s.swaps == 0
    if policy in ("raise", "evict"):
        assert s.swaps == 0 and s.stalls + s.preemptions > 0
    assert "p99 token" in studies.format_policies([run])


def test_pressure_config_and_policy_names(model):
    reqs = requests(8, seed=3)
    config = studies.pressure_config(EngineConfig(num_pages=500, page_size=4), reqs)
    assert studies.pages_for(reqs, 4) < config.num_pages < 500
    with pytest.raises(ValueError, match="policies: got 'lru'"):
        studies.compare_policies(model, config, backend, reqs, policies=("lru",))


def test_page_size_sweep_reports_tail_waste_beside_step_time(model):
    reqs = requests(6, seed=4)
    runs = studies.sweep_page_size(model, EngineConfig(num_pages=48, page_size=4, max_tokens_per_step=32), backend,
                                   reqs, sizes=(1, 4, 16, 64))
    assert [r.config.page_size for r in runs] == [1, 4, 16, 64]
    assert [r.config.num_pages for r in runs] == [192, 48, 12, max(3, studies.pages_for(reqs, 64))]
    assert runs[0].summary.waste_fraction == 0 == runs[0].summary.max_waste_per_seq
    for run in runs:
        assert run.summary.max_waste_per_seq < run.config.page_size and run.summary.mean_decode_step > 0
        assert run.outputs == runs[0].outputs
    assert runs[-1].summary.waste_fraction > runs[1].summary.waste_fraction
    text = studies.format_sweep(runs)
    assert "tail waste" in text and len(text.splitlines()) == 2 + len(runs)


def test_a_warm_run_serves_a_few_requests_first_and_measures_the_same_workload(model):
    built = []

    def counting(page_size):
        built.append(page_size)
        return backend(page_size)

    reqs = requests(6, seed=2)
    config = EngineConfig(num_pages=48, page_size=4, max_tokens_per_step=32)
    cold, engine = studies.serve(model, config, counting, reqs, "cold")
    assert built == [4] and len(engine.finished) == len(reqs)
    warm, engine = studies.serve(model, config, counting, reqs, "warm", warm=True)
    assert built == [4, 4, 4], "a warm-up engine, then the measured one"
    assert len(engine.finished) == len(reqs) and warm.outputs == cold.outputs
    assert warm.summary.steps == cold.summary.steps


def test_the_cascade_route_equals_flat_attention(model):
    reqs = requests(8, seed=5, system=13)
    config = EngineConfig(num_pages=64, page_size=4, max_tokens_per_step=64)
    cascade = Engine(model, config, backend(4, CascadePolicy(fold="never")))
    cascade.submit(studies.fresh(reqs))
    cascade.run(300)
    assert any(r.route == "cascade" for r in cascade.records)
    assert_dense(model, {r.rid: r.output for r in cascade.finished}, reqs)
    flat = Engine(model, config, backend(4, CascadePolicy(fold="always")))
    flat.submit(studies.fresh(reqs))
    flat.run(300)
    assert {r.route for r in flat.records} <= {"flat", ""}


def test_cascade_tables_group_requests_that_share_leading_pages():
    cache = PagedKVCache(32, 4, 2, 8, torch.float32)
    prompt = list(range(1, 10))  # two full pages shared through the prefix cache
    for rid, tail in enumerate(([20], [21, 22], [23])):
        cache.add(rid, tokens=prompt + tail)
        cache.append(rid, torch.zeros(len(prompt) + len(tail), 2, 8), torch.zeros(len(prompt) + len(tail), 2, 8))
    cache.add(9)
    cache.append(9, torch.zeros(5, 2, 8), torch.zeros(5, 2, 8))
    spec = backend(4).decode_spec
    tables = cascade_tables(cache.page_tables([0, 1, 2, 9]), spec, 4, 2, CascadePolicy(fold="never"))
    assert len(tables) == 2 and tables[0].kv_lens.tolist() == [8, 0]
    assert cascade_tables(cache.page_tables([0, 1, 2, 9]), spec, 4, 2, CascadePolicy(fold="always")) is None
    assert cascade_tables(cache.page_tables([0]), spec, 4, 2) is None


def test_the_gpu_backend_plans_each_route_of_a_step_with_kernels_stubbed(shared_prefix_cache):
    """WrapperAttention's plan() calls (flat decode, cascade, paged prefill, the graph-mode decode of a bucket)
    take the manager's tables as they come, on a machine without a GPU (tests/stub_cuda.py)."""
    from unittest import mock

    import numpy as np

    from stub_cuda import on_device, stubbed_cuda

    from flashgen.api import BatchDecodeWrapper
    from flashgen.api import cascade as cascade_module
    from flashgen.serve import StepPlan, WrapperAttention

    cache = shared_prefix_cache
    cpu = lambda device=None: torch.device("cpu")  # noqa: E731
    with stubbed_cuda(), mock.patch.object(cascade_module, "resolve_device", cpu), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (8, 0)):
        step = StepPlan(cache.page_tables([0, 1, 2, 5]), (np.array([0, 3, 5], np.int32), cache.page_tables([0, 5])))
        kv = tuple(on_device(t) for t in cache.kv)
        q = on_device(torch.zeros(9, 4, 64, dtype=torch.bfloat16))
        shared = WrapperAttention(64, 4, 4, 2, device="cpu", cascade_policy=CascadePolicy(fold="never"))
        assert shared.route(step) == "cascade"
        shared.plan(step, 64)
        assert [level.runs for level in shared.cascade.levels] == ["portable", "decode"]
        assert shared.cascade.levels[0].kv_tokens == 8  # the two shared pages, once
        flat = WrapperAttention(64, 4, 4, 2, device="cpu", cascade_policy=CascadePolicy(fold="always"))
        assert flat.route(step) == "flat"
        flat.plan(step, 64)
        assert flat.run(q, kv).shape == (9, 4, 64)
        graph = BatchDecodeWrapper(flat.decode_spec, use_cuda_graph=True, max_batch_size=8, device="cpu",
                                   max_num_pages=8 * 64)
        tables = step.decode
        graph.plan(kv_indptr=tables.kv_indptr, kv_indices=on_device(tables.kv_indices), num_pages=64,
                   kv_last_page_len=tables.kv_last_page_len, num_qo_heads=4, num_kv_heads=2)
        assert graph.run(on_device(torch.zeros(8, 4, 64, dtype=torch.bfloat16)), kv).shape == (8, 4, 64)


def test_plot_file_written(model, tmp_path):
    pytest.importorskip("matplotlib")
    run, engine = studies.serve(model, EngineConfig(num_pages=32, page_size=4), backend, requests(4), "plot")
    path = tmp_path / "run.png"
    assert "written to" in write_plot(engine, str(path))
    assert path.stat().st_size > 1000


def test_plot_without_matplotlib_says_so(model, monkeypatch, tmp_path):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    _, engine = studies.serve(model, EngineConfig(num_pages=32, page_size=4), backend, requests(2), "plot")
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    message = write_plot(engine, str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in message and not (tmp_path / "x.png").exists()


def test_cache_write_takes_a_layer_s_heads():
    cache = PagedKVCache(4, 2, 4, 8, torch.float32, kv_form="pair")
    cache.add("a")
    slots = cache.allocate("a", 3)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.write(slots, k, v, heads=slice(2, 4))
    gk, gv = cache.gather("a")
    assert torch.equal(gk[:, 2:], k) and torch.equal(gv[:, 2:], v) and not gk[:, :2].any()
    with pytest.raises(KVCacheError, match="heads: got slice"):
        cache.write(slots, k, v, heads=slice(3, 6))
    with pytest.raises(KVCacheError, match=r"k: expected a tensor \[n, 4, 8\]"):
        cache.write(slots, k, v)
    with pytest.raises(KVCacheError, match=r"slot_mapping: expected a tensor \[3\]"):
        cache.write(slots[:2], k, v, heads=slice(0, 2))
    with pytest.raises(KVCacheError, match="seq_id: preempt\\('a'\\) swaps a sequence out; this cache has "
                                           "out_of_pages='raise'"):
        cache.preempt("a")
    from flashgen.spec import RoPE

    with pytest.raises(ValueError, match="rope: rotating K on the write needs the CUDA append kernel"):
        cache.write(slots, k, v, heads=slice(0, 2), positions=torch.arange(3), rope=RoPE())


def test_engine_errors_name_the_argument(model):
    with pytest.raises(ValueError, match="out_of_pages: got 'lru'"):
        EngineConfig(out_of_pages="lru")
    with pytest.raises(ValueError, match="headroom: got -1"):
        EngineConfig(headroom=-1)
    engine = Engine(model, EngineConfig(), backend(4))
    with pytest.raises(ValueError, match=r"requests\[0\]: n = 0"):
        engine.submit([Request(0, [1, 2], 2, n=0)])
    with pytest.raises(ValueError, match=r"requests\[0\]: id -1 with n = 2"):
        engine.submit([Request(-1, [1, 2], 2, n=2)])
    engine.submit([Request(1, [1, 2], 2, n=2)])
    with pytest.raises(ValueError, match=r"requests\[0\]: id 1048577 .* already queued"):
        engine.submit([Request(1 + CHILD_STRIDE, [1, 2], 2)])


def test_first_token_counts_from_the_process_start():
    from types import SimpleNamespace

    from flashgen.serve.report import first_token_line, process_age

    age = process_age()
    assert age is not None and 0 < age < 24 * 3600  # this process: started before the test, not a day ago
    engine = SimpleNamespace(finished=[SimpleNamespace(token_times=[0.75, 0.9]), SimpleNamespace(token_times=[0.5]),
                                       SimpleNamespace(token_times=[])])
    line = first_token_line(engine, 2.0)
    assert line.startswith("first token         2.50 s after the process started (2.00 s to the loop"), line
    assert first_token_line(engine, None) is None
    assert first_token_line(SimpleNamespace(finished=[]), 2.0) is None


def test_the_command_runs_the_loop_and_its_studies(capsys, tmp_path):
    argv = ["demo", "--cpu", "--requests", "5", "--layers", "1", "--vocab", "64", "--samples", "2",
            "--temperature", "0.5", "--compare-contiguous", "--policies", "--sweep-page-size",
            "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("no GPU visible", "tokens/s", "first token ", "against the dense reference loop: equal", "completion(s) forked",
                 "paged vs contiguous", "out-of-pages policies", "page-size sweep", "plot "):
        assert text in out, text
    assert "FAILED" not in out
    assert main(["demo", "--cpu", "--samples", "0"]) == 2
    assert "--samples: got 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- GPU


def gpu_engine(config: EngineConfig, policy=None, model_config=CONFIG):
    from flashgen.serve import WrapperAttention

    gpu_model = TinyLlama(model_config, "cuda", torch.bfloat16)
    return Engine(gpu_model, config, WrapperAttention(64, config.page_size, 4, 2, cascade_policy=policy))


@pytest.mark.cuda
def test_graph_replayed_decode_equals_eager_decode():
    from dataclasses import replace

    from flashgen.serve import check_against_dense

    config = EngineConfig(num_pages=64, page_size=16, max_tokens_per_step=64, max_batch=8)
    outs = {}
    for graphs in (True, False):
        engine = gpu_engine(replace(config, cuda_graphs=graphs))
        engine.submit(requests(10, seed=8, output=(4, 20)))
        engine.run(max_steps=500)
        assert engine.idle
        assert ("graph" in {r.route for r in engine.records}) == graphs
        if graphs:
            assert engine.graphs.captures >= 2 and engine.graphs.replays > engine.graphs.captures
        result = check_against_dense(engine.model, engine.finished, tol=0.25)
        assert result.ok, result.failures
        outs[graphs] = {r.rid: r.output for r in engine.finished}
    # the graph's wrapper plans for a fixed capacity (its split-KV partition may differ): bf16 near-ties aside,
    # the tokens are the eager run's
    same = sum(outs[True][rid] == outs[False][rid] for rid in outs[False])
    assert same >= len(outs[False]) - 1


@pytest.mark.cuda
def test_cascade_decode_equals_flat_decode_on_the_gpu():
    from flashgen.serve import check_against_dense

    config = EngineConfig(num_pages=64, page_size=16, max_tokens_per_step=128, cuda_graphs=False)
    outs = {}
    for fold in ("never", "always"):
        engine = gpu_engine(config, CascadePolicy(fold=fold))
        engine.submit(requests(8, seed=9, system=40))
        engine.run(max_steps=500)
        assert ("cascade" in {r.route for r in engine.records}) == (fold == "never")
        result = check_against_dense(engine.model, engine.finished, tol=0.25)
        assert result.ok, result.failures
        outs[fold] = {r.rid: r.output for r in engine.finished}
    same = sum(outs["never"][rid] == outs["always"][rid] for rid in outs["never"])
    assert same >= len(outs["never"]) - 1  # bf16: a near-tie may part them


@pytest.mark.cuda
def test_cascade_decode_replayed_from_graphs_equals_the_eager_cascade():
    from dataclasses import replace

    from flashgen.serve import check_against_dense

    config = EngineConfig(num_pages=64, page_size=16, max_tokens_per_step=128, max_batch=8)
    outs = {}
    for graphs in (True, False):
        engine = gpu_engine(replace(config, cuda_graphs=graphs), CascadePolicy(fold="never"))
        engine.submit(requests(8, seed=9, system=40))
        engine.run(max_steps=500)
        assert engine.idle
        routes = {r.route for r in engine.records}
        assert ("cascade graph" in routes) == graphs and (graphs or "cascade" in routes), routes
        if graphs:
            assert any(route == "cascade" for route, _ in engine.graphs._built)
            assert engine.graphs.replays > engine.graphs.captures
        result = check_against_dense(engine.model, engine.finished, tol=0.25)
        assert result.ok, result.failures
        outs[graphs] = {r.rid: r.output for r in engine.finished}
    same = sum(outs[True][rid] == outs[False][rid] for rid in outs[False])
    assert same >= len(outs[False]) - 1  # bf16: a near-tie may part them


@pytest.mark.cuda
def test_the_fused_rope_write_equals_the_model_s_rotation():
    from flashgen.serve.model import rope
    from flashgen.spec import RoPE

    cache = PagedKVCache(8, 16, 4, 64, torch.bfloat16, device="cuda", kv_form="pair")
    cache.add("a")
    slots = cache.allocate("a", 20).cuda()
    pos = torch.arange(20, dtype=torch.int32, device="cuda")
    k, v = torch.randn(20, 2, 64, device="cuda", dtype=torch.bfloat16), torch.randn(20, 2, 64, device="cuda",
                                                                                    dtype=torch.bfloat16)
    cache.write(slots, k, v, heads=slice(2, 4), positions=pos, rope=RoPE(10000.0))
    gk, gv = cache.gather("a")
    torch.testing.assert_close(gk[:, 2:].float(), rope(k, pos, 10000.0).float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(gv[:, 2:], v) and not gk[:, :2].any()
