"""The tracer: what it accepts, what it rejects and how it says so; the key of a variant."""

from __future__ import annotations

import math

import pytest
import torch

from flashgen import AttentionSpec, SpecError, Variant, variant_ops as ops
from flashgen.spec import spec_from_dict, spec_to_dict
from flashgen.testing.variants import evaluate


def test_operators_and_types():
    v = Variant(score=lambda score, q_idx, kv_idx: ops.where((q_idx // 3 == kv_idx % 4) & ~(q_idx < 0),
                                                              -score + abs(q_idx - kv_idx) ** 2, score / 2))
    assert v.score.expr.type == "float" and "fg_floordiv" in v.score.body and "fg_mod" in v.score.body


def test_int_division_floors_like_python():
    v = Variant(score=lambda score, q_idx, kv_idx: score + (q_idx - kv_idx) // 3 + (q_idx - kv_idx) % 3)
    q, k = torch.tensor([0, 1, 2, 7]).view(-1, 1), torch.arange(9).view(1, -1)
    out = evaluate(v.score.expr, {"logit": torch.zeros(()), "qo_idx": q, "kv_idx": k})
    expect = torch.tensor([[(a - b) // 3 + (a - b) % 3 for b in range(9)] for a in (0, 1, 2, 7)], dtype=torch.float64)
    assert torch.equal(out, expect)


def test_torch_functions_on_proxies():
    v = Variant(score=lambda score: torch.tanh(score / 50.0) * 50.0)
    assert v.score.body == "return (tanhf((logit / 50.0f)) * 50.0f);"


@pytest.mark.parametrize("fn, words", [
    (lambda score, q_idx, kv_idx: score if q_idx > kv_idx else 0.0, "control flow"),
    (lambda score: math.exp(score), "variant_ops"),
    (lambda score: score.exp(), "no attribute 'exp'"),
    (lambda score: torch.softmax(score, 0), "torch.softmax cannot be traced"),
    (lambda score, bogus: score + bogus, "parameter 'bogus'"),
    (lambda score: [score for _ in score], "iterated"),
    (lambda score: score + "x", "got str"),
])
def test_rejections_name_the_hook_and_line(fn, words):
    with pytest.raises(SpecError) as info:
        Variant(score=fn)
    assert "'score'" in str(info.value) and words in str(info.value)
    assert "test_variant_trace.py:" in str(info.value)


def test_mask_must_return_bool():
    with pytest.raises(SpecError, match="returns int, expected a bool"):
        Variant(mask=lambda q_idx, kv_idx: q_idx - kv_idx)


def test_snippet_unknown_name_names_the_line():
    with pytest.raises(SpecError, match=r"'score', line 2 .*'slope' is not an input"):
        Variant(score="float y = logit;\nreturn y * slope;")
    Variant(score="float y = logit;\nreturn y * slope;", scalars=[("slope", "float32")])


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensors=[("doc", "int8", 1)]), "dtype got 'int8'"),
    (dict(tensors=[("doc", "int32", 0)]), "rank got 0"),
    (dict(scalars=[("qo_idx", "float32")]), "reserved"),
    (dict(scalars=[("s", "float32"), ("s", "int32")]), "declared twice"),
])
def test_declarations_are_checked(kwargs, words):
    with pytest.raises(SpecError, match=words):
        Variant(score="logit", **kwargs)


def test_key_same_text_one_key_other_text_other_key():
    a = Variant(score="  return logit * 2.0f;  \n")
    b = Variant(score="logit * 2.0f")
    c = Variant(score="return logit * 3.0f;")
    assert a == b and hash(a) == hash(b) and a.digest == b.digest
    assert a.digest != c.digest
    spec = AttentionSpec(128, variant=a)
    assert spec.uri == AttentionSpec(128, variant=b).uri != AttentionSpec(128, variant=c).uri
    assert spec.uri.startswith(AttentionSpec(128).uri + "_var")
    traced = Variant(score=lambda score: score * 2.0)
    assert traced == Variant(score=traced.score.body)  # a traced hook is its CUDA text


def test_scalars_are_not_in_the_key_and_spec_round_trips():
    v = Variant(score="logit * s", scalars=[("s", "float32")])
    spec = AttentionSpec(128, variant=v)
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert v.missing({"s": 1.0}) == [] and v.missing({}) == ["s"]


def test_kernel_families_run_the_load_transforms():
    from flashgen import render

    for op in ("decode", "prefill", "prefill_sm90"):
        source = render(AttentionSpec(128, variant=Variant(q_transform="value")), op)
        assert '#line 1 "variant.q_transform"' in source
        # the Hopper backend runs the k_transform in its K pre-pass (rope_gather)
        k_op = "rope_gather" if op == "prefill_sm90" else op
        assert '#line 1 "variant.k_transform"' in render(AttentionSpec(128, variant=Variant(k_transform="value")), k_op)


def test_a_float_distance_of_the_positions_is_the_distance_input():
    """float(kv_idx - q_idx) is the pair hooks' distance, q_idx - kv_idx its negation; nothing else is."""
    from flashgen.variants.examples import ALIBI, T5_BIAS

    assert ALIBI.score.body == "return (logit + (static_cast<float>(slopes(qo_head)) * distance));"
    v = Variant(score=lambda score, q_idx, kv_idx: score * (q_idx - kv_idx) + 0.5 * (kv_idx - q_idx))
    assert v.score.body == "return ((logit * (-distance)) + (0.5f * distance));"
    m = Variant(mask=lambda q_idx, kv_idx: (kv_idx - q_idx) * 1.0 > -8.5)
    assert m.mask.body == "return ((distance * 1.0f) > -8.5f);"
    # the int difference used as an int stays one; other conversions to float stay conversions
    ints = Variant(score=lambda score, q_idx, kv_idx, bias: score + bias[kv_idx - q_idx + 8] + (kv_idx - q_idx) // 2
                   + ops.where(kv_idx - q_idx > 0, 1.0, 0.0) + (kv_idx - q_idx + 1) + abs(kv_idx - q_idx),
                   tensors=[("bias", "float32", 1)])
    body = ints.score.body
    assert "distance" not in body
    assert body.count("(kv_idx - qo_idx)") == 5 and "fg_floordiv(static_cast<long long>((kv_idx - qo_idx)), 2)" in body
    assert "((kv_idx - qo_idx) > 0)" in body and "static_cast<float>(fg_abs((kv_idx - qo_idx)))" in body
    assert "distance" not in T5_BIAS.score.body  # its conversions are of |kv_idx - qo_idx|
    other = Variant(score=lambda score, q_idx, kv_idx: score + (kv_idx - kv_idx) + (q_idx - q_idx) * 1.0)
    assert "distance" not in other.score.body
    # the expression keeps the conversion: evaluated, it is the difference either way
    q, k = torch.arange(5).view(-1, 1), torch.arange(7).view(1, -1)
    out = evaluate(v.score.expr, {"logit": torch.ones(()), "qo_idx": q, "kv_idx": k})
    assert torch.equal(out, (q - k).double() + 0.5 * (k - q).double())


def test_a_traced_hook_may_name_the_distance():
    v = Variant(score=lambda score, distance: score - abs(distance), mask=lambda distance, kv_idx: distance <= kv_idx)
    assert v.score.body == "return (logit - fg_abs(distance));"
    assert v.mask.body == "return (distance <= static_cast<float>(kv_idx));"
    q, k = torch.arange(5).view(-1, 1), torch.arange(7).view(1, -1)
    out = evaluate(v.score.expr, {"logit": torch.zeros(()), "qo_idx": q, "kv_idx": k})
    assert torch.equal(out, -(k - q).abs().double())


@pytest.mark.parametrize("hook", ["mask_tile", "q_transform", "k_transform", "output", "sink"])
def test_the_distance_is_an_input_of_the_pair_hooks_only(hook):
    mask = "return true;" if hook == "mask_tile" else None
    with pytest.raises(SpecError, match=rf"'{hook}', line 1 .*'distance' is not an input of this hook"):
        Variant(**{hook: "return distance;"}, mask=mask)
    with pytest.raises(SpecError, match=rf"'{hook}'.*parameter 'distance' is neither an input"):
        Variant(**{hook: lambda distance: distance}, mask=mask)
    Variant(score="return logit + distance;", mask="return distance <= 0.f;")
    with pytest.raises(SpecError, match="reserved"):
        Variant(score="logit", scalars=[("distance", "float32")])
