"""The transformers backend on the CPU: registration, the cache's bookkeeping, and the whole plumbing (mask,
padding, page allocation, slot mapping, plans, per-layer views) with flashgen's wrappers and append_kv stood in
for by the fp64 reference and a torch scatter; the logits match "sdpa" within a bf16 tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashgen.api  # noqa: E402
from flashgen.spec import AttentionSpec, Causal  # noqa: E402
from flashgen.testing.reference import reference_attention  # noqa: E402

from hf_llama import assert_logits_close, models, prompts, step_logits  # noqa: E402


class ReferenceWrapper:
    """A wrapper with flashgen's plan/run signature, computing with the fp64 reference on the CPU."""

    plans = 0

    def __init__(self, spec, device=None, **kwargs):
        self.spec = spec

    def plan(self, *, num_qo_heads, num_kv_heads, qo_indptr=None, sm_scale=None, num_pages=None, **table):
        type(self).plans += 1
        self.qo_indptr, self.table, self.sm_scale = qo_indptr, table, sm_scale

    def run(self, q, kv, out=None):
        assert q.is_contiguous() and q.dim() == 3
        spec = AttentionSpec(self.spec.head_dim, kv_layout=self.spec.kv_layout, mask=Causal())
        qo = self.qo_indptr if self.qo_indptr is not None else np.arange(q.shape[0] + 1)
        out, _ = reference_attention(spec, q, kv, qo_indptr=qo, sm_scale=self.sm_scale, **self.table)
        return out.to(q.dtype)


def scatter_append(k, v, kv_cache, *, slot_mapping, **kwargs):
    k_cache, v_cache = kv_cache
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache[slots // page_size, slots % page_size] = k[keep]
    v_cache[slots // page_size, slots % page_size] = v[keep]


@pytest.fixture
def reference_kernels(monkeypatch):
    for name in ("BatchDecodeWrapper", "BatchPrefillWrapper"):
        monkeypatch.setattr(flashgen.api, name, ReferenceWrapper)
    monkeypatch.setattr(flashgen.api, "append_kv", scatter_append)
    ReferenceWrapper.plans = 0


def test_import_flashgen_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, flashgen; flashgen.AttentionSpec; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_under_flashgen():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from flashgen.integrations.transformers import flashgen_attention_forward, padding_mask

    assert AttentionInterface()["flashgen"] is flashgen_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["flashgen"] is padding_mask
    ours, _ = models("cpu")
    assert ours.config._attn_implementation == "flashgen"


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("page_size", [1, 16, 17])
def test_paged_cache_steps_match_sdpa(reference_kernels, pad_side, page_size):
    from transformers import DynamicCache

    from flashgen.integrations.transformers import FlashgenCache

    ours, theirs = models("cpu")
    ids, mask = prompts("cpu", pad_side)
    tokens = torch.randint(1, 512, (4, 4), generator=torch.Generator().manual_seed(2))
    cache = FlashgenCache(ours.config, page_size=page_size, max_cache_len=64)
    steps = zip(step_logits(ours, cache, ids, mask, tokens),
                step_logits(theirs, DynamicCache(config=theirs.config), ids, mask, tokens))
    for i, ((a, valid), (b, _)) in enumerate(steps):
        assert_logits_close(a, b, valid, f"step {i}")
    # one plan a forward (layers share it), valid tokens only in the pool
    assert ReferenceWrapper.plans == 5
    assert cache.get_seq_length() == ids.shape[1] + 4
    assert [cache.store.seq_len(b) for b in range(4)] == [n + 4 for n in (5, 17, 1, 11)]


def test_dense_path_matches_sdpa(reference_kernels):
    from transformers import DynamicCache

    ours, theirs = models("cpu")
    ids, mask = prompts("cpu", "left")
    tokens = torch.randint(1, 512, (4, 3), generator=torch.Generator().manual_seed(3))
    steps = zip(step_logits(ours, DynamicCache(config=ours.config), ids, mask, tokens),
                step_logits(theirs, DynamicCache(config=theirs.config), ids, mask, tokens))
    for i, ((a, valid), (b, _)) in enumerate(steps):
        assert_logits_close(a, b, valid, f"step {i}")
    assert ReferenceWrapper.plans == 4  # one a forward, not one a layer


def test_generate_runs_through_the_paged_cache(reference_kernels):
    from flashgen.integrations.transformers import CACHE_ARG, FlashgenCache

    ours, _ = models("cpu")
    ids, mask = prompts("cpu", "left")
    cache = FlashgenCache(ours.config, page_size=16)
    out = ours.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (4, ids.shape[1] + 5)
    assert [cache.store.seq_len(b) for b in range(4)] == [n + 4 for n in (5, 17, 1, 11)]  # the last token is not fed


def test_cache_arguments_and_unsupported_calls():
    from flashgen.integrations.transformers import FlashgenCache

    with pytest.raises(ValueError, match="config: give the model's config or num_layers"):
        FlashgenCache()
    with pytest.raises(ValueError, match="page_size: got 0"):
        FlashgenCache(num_layers=2, page_size=0)
    cache = FlashgenCache(num_layers=2)
    assert cache.get_seq_length() == 0 and len(cache.layers) == 2
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))


def test_unsupported_attention_arguments_name_themselves():
    from flashgen.integrations.transformers import flashgen_attention_forward, padding_mask

    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="sliding_window: not supported"):
        flashgen_attention_forward(module, q, q, q, None, sliding_window=16)
    with pytest.raises(ValueError, match="dropout: got 0.1"):
        flashgen_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention_mask: the 'flashgen' attention takes plain causal masks"):
        padding_mask(1, 1, 1, mask_function=lambda *a: True)
