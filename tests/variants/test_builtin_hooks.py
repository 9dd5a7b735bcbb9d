"""The spec's built-ins as variant hooks: the lowering of a spec to built-in hooks and to the templates' flags,
flashgen.variants' helpers giving the very spec (key, source, kernel) of the spelled-out form, and their errors."""

import numpy as np
import pytest

from compile_checks import assert_sound_cubin, build_all, prefetch
from flashgen import jit, variants
from flashgen.kernels import family
from flashgen.kernels.builtins import builtin_flags
from flashgen.spec import (ALiBi, AttentionSpec, BuiltinHook, Causal, CustomMask, NoMask, Paged, RoPE, SlidingWindow,
                           SpecError, Variant)

BIAS = Variant(score="return logit + bias;", scalars=[("bias", "float32")])
# (the spelled-out spec's fields, the same written with the helpers)
PAIRS = [
    (dict(soft_cap=30.0), variants.soft_cap(30.0)),
    (dict(pos_encoding=ALiBi()), variants.alibi()),
    (dict(pos_encoding=ALiBi(), soft_cap=30.0), [variants.alibi(), variants.soft_cap(30.0)]),
    (dict(pos_encoding=ALiBi(), soft_cap=30.0, mask=Causal()), [variants.soft_cap(30.0), variants.causal(), variants.alibi()]),
    (dict(mask=SlidingWindow(128)), variants.sliding_window(128)),
    (dict(mask=CustomMask(), pos_encoding=ALiBi()), (variants.custom_mask(), variants.alibi())),
    (dict(soft_cap=50.0, variant=BIAS), [BIAS, variants.soft_cap(50.0)]),
]
OPS = ("decode", "prefill", "prefill_sm90")


def _pair(fields, hooks):
    """(the spelled-out spec, the helpers' spec); a user variant rides in the helpers' list."""
    return (AttentionSpec(128, kv_layout=Paged(16), **fields),
            AttentionSpec(128, kv_layout=Paged(16), variant=hooks))


def _accepting(spec: AttentionSpec) -> list[str]:
    """The ops of OPS whose family takes ``spec``."""
    ops = []
    for op in OPS:
        fam = family(op)
        try:
            fam.check(fam.project(spec))
        except SpecError:
            continue
        ops.append(op)
    return ops


@pytest.mark.parametrize("fields,hooks", PAIRS)
def test_helpers_give_the_spelled_out_spec(fields, hooks):
    spelled, helped = _pair(fields, hooks)
    assert helped == spelled and hash(helped) == hash(spelled) and helped.uri == spelled.uri
    for op in _accepting(spelled):
        assert jit.render(helped, op) == jit.render(spelled, op)
        assert jit.prepare(helped, op, "sm_90a").content_key == jit.prepare(spelled, op, "sm_90a").content_key


def test_builtin_hooks_in_order_and_back():
    spec = AttentionSpec(128, mask=SlidingWindow(64), soft_cap=20.0, pos_encoding=ALiBi())
    hooks = spec.builtin_hooks()
    assert [(h.kind, h.hook, h.value) for h in hooks] == [("alibi", "score", None), ("soft_cap", "score", 20.0),
                                                          ("sliding_window", "mask", 64)]
    assert AttentionSpec(128, variant=hooks) == spec
    assert AttentionSpec(128, pos_encoding=RoPE()).builtin_hooks() == ()
    assert AttentionSpec(128, mask=CustomMask()).builtin_hooks() == (BuiltinHook("custom_mask"),)
    # numbers normalise as the spec's fields do: one spec, one hash
    assert AttentionSpec(128, variant=variants.soft_cap(np.float32(30.0))) == AttentionSpec(128, soft_cap=30.0)
    assert AttentionSpec(128, variant=variants.sliding_window(np.int64(8))).mask == SlidingWindow(8)
    assert AttentionSpec(128, mask=Causal(), variant=variants.causal()).mask == Causal()
    assert AttentionSpec(128, soft_cap=30.0, variant=variants.soft_cap(30.0)).soft_cap == 30.0
    assert AttentionSpec(128, variant=[]).variant is None


