"""Specs: frozen descriptions of the kernels to generate. Imports nothing else of flashgen."""

from .attention import HEAD_DIMS, AttentionSpec, MergeSpec
from .append import AppendSpec, Llama31Scaling
from .builtins import BUILTIN_KINDS, BuiltinHook
from .serialize import spec_from_dict, spec_to_dict
from .variant import HOOKS, SCALAR_DTYPES, TENSOR_DTYPES, Hook, Scalar, Tensor, Variant
from .parts import (
    KV_DTYPES,
    MERGE_DTYPES,
    Q_DTYPES,
    ALiBi,
    BlockSparse,
    Causal,
    CustomMask,
    NoMask,
    Paged,
    Ragged,
    RoPE,
    YaRNScaling,
    SlidingWindow,
    SpecError,
    canonical_dtype,
)

__all__ = [
    "HEAD_DIMS", "AttentionSpec", "AppendSpec", "Llama31Scaling", "MergeSpec", "KV_DTYPES", "MERGE_DTYPES", "Q_DTYPES", "ALiBi",
    "BlockSparse", "Causal", "CustomMask", "NoMask", "Paged", "Ragged", "RoPE", "SlidingWindow", "YaRNScaling",
    "SpecError", "canonical_dtype", "spec_from_dict", "spec_to_dict", "HOOKS", "SCALAR_DTYPES", "TENSOR_DTYPES",
    "Hook", "Scalar", "Tensor", "Variant", "BUILTIN_KINDS", "BuiltinHook",
]
