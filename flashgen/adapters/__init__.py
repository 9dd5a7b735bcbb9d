"""Engine-style adapters: flashgen as the attention backend of an engine that owns its KV cache.

``VLLMAttention`` reads and writes a vLLM-style paged cache (``block_table``, ``seq_lens``,
``query_start_loc``, ``slot_mapping``); ``SGLangAttention`` an SGLang-style token pool (``req_to_token``,
``req_pool_indices``, per-layer K and V buffers). Both plan once a step from the engine's metadata and run once
a layer over the engine's cache tensors as they are: no copy of the cache. ``vllm_tables`` and
``sglang_tables`` are the metadata translations alone (host code, testable without a GPU).
"""

from .common import PagedStepAttention, StepTables
from .sglang import SGLangAttention, sglang_tables
from .vllm import VLLMAttention, vllm_tables

__all__ = ["PagedStepAttention", "SGLangAttention", "StepTables", "VLLMAttention", "sglang_tables", "vllm_tables"]
