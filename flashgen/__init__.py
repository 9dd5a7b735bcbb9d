"""flashgen: a JIT attention-kernel compiler for LLM inference.

Describe the attention in an ``AttentionSpec``; ``render`` gives the CUDA source, ``build`` a loaded kernel
(compiled with ninja + nvcc on a cache miss, cached on disk).
"""

from ._version import __version__  # noqa: E402,F401

from .api import BatchDecodeWrapper, merge_state, merge_state_in_place, merge_states  # noqa: E402
from .api import BatchPrefillWrapper, CascadeWrapper, attention  # noqa: E402
from .api import BlockSparseWrapper, VariableBlockSparseWrapper, select_pages  # noqa: E402
from .plan import CascadeLevel, CascadePolicy  # noqa: E402
from .kvcache import CacheStats, KVCacheError, OutOfPages, PagedKVCache, PageTables, Preemption, WriteCoords  # noqa: E402
from .cache import CacheError, CacheStore  # noqa: E402
from .kernels import TemplateError, render_variant  # noqa: E402
from .compile import CompileError, ToolchainError  # noqa: E402
from .jit import Kernel, MissingKernelError, NoDeviceError, build, ensure_compiled, render  # noqa: E402
from . import jit_native  # noqa: E402,F401  (registers the native planner's build-and-load)
from .spec import (  # noqa: E402
    ALiBi,
    AttentionSpec,
    Causal,
    CustomMask,
    MergeSpec,
    NoMask,
    Paged,
    Ragged,
    RoPE,
    SlidingWindow,
    SpecError,
    Scalar,
    Tensor,
    Variant,
)
from . import variant_ops  # noqa: E402,F401

__all__ = [
    "BatchDecodeWrapper", "BatchPrefillWrapper", "BlockSparseWrapper", "VariableBlockSparseWrapper", "select_pages", "attention", "merge_state", "merge_state_in_place", "merge_states", "CacheError", "CacheStore", "TemplateError", "CompileError",
    "CascadeWrapper", "CascadeLevel", "CascadePolicy",
    "PagedKVCache", "OutOfPages", "KVCacheError", "CacheStats", "PageTables", "Preemption", "WriteCoords",
    "ToolchainError", "Kernel", "MissingKernelError", "NoDeviceError", "build", "ensure_compiled", "render", "ALiBi",
    "AttentionSpec", "Causal", "CustomMask", "MergeSpec", "NoMask", "Paged", "Ragged", "RoPE",
    "SlidingWindow", "SpecError", "Scalar", "Tensor", "Variant", "render_variant", "variant_ops",
]
