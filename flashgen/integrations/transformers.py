"""flashgen as a Hugging Face transformers attention backend: ``attn_implementation="flashgen"``.

Importing this module (it needs transformers: ``pip install "flashgen[hf]"``; ``import flashgen`` never imports
it) registers ``flashgen_attention_forward`` with ``transformers.AttentionInterface`` and a padding-mask
function with ``AttentionMaskInterface``, both under the name ``"flashgen"``::

    import flashgen.integrations.transformers as fg_hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashgen", dtype=torch.bfloat16)
    cache = fg_hf.FlashgenCache(model.config, page_size=16, max_cache_len=4096)
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=32)

(transformers 5.24 and later name the argument ``cache``; earlier 5.x releases ``past_key_values``: ``CACHE_ARG``
holds the installed release's name, ``**{fg_hf.CACHE_ARG: cache}``.)

With a ``FlashgenCache`` (``cache.py``), K and V live in a flashgen ``PagedKVCache`` (every layer's KV heads
side by side in one pool, so one page table serves all layers): each forward plans once (at its first layer)
and every layer writes its new K/V with ``append_kv`` and attends through the planned ``BatchDecodeWrapper``
(one new token a row) or causal ``BatchPrefillWrapper``. Padding (left or right, from ``attention_mask``)
never enters the cache: a masked token is skipped by the write (slot -1) and its query row is not computed
(its output is 0). With another cache (transformers' ``DynamicCache``) or none, the attention function runs a
ragged causal prefill over the valid tokens of the dense K/V it is given (planned once per forward too).

Masks: plain causal attention with a 2-D padding mask, as decoder-only models use in ``generate()``; a model
or call that needs more (sliding windows, packed sequences, bidirectional blocks, soft-caps, attention sinks,
dropout) raises ``ValueError`` naming it. The attention weights are not returned (None, like sdpa's).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from transformers import AttentionInterface, modeling_utils
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.models.llama import modeling_llama as _llama

from ..spec import AttentionSpec, Causal, Ragged
from .hf_cache import FlashgenCache, active_cache, valid_tokens

NAME = "flashgen"

# the keyword a model's forward() and generate() take a Cache by: "cache" since transformers 5.24
CACHE_ARG = "cache" if "cache" in inspect.signature(_llama.LlamaModel.forward).parameters else "past_key_values"

__all__ = ["CACHE_ARG", "NAME", "FlashgenCache", "flashgen_attention_forward", "padding_mask", "register_attention"]


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask transformers builds for ``"flashgen"``: the 2-D padding mask ``[batch, kv_length]`` bool as given
    (None without padding); causality is the kernels'. Anything but the plain causal mask is refused."""
    if mask_function is not causal_mask_function:
        raise ValueError(f"attention_mask: the {NAME!r} attention takes plain causal masks with padding; this "
                         f"model or call asks for {getattr(mask_function, '__name__', mask_function)!r} (sliding "
                         "windows, packed sequences or block overlays are not supported)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected a 2-D padding mask [batch, kv_length], got shape "
                         f"{tuple(attention_mask.shape)}")
    return attention_mask


_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def flashgen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [batch, num_heads, q_len, head_dim]``, ``key`` /
    ``value`` what the cache returned (``[batch, num_kv_heads, kv_len, head_dim]``), ``attention_mask`` what
    ``padding_mask`` returned -> ``(out [batch, q_len, num_heads, head_dim], None)`` in query's dtype."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by the {NAME!r} attention (got {kwargs[name]!r})")
    if dropout:
        raise ValueError(f"dropout: got {dropout}; the {NAME!r} attention is for inference (model.eval())")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise ValueError("attention_mask: expected the 2-D padding mask of the 'flashgen' mask function (register_attention() "
                         "both; a 4-D mask is not supported)")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"module: {type(module).__name__} is not causal; the {NAME!r} attention is causal only")
    cache = active_cache()
    layer = getattr(module, "layer_idx", None)
    if cache is not None and cache.holds(layer, key):
        return cache.attend(layer, query, attention_mask, scaling), None
    return _dense.attend(query, key, value, attention_mask, scaling), None


