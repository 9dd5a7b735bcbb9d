"""The shipped examples: each traced hook, evaluated on tensors, equals its fp64 reference; both spellings
render and compile."""

from __future__ import annotations

import torch

from flashgen.testing import variants as ref
from flashgen.testing.variants import evaluate
from flashgen.variants.examples import EXAMPLES

H, Q, K = 3, 9, 70


def _env(**extra):
    h = torch.arange(H).view(-1, 1, 1)
    q = torch.arange(Q).view(1, -1, 1)
    k = torch.arange(K).view(1, 1, -1)
    env = {"qo_head": h, "kv_head": h, "qo_idx": q, "kv_idx": k, "batch": torch.zeros((), dtype=torch.long)}
    env.update(extra)
    return env


def _close(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-12, atol=1e-12)


def test_sink():
    sinks = torch.randn(H)
    out = evaluate(EXAMPLES["sink"][0].sink.expr, _env(sinks=sinks))
    _close(out.view(H), ref.sink_ref(sinks))


def test_document():
    doc = torch.sort(torch.randint(0, 5, (K,)))[0].int()
    out = evaluate(EXAMPLES["document"][0].mask.expr, _env(doc_ids=doc))
    assert torch.equal(out.expand(H, Q, K)[0], ref.document_ref(doc, Q, K))


def test_tree():
    anc = torch.randint(0, 2 ** 62, (Q,), dtype=torch.int64)
    out = evaluate(EXAMPLES["tree"][0].mask.expr, _env(ancestors=anc, kv_idx=torch.arange(60).view(1, 1, -1)))
    assert torch.equal(out.expand(H, Q, 60)[0], ref.tree_ref(anc, Q, 60))


def test_t5_bias():
    logits = torch.randn(H, Q, K, dtype=torch.float64)
    table = torch.randn(H, 32, dtype=torch.float64)
    out = evaluate(EXAMPLES["t5_bias"][0].score.expr, _env(logit=logits, rel_bias=table))
    _close(out, ref.t5_bias_ref(logits, table))


def test_alibi():
    logits = torch.randn(H, Q, K, dtype=torch.float64)
    slopes = torch.rand(H, dtype=torch.float64)
    _close(evaluate(EXAMPLES["alibi"][0].score.expr, _env(logit=logits, slopes=slopes)), ref.alibi_ref(logits, slopes))


def test_sigmoid():
    logits = torch.randn(H, Q, K, dtype=torch.float64)
    _close(evaluate(EXAMPLES["sigmoid"][0].score.expr, _env(logit=logits, bias=-1.5)), ref.sigmoid_ref(logits, -1.5))


def test_prefix_lm():
    out = evaluate(EXAMPLES["prefix_lm"][0].mask.expr, _env(prefix_len=torch.tensor([5])))
    assert torch.equal(out.expand(H, Q, K)[1], ref.prefix_lm_ref(5, Q, K))


def test_qk_gain():
    x = torch.randn(H, Q, 16, dtype=torch.float64)
    q_gain, k_gain = torch.rand(H, 16, dtype=torch.float64), torch.rand(H, 16, dtype=torch.float64)
    dims = {"dim": torch.arange(16).view(1, 1, -1), "qo_head": torch.arange(H).view(-1, 1, 1)}
    env = _env(value=x, q_gain=q_gain, k_gain=k_gain, **dims)
    env["kv_head"] = env["qo_head"]
    q, k = ref.qk_gain_ref(x.transpose(0, 1), x.transpose(0, 1), q_gain, k_gain)
    _close(evaluate(EXAMPLES["qk_gain"][0].q_transform.expr, env), q.transpose(0, 1))
    _close(evaluate(EXAMPLES["qk_gain"][0].k_transform.expr, env), k.transpose(0, 1))


def test_examples_are_distinct_kernels_and_spellings_validate():
    digests = {v.digest for pair in EXAMPLES.values() for v in pair if v is not None}
    assert len(digests) == sum(v is not None for pair in EXAMPLES.values() for v in pair)
