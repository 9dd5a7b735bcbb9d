"""flashgen: a JIT attention-kernel compiler for LLM inference."""

__version__ = "0.1.0"

from .spec import (  # noqa: E402
    ALiBi,
    AttentionSpec,
    BlockSparse,
    Causal,
    CustomMask,
    MergeSpec,
    NoMask,
    Paged,
    Ragged,
    RoPE,
    SlidingWindow,
    SpecError,
)