class DenseAttention:
    """The path without a ``FlashgenCache``: the valid tokens of dense K/V gathered into ragged tensors and run
    through a causal ragged ``BatchPrefillWrapper``. The plan is kept for the layers of one forward (the same
    mask tensor, held here, and the same shapes)."""

    def __init__(self):
        self._wrappers: dict = {}
        self._memo = None  # (mask, shapes, wrapper, q_rows, kv_rows)

    def attend(self, query, key, value, mask, scaling):
        batch, heads, q_len, dim = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        shapes = (tuple(query.shape), tuple(key.shape), query.dtype, query.device, scaling,
                  None if mask is None else mask._version)  # an in-place change of the mask re-plans
        memo = self._memo
        if memo is None or memo[0] is not mask or memo[1] != shapes:
            memo = self._memo = (mask, shapes, *self._plan(query, key, mask, scaling))
        wrapper, q_rows, kv_rows = memo[2:]
        q = _rows(query.transpose(1, 2).reshape(batch * q_len, heads, dim), q_rows)
        k = _rows(key.transpose(1, 2).reshape(batch * kv_len, kv_heads, dim), kv_rows)
        v = _rows(value.transpose(1, 2).reshape(batch * kv_len, kv_heads, value.shape[-1]), kv_rows)
        out = wrapper.run(q, (k, v))
        return _scatter(out, q_rows, batch, q_len)

    def _plan(self, query, key, mask, scaling):
        from ..api import BatchPrefillWrapper

        batch, heads, q_len, dim = query.shape
        kv_len = key.shape[2]
        kv_valid = valid_tokens(mask, batch, kv_len, "attention_mask")
        q_valid = kv_valid[:, kv_len - q_len:]
        spec = AttentionSpec(dim, head_dim_vo=key.shape[-1], dtype=str(query.dtype).removeprefix("torch."),
                             kv_layout=Ragged(), mask=Causal())
        wrapper = self._wrappers.get((spec, query.device))
        if wrapper is None:
            wrapper = self._wrappers[(spec, query.device)] = BatchPrefillWrapper(spec, device=query.device)
        wrapper.plan(qo_indptr=_indptr(q_valid), kv_indptr=_indptr(kv_valid), num_qo_heads=heads,
                     num_kv_heads=key.shape[1], sm_scale=scaling)
        return wrapper, _row_ids(q_valid, query.device), _row_ids(kv_valid, query.device)


def _indptr(valid: np.ndarray) -> np.ndarray:
    indptr = np.zeros(valid.shape[0] + 1, dtype=np.int32)
    np.cumsum(valid.sum(1), out=indptr[1:])
    return indptr


def _row_ids(valid: np.ndarray, device) -> torch.Tensor | None:
    """The flat indices of the valid tokens (device), or None when all are."""
    return None if valid.all() else torch.from_numpy(np.flatnonzero(valid.reshape(-1))).to(device)


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x.contiguous() if rows is None else x.index_select(0, rows)


def _scatter(out: torch.Tensor, rows: torch.Tensor | None, batch: int, q_len: int) -> torch.Tensor:
    """``out`` of the valid query rows back to ``[batch, q_len, heads, dim]`` (0 where a query is padding)."""
    if rows is not None:
        full = out.new_zeros(batch * q_len, *out.shape[1:])
        full.index_copy_(0, rows, out)
        out = full
    return out.view(batch, q_len, *out.shape[1:])


_dense = DenseAttention()


def register_attention(name: str = NAME) -> None:
    """Register the attention and mask functions under ``name`` (done on import for ``"flashgen"``).

    transformers takes every implementation whose name contains "flash" for a FlashAttention build and, when a
    model is made, imports one for it (``modeling_utils.lazy_import_flash_attention``), which fails for
    "flashgen"; that import is skipped for the names registered here, and left as it is for every other name.
    """
    AttentionInterface.register(name, flashgen_attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    _REGISTERED.add(name)
    importer = modeling_utils.lazy_import_flash_attention
    if not getattr(importer, "_flashgen_names", None):
        def lazy_import_flash_attention(implementation, *args, **kwargs):
            if implementation in _REGISTERED:
                return None
            return importer(implementation, *args, **kwargs)

        lazy_import_flash_attention._flashgen_names = _REGISTERED
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


_REGISTERED: set[str] = set()


register_attention()
