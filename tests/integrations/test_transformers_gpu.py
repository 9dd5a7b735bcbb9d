"""The transformers backend on the GPU: a small random-weight Llama (2 layers, hidden 256, 4 heads, 2 kv heads,
head_dim 64, bf16) run with "flashgen" gives logits within a bf16 tolerance of "sdpa" at the prefill and at
each of 32 decode steps fed the same tokens (batch 4, mixed prompt lengths), and generate() runs end to end."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_llama import PROMPT_LENS, assert_logits_close, models, prompts, step_logits  # noqa: E402

pytestmark = pytest.mark.cuda
STEPS = 32


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("page_size", [1, 16, 17])
def test_decode_steps_match_sdpa(pad_side, page_size):
    from transformers import DynamicCache

    from flashgen.integrations.transformers import FlashgenCache

    ours, theirs = models("cuda")
    ids, mask = prompts("cuda", pad_side)
    tokens = torch.randint(1, 512, (4, STEPS), generator=torch.Generator().manual_seed(page_size)).cuda()
    cache = FlashgenCache(ours.config, page_size=page_size, max_cache_len=128)
    steps = zip(step_logits(ours, cache, ids, mask, tokens),
                step_logits(theirs, DynamicCache(config=theirs.config), ids, mask, tokens))
    for i, ((a, valid), (b, _)) in enumerate(steps):
        assert_logits_close(a, b, valid, f"step {i}")
    assert [cache.store.seq_len(b) for b in range(4)] == [n + STEPS for n in PROMPT_LENS]


def test_dense_cache_path_matches_sdpa():
    from transformers import DynamicCache

    ours, theirs = models("cuda")
    ids, mask = prompts("cuda", "left")
    tokens = torch.randint(1, 512, (4, 8), generator=torch.Generator().manual_seed(7)).cuda()
    steps = zip(step_logits(ours, DynamicCache(config=ours.config), ids, mask, tokens),
                step_logits(theirs, DynamicCache(config=theirs.config), ids, mask, tokens))
    for i, ((a, valid), (b, _)) in enumerate(steps):
        assert_logits_close(a, b, valid, f"step {i}")


@pytest.mark.parametrize("with_cache", [True, False])
def test_generate_end_to_end(with_cache):
    from flashgen.integrations.transformers import CACHE_ARG, FlashgenCache

    ours, theirs = models("cuda")
    ids, mask = prompts("cuda", "left")
    kwargs = {CACHE_ARG: FlashgenCache(ours.config, page_size=16)} if with_cache else {}
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0, **kwargs)
    assert out.shape == (4, ids.shape[1] + STEPS)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    sampled = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0,
                            **({CACHE_ARG: FlashgenCache(ours.config)} if with_cache else {}))
    assert sampled.shape == (4, ids.shape[1] + 8)
