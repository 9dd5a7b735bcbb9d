"""Built-in hooks: the spec's own logits transforms and masks, named as the variant hooks they are.

ALiBi and the soft-cap are ``score`` hooks, applied in this order to ``q.k * sm_scale``, both before a variant's
own ``score`` hook. Causal, the sliding window and the custom bit mask are ``mask`` hooks (a pair is kept when
both the built-in and a variant's ``mask`` keep it); the custom mask's plan-time tile classes
(``flashgen.plan.mask_tiles``) are its ``mask_tile``.

``AttentionSpec`` holds them in its own fields (``pos_encoding``, ``soft_cap``, ``mask``) and
``AttentionSpec.builtin_hooks()`` lists them; ``flashgen.variants`` builds the same hooks (``variants.alibi()``,
``variants.soft_cap(30.0)``, ...), which a spec's ``variant`` may hold, alone or beside one ``Variant``, and which
the spec folds into those fields: both spellings are one spec, one kernel key, one kernel. The kernels compute a
built-in hook with the arithmetic of their own fast paths (``flashgen.kernels.builtins`` lowers the hooks to the
templates' flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from .parts import ALiBi, Causal, CustomMask, NoMask, SlidingWindow, SpecError, check_positive, plain_number

# kind -> the hook it is, in the order the kernels apply them (ALiBi before the soft-cap)
BUILTIN_KINDS: dict[str, str] = {
    "alibi": "score",
    "soft_cap": "score",
    "causal": "mask",
    "sliding_window": "mask",
    "custom_mask": "mask",
}
_MASKS = {"causal": Causal, "sliding_window": SlidingWindow, "custom_mask": CustomMask}


@dataclass(frozen=True)
class BuiltinHook:
    """One built-in hook: ``kind`` (one of ``BUILTIN_KINDS``) and its runtime value (the soft-cap's cap, the
    window's ``left``; ``None`` for the others). The value never enters the kernel key.

    Example::

        BuiltinHook("soft_cap", 30.0).hook   # 'score'
    """

    kind: str
    value: float | int | None = None

    def __post_init__(self) -> None:
        if self.kind not in BUILTIN_KINDS:
            raise SpecError(f"builtin hook: kind got {self.kind!r}, expected one of {', '.join(BUILTIN_KINDS)}")
        object.__setattr__(self, "value", plain_number(self.value))
        if self.kind == "soft_cap":
            check_positive(self.value, "soft_cap")
        elif self.kind == "sliding_window":
            if type(self.value) is not int or self.value < 0:
                raise SpecError(f"sliding_window: left got {self.value!r}, expected an int >= 0")
        elif self.value is not None:
            raise SpecError(f"builtin hook {self.kind!r}: value got {self.value!r}, expected None (it takes none)")

    @property
    def hook(self) -> str:
        """The variant hook it is: ``'score'`` or ``'mask'``."""
        return BUILTIN_KINDS[self.kind]


def builtin_hooks(pos_encoding: object, soft_cap: float | None, mask: object) -> tuple[BuiltinHook, ...]:
    """The built-in hooks of a spec's fields, score hooks first in their order, then the mask."""
    hooks = []
    if isinstance(pos_encoding, ALiBi):
        hooks.append(BuiltinHook("alibi"))
    if soft_cap is not None:
        hooks.append(BuiltinHook("soft_cap", soft_cap))
    if isinstance(mask, SlidingWindow):
        hooks.append(BuiltinHook("sliding_window", mask.left))
    elif isinstance(mask, (Causal, CustomMask)):
        hooks.append(BuiltinHook("causal" if isinstance(mask, Causal) else "custom_mask"))
    return tuple(hooks)


def fold_builtins(variant: object, pos_encoding: object, soft_cap: float | None,
                  mask: object) -> tuple[object, object, float | None, object]:
    """``(variant, pos_encoding, soft_cap, mask)`` with the built-in hooks a spec's ``variant`` holds (a
    ``BuiltinHook``, or a list or tuple of them beside at most one other entry, a ``Variant``) moved into the
    spec's fields. A built-in that contradicts a field (``soft_cap=20`` beside ``variants.soft_cap(30)``, two
    masks, ALiBi beside RoPE) is a ``SpecError`` naming both."""
    if isinstance(variant, BuiltinHook):
        items = (variant,)
    elif isinstance(variant, (list, tuple)):
        items = tuple(variant)
    else:
        return variant, pos_encoding, soft_cap, mask
    others = [v for v in items if not isinstance(v, BuiltinHook)]
    if len(others) > 1:
        raise SpecError(f"variant: got {len(others)} entries that are not built-in hooks, expected at most one "
                        "Variant beside the built-ins (flashgen.variants.alibi(), soft_cap(), ...)")
    seen: set[str] = set()
    for b in (v for v in items if isinstance(v, BuiltinHook)):
        if b.kind in seen:
            raise SpecError(f"variant: built-in hook {b.kind!r} given twice")
        seen.add(b.kind)
        if b.kind == "alibi":
            if pos_encoding is not None and not isinstance(pos_encoding, ALiBi):
                raise SpecError(f"variant: built-in alibi() beside pos_encoding={pos_encoding!r}; a spec has one "
                                "positional encoding")
            pos_encoding = ALiBi()
        elif b.kind == "soft_cap":
            if soft_cap is not None and soft_cap != b.value:
                raise SpecError(f"variant: built-in soft_cap({b.value!r}) beside soft_cap={soft_cap!r}; give one")
            soft_cap = b.value
        else:
            new = SlidingWindow(b.value) if b.kind == "sliding_window" else _MASKS[b.kind]()
            if not isinstance(mask, NoMask) and mask != new:
                raise SpecError(f"variant: built-in {b.kind}() beside mask={mask!r}; a spec has one built-in mask")
            mask = new
    return (others[0] if others else None), pos_encoding, soft_cap, mask
