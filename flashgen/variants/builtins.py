"""The spec's built-ins written as variant hooks: ALiBi and the soft-cap (score hooks), causal, the sliding window
and the custom mask (mask hooks). A spec's ``variant`` takes one, or a list of them beside at most one
``Variant``, and folds them into its own fields (``flashgen.spec.builtins``): the kernel is the spelled-out
spec's, key and machine code alike.

Example::

    from flashgen import variants
    spec = AttentionSpec(128, variant=[variants.alibi(), variants.soft_cap(30.0), my_variant])
    spec == AttentionSpec(128, pos_encoding=ALiBi(), soft_cap=30.0, variant=my_variant)   # True
"""

from __future__ import annotations

from ..spec.builtins import BuiltinHook


def alibi() -> BuiltinHook:
    """The ALiBi score hook: ``logit + slope[qo_head] * (kv_idx - qo_idx)`` with the standard slopes (any head
    count), before the soft-cap and the variant's own score hook. ``pos_encoding=ALiBi()``."""
    return BuiltinHook("alibi")


def soft_cap(cap: float) -> BuiltinHook:
    """The soft-cap score hook: ``cap * tanh(logit / cap)``, after ALiBi and before the variant's own score hook.
    ``cap`` (finite, > 0) is a runtime value: it never enters the key. ``soft_cap=cap``."""
    return BuiltinHook("soft_cap", cap)


def causal() -> BuiltinHook:
    """The causal mask hook: ``kv_idx <= qo_idx``. ``mask=Causal()``."""
    return BuiltinHook("causal")


def sliding_window(left: int) -> BuiltinHook:
    """The sliding-window mask hook: ``qo_idx - left <= kv_idx <= qo_idx`` (``left`` >= 0, a runtime value).
    ``mask=SlidingWindow(left)``."""
    return BuiltinHook("sliding_window", left)


def custom_mask() -> BuiltinHook:
    """The custom bit-mask hook (bits given at plan time; the planner classifies its tiles). ``mask=CustomMask()``."""
    return BuiltinHook("custom_mask")
