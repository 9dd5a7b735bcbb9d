"""The lowering of a spec's built-in hooks (``flashgen.spec.builtins``) to the templates' flags.

A spec's ALiBi, soft-cap and mask are hooks of the variant contract (``AttentionSpec.builtin_hooks()``: score
hooks ALiBi then soft-cap, before a variant's own score hook; a mask hook beside a variant's mask). Each family
computes them on its own fast path, with the arithmetic it had before they were named hooks (decode and the
portable prefill: ``LogitsTransform``, tanhf; the Hopper prefill: tanh by ex2 and rcp, the ALiBi bias stepped key
by key); this function is the one place that says which of those paths a kernel takes. It reads the hooks, never
the spec's fields, so a spec written with ``flashgen.variants``' helpers lowers as its spelled-out twin does.

Example::

    builtin_flags(AttentionSpec(128, pos_encoding=ALiBi(), soft_cap=30.0))
    # {'ALIBI': 'true', 'SOFT_CAP': 'true', 'CAUSAL': 'false', 'WINDOW': 'false', 'CUSTOM_MASK': 'false'}
"""

from __future__ import annotations

from ..spec import AttentionSpec

# the flag each built-in hook sets; the window is causal too (a query sees no key after itself)
_FLAGS = {"alibi": ("ALIBI",), "soft_cap": ("SOFT_CAP",), "causal": ("CAUSAL",),
          "sliding_window": ("CAUSAL", "WINDOW"), "custom_mask": ("CUSTOM_MASK",)}
FLAG_NAMES = ("ALIBI", "SOFT_CAP", "CAUSAL", "WINDOW", "CUSTOM_MASK")


def builtin_flags(spec: AttentionSpec) -> dict[str, str]:
    """The templates' built-in flags (``"true"``/``"false"``) from ``spec.builtin_hooks()``."""
    on = {flag for hook in spec.builtin_hooks() for flag in _FLAGS[hook.kind]}
    return {name: "true" if name in on else "false" for name in FLAG_NAMES}
