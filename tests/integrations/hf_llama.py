"""A small random-weight Llama run step by step with two attention implementations fed the same tokens
(batch 4, left-padded prompts of mixed lengths): the logits of each step, for comparing "flashgen" with "sdpa"."""

from __future__ import annotations

import torch

PROMPT_LENS = (5, 17, 1, 11)
BF16_ROUNDOFF = 2.0 ** -8


def config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256)


def models(device, dtype=torch.bfloat16):
    """("flashgen" model, "sdpa" model) with the same random weights."""
    from transformers import AutoModelForCausalLM

    import flashgen.integrations.transformers  # noqa: F401  (registers "flashgen")

    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(config(), attn_implementation="flashgen", dtype=dtype).to(device).eval()
    theirs = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa", dtype=dtype).to(device).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def prompts(device, pad_side="left", seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROMPT_LENS):
        cols = slice(width - n, width) if pad_side == "left" else slice(0, n)
        ids[b, cols] = torch.randint(1, 512, (n,), generator=gen)
        mask[b, cols] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def step_logits(model, cache, ids, mask, tokens):
    """Prefill ``ids`` then one decode step per column of ``tokens [batch, steps]``; yields (logits, valid rows
    mask) of the prefill ``[batch, len, vocab]`` then of each step ``[batch, 1, vocab]``."""
    from flashgen.integrations.transformers import CACHE_ARG
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache}, use_cache=True)
    yield out.logits, mask.bool()
    for t in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        out = model(input_ids=tokens[:, t: t + 1], attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache},
                    use_cache=True)
        yield out.logits, torch.ones_like(mask[:, -1:], dtype=torch.bool)


def assert_logits_close(ours, theirs, valid, what):
    """bf16 tolerance: max |ours - sdpa| over valid positions <= 8 bf16 roundoffs of the largest logit (two
    bf16 models that differ only in their attention's rounding, through 2 layers)."""
    a, b = ours[valid].float(), theirs[valid].float()
    assert torch.isfinite(a).all(), f"{what}: non-finite logits"
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    bound = 8 * BF16_ROUNDOFF * max(scale, 1.0)
    assert err <= bound, f"{what}: max |flashgen - sdpa| = {err:.4g} > {bound:.4g} (max |logit| {scale:.4g})"
