"""Shipped attention variants (``flashgen.variants.examples``) and the spec's built-ins written as variant hooks
(``alibi()``, ``soft_cap(cap)``, ``causal()``, ``sliding_window(left)``, ``custom_mask()``)."""

from .builtins import alibi, causal, custom_mask, sliding_window, soft_cap
from .examples import EXAMPLES

__all__ = ["EXAMPLES", "alibi", "causal", "custom_mask", "sliding_window", "soft_cap"]
