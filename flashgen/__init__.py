"""flashgen: a JIT attention-kernel compiler for LLM inference.

Describe the attention in an ``AttentionSpec``; ``render`` gives the CUDA source, ``build`` a loaded kernel
(compiled with ninja + nvcc on a cache miss, cached on disk).

``import flashgen`` imports nothing but its version: each public name below is imported from its module on
first use (PEP 562), so a process that only loads cached kernels never pays for the code generator (jinja2),
the CUDA driver bindings or the planner until it uses them.
"""

from ._version import __version__  # noqa: F401

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    **dict.fromkeys(("BatchDecodeWrapper", "BatchPrefillWrapper", "BlockSparseWrapper", "CascadeWrapper",
                     "VariableBlockSparseWrapper", "attention", "merge_state", "merge_state_in_place",
                     "merge_states", "select_pages", "append_kv"), ".api"),
    **dict.fromkeys(("CascadeLevel", "CascadePolicy"), ".plan"),
    **dict.fromkeys(("PagedKVCache", "OutOfPages", "KVCacheError", "CacheStats", "PageTables", "Preemption",
                     "WriteCoords"), ".kvcache"),
    **dict.fromkeys(("CacheError", "CacheStore"), ".cache"),
    **dict.fromkeys(("TemplateError", "render_variant"), ".kernels"),
    **dict.fromkeys(("CompileError", "ToolchainError"), ".compile"),
    **dict.fromkeys(("Kernel", "MissingKernelError", "NoDeviceError", "build", "ensure_compiled", "render"), ".jit"),
    **dict.fromkeys(("ALiBi", "AppendSpec", "AttentionSpec", "Causal", "CustomMask", "Llama31Scaling", "MergeSpec",
                     "NoMask", "Paged", "Ragged", "RoPE", "Scalar", "SlidingWindow", "SpecError", "Tensor",
                     "Variant", "YaRNScaling"), ".spec"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashgen' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