@pytest.mark.parametrize("fields,flags", [
    (dict(), ()),
    (dict(pos_encoding=ALiBi()), ("ALIBI",)),
    (dict(soft_cap=1.0, pos_encoding=ALiBi()), ("ALIBI", "SOFT_CAP")),
    (dict(mask=Causal()), ("CAUSAL",)),
    (dict(mask=SlidingWindow(3)), ("CAUSAL", "WINDOW")),
    (dict(mask=CustomMask()), ("CUSTOM_MASK",)),
    (dict(mask=NoMask(), pos_encoding=RoPE()), ()),
])
def test_lowering_sets_the_family_flags(fields, flags):
    spec = AttentionSpec(128, kv_layout=Paged(16), **fields)
    lowered = builtin_flags(spec)
    assert {k for k, v in lowered.items() if v == "true"} == set(flags)
    for op in _accepting(spec):
        fam = family(op)
        context = fam.context(fam.project(spec))
        assert {k: context[k] for k in lowered if k in context} == {k: v for k, v in lowered.items() if k in context}


@pytest.mark.parametrize("make,message", [
    (lambda: AttentionSpec(128, soft_cap=20.0, variant=variants.soft_cap(30.0)), r"soft_cap\(30.0\) beside soft_cap=20.0"),
    (lambda: AttentionSpec(128, pos_encoding=RoPE(), variant=variants.alibi()), "one positional encoding"),
    (lambda: AttentionSpec(128, variant=[variants.causal(), variants.sliding_window(3)]), "one built-in mask"),
    (lambda: AttentionSpec(128, mask=CustomMask(), variant=variants.causal()), "one built-in mask"),
    (lambda: AttentionSpec(128, variant=[BIAS, BIAS]), "at most one Variant"),
    (lambda: AttentionSpec(128, variant=[variants.alibi(), variants.alibi()]), "'alibi' given twice"),
    (lambda: AttentionSpec(128, variant="x"), "built-in hooks"),
    (lambda: variants.sliding_window(-1), r"sliding_window: left got -1, expected an int >= 0"),
    (lambda: variants.sliding_window(2.0), "expected an int >= 0"),
    (lambda: variants.soft_cap(float("inf")), "soft_cap: got inf, expected a finite number > 0"),
    (lambda: variants.soft_cap(0), "soft_cap: got 0"),
    (lambda: BuiltinHook("rope"), "kind got 'rope', expected one of alibi, soft_cap"),
    (lambda: BuiltinHook("causal", 3), "takes none"),
])
def test_bad_builtin_hooks_name_the_argument(make, message):
    with pytest.raises(SpecError, match=message):
        make()


# the helpers' form of built-in kernels compiles, and to the spelled-out form's own cache entry
def _jobs():
    jobs = []
    for op in OPS:
        for fields, hooks in (PAIRS[2], PAIRS[4], PAIRS[5]):
            spelled, helped = _pair(fields, hooks)
            fam = family(op)
            try:
                fam.check(fam.project(spelled))
            except SpecError:
                continue
            jobs.append((op, spelled, helped))
    return jobs


JOBS = _jobs()
prefetch(__name__, [(op, spelled, "sm_90a") for op, spelled, _ in JOBS])


@pytest.mark.nvcc
def test_builtin_kernels_compile_from_either_spelling(shared_cache):
    spelled = build_all([(op, s, "sm_90a") for op, s, _ in JOBS])
    helped = build_all([(op, h, "sm_90a") for op, _, h in JOBS])
    for (op, spec, _), (entry, report), (twin, _) in zip(JOBS, spelled, helped):
        fam = family(op)
        assert_sound_cubin(entry, report, [e.name for e in fam.entry_points(fam.project(spec))])
        assert twin.path == entry.path and twin.cubin == entry.cubin
