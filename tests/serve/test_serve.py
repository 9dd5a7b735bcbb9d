"""The serving loop on a tiny model through the CPU path (fp64 reference attention over the manager's tables):
its tokens equal the dense reference loop's, under memory pressure too (delayed admission, recompute
preemption), shared system prompts hit the prefix cache, and the summary's numbers hold together."""

from __future__ import annotations

import random

import pytest
import torch

from flashgen.cli import main
from flashgen.serve import (Engine, EngineConfig, ModelConfig, ReferenceAttention, Request, TinyLlama,
                            check_against_dense, dense_generate, summarize)

CONFIG = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, hidden=64, intermediate=128, vocab=128,
                     seed=3)


@pytest.fixture(scope="module")
def model():
    return TinyLlama(CONFIG)


def requests(n: int, seed: int = 0, system: int = 9, prompt=(2, 12), output=(2, 10)) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(CONFIG.vocab) for _ in range(system)]
    out = []
    for rid in range(n):
        prompt_ids = [rng.randrange(CONFIG.vocab) for _ in range(rng.randint(*prompt))]
        out.append(Request(rid, (shared if rid % 2 == 0 else []) + prompt_ids, rng.randint(*output)))
    return out


def serve(model, reqs, **config) -> Engine:
    engine = Engine(model, EngineConfig(**config), ReferenceAttention(64, config.get("page_size", 4), 4, 2))
    engine.submit(reqs)
    engine.run(max_steps=500)
    assert engine.idle and len(engine.finished) == len(reqs)
    return engine


def assert_equal_to_dense(model, engine, temperature=0.0, seed=0):
    for r in engine.finished:
        want, _ = dense_generate(model, r.prompt, r.max_new_tokens, r.rid, temperature, seed)
        assert r.output == want, f"request {r.rid}"


def test_tokens_equal_the_dense_loop(model):
    engine = serve(model, requests(8), num_pages=64, page_size=4, max_tokens_per_step=16)
    assert_equal_to_dense(model, engine)
    steps = engine.records
    assert any(r.decode_rows and r.prefill_tokens for r in steps), "no step mixed decode rows and prefill chunks"
    assert check_against_dense(model, engine.finished).ok


def test_memory_pressure_delays_admission_and_preempts_and_tokens_still_equal(model):
    reqs = requests(6, seed=1, system=0, prompt=(6, 10), output=(12, 16))
    engine = serve(model, reqs, num_pages=12, page_size=4, max_tokens_per_step=24)
    assert engine.delayed > 0
    assert engine.preemptions > 0 and any(r.preemptions for r in engine.finished)
    assert_equal_to_dense(model, engine)
    assert max(r.pages_in_use for r in engine.records) <= 12


def test_shared_system_prompts_hit_the_prefix_cache(model):
    engine = serve(model, requests(6, seed=2, system=9), num_pages=64, page_size=4, max_tokens_per_step=64)
    shared = [r for r in engine.finished if r.rid % 2 == 0]
    # the first to be admitted computes the system prompt; its two full pages serve the others
    assert sum(r.cached_tokens > 0 for r in shared) >= len(shared) - 1
    assert all(r.cached_tokens == 0 for r in engine.finished if r.rid % 2)
    assert engine.prefix_hit_tokens >= 8 * (len(shared) - 1)
    assert_equal_to_dense(model, engine)


def test_summary_numbers_are_consistent(model):
    engine = serve(model, requests(8, seed=4), num_pages=16, page_size=4, max_tokens_per_step=16)
    s = summarize(engine)
    assert s.peak_pages <= s.num_pages == 16
    for r in engine.records:
        assert r.pages_in_use <= 16
        assert r.waste_tokens < 4 * max(r.live_seqs, 1)  # under one page per live request
    assert s.max_waste_per_seq < 4 and 0 <= s.waste_fraction < 1 and 0 < s.page_utilisation <= 1
    assert s.output_tokens == sum(r.max_new_tokens for r in engine.finished)
    assert s.processed_tokens >= sum(len(r.prompt) + r.max_new_tokens - 1 for r in engine.finished) - s.prefix_hit_tokens
    assert 0 < s.attention_share < 1 and s.steps == len(engine.records)
    assert engine.cache.stats().pages_in_use == 0  # every page given back


def test_seeded_sampling_equals_the_dense_loop(model):
    engine = serve(model, requests(4, seed=5), num_pages=32, page_size=4, max_tokens_per_step=8, temperature=0.8,
                   seed=11)
    assert_equal_to_dense(model, engine, temperature=0.8, seed=11)


def test_page_size_one_and_a_large_page(model):
    for page_size, pages in ((1, 200), (16, 8)):
        engine = serve(model, requests(4, seed=6), num_pages=pages, page_size=page_size, max_tokens_per_step=12)
        assert_equal_to_dense(model, engine)


def test_errors_name_the_argument(model):
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        EngineConfig(max_tokens_per_step=0)
    engine = Engine(model, EngineConfig(num_pages=2, page_size=4), ReferenceAttention(64, 4, 4, 2))
    with pytest.raises(ValueError, match=r"requests\[0\]: needs 3 pages"):
        engine.submit([Request(0, list(range(10)), 2)])
    with pytest.raises(ValueError, match=r"requests\[0\]: expected a non-empty prompt"):
        engine.submit([Request(1, [], 2)])


def test_the_command_runs_on_the_cpu(capsys):
    assert main(["demo", "--serve", "--cpu", "--requests", "4", "--layers", "1", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "no GPU visible" in out and "tokens/s" in out and "attention share" in out
    assert "against the dense reference loop: equal" in out


@pytest.mark.cuda
def test_the_wrappers_path_matches_the_dense_loop():
    from flashgen.serve import WrapperAttention

    gpu_model = TinyLlama(CONFIG, "cuda", torch.bfloat16)
    engine = Engine(gpu_model, EngineConfig(num_pages=32, page_size=16, max_tokens_per_step=32),
                    WrapperAttention(64, 16, 4, 2, dtype="bfloat16"))
    engine.submit(requests(6, seed=7))
    engine.run(max_steps=500)
    assert engine.idle
    result = check_against_dense(gpu_model, engine.finished, tol=0.25)
    assert result.ok, result.failures
