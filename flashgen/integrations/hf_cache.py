"""``FlashgenCache``: a transformers ``Cache`` whose K/V live in a flashgen ``PagedKVCache``.

One pool holds every layer's KV heads side by side (``[pages, page_size, num_layers * num_kv_heads, head_dim]``
for K and for V), so one page table serves every layer; layer ``l``'s view is heads ``[l * H, (l + 1) * H)``,
read and written in place. A forward is a step: the cache's ``update`` of each layer records the new K/V and
hands them back, and the attention function (``transformers.flashgen_attention_forward``) calls ``attend``,
whose first call of the step plans (the padding mask's new columns read on the host: one small device-to-host
copy a forward; pages allocated for the valid new tokens; one plan) and every call writes its layer's new K/V
(``append_kv``, padding skipped) and runs the planned wrapper.

transformers' bookkeeping sees a rectangular cache: ``get_seq_length()`` counts every column the model has
been given, padding included, as its ``DynamicCache`` does, so ``attention_mask`` columns and positions line
up; the pool holds the valid tokens only.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..spec import AttentionSpec, Causal, NoMask, Paged

_active = threading.local()


def active_cache() -> "FlashgenCache | None":
    """The ``FlashgenCache`` whose ``update`` ran last on this thread (the attention function's cache)."""
    return getattr(_active, "cache", None)


def valid_tokens(mask: torch.Tensor | None, batch: int, length: int, name: str) -> np.ndarray:
    """The last ``length`` columns of a 2-D padding mask as a host bool ``[batch, length]`` (all True without a
    mask); one device-to-host copy."""
    if mask is None:
        return np.ones((batch, length), dtype=bool)
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < length:
        raise ValueError(f"{name}: expected a padding mask [{batch}, >= {length}], got {tuple(mask.shape)}")
    return mask[:, mask.shape[1] - length:].to("cpu", torch.bool).numpy()


class FlashgenLayer(CacheLayerMixin):
    """One layer of a ``FlashgenCache``: its K/V are the pool's heads of this layer; lengths are the cache's."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "FlashgenCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.reset()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("FlashgenCache: beam search, cropping and batch reordering are not supported "
                                  "(use greedy or sampled generate())")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class _Step:
    """One forward: its new K/V by layer until attended, and the plan of its first ``attend``."""

    def __init__(self, q_len: int):
        self.q_len = q_len
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seen: set[int] = set()
        self.wrapper = None
        self.scaling = None
        self.slots: torch.Tensor | None = None  # [batch * q_len] int64, -1 for padding
        self.rows: torch.Tensor | None = None  # flat indices of the valid queries, None when all are


class FlashgenCache(Cache):
    """A paged KV cache for transformers models run with ``attn_implementation="flashgen"``.

    ``config``: the model's config (its text config's ``num_hidden_layers``), or give ``num_layers``.
    ``page_size``: tokens a page (any >= 1). The pool is made at the first forward, when the batch, heads,
    head_dim, dtype and device are known: ``num_pages`` pages, by default enough for ``max_cache_len`` valid
    tokens a sequence. Batch rows are sequences ``0 .. batch - 1`` of the ``PagedKVCache`` (``cache.store``).
    Greedy and sampled ``generate()`` work; beam search, cropping and reordering raise.

    >>> cache = FlashgenCache(num_layers=2, page_size=16)   # doctest: +SKIP
    >>> model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8)   # doctest: +SKIP
    """

    def __init__(self, config=None, *, num_layers: int | None = None, page_size: int = 16,
                 max_cache_len: int = 4096, num_pages: int | None = None):
        if num_layers is None:
            if config is None:
                raise ValueError("config: give the model's config or num_layers")
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            num_layers = text.num_hidden_layers
        for name, value in (("num_layers", num_layers), ("page_size", page_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages: got {num_pages!r}, expected None or an int >= 1")
        super().__init__(layers=[FlashgenLayer(self, i) for i in range(num_layers)])
        # transformers' Cache has a read-only ``max_cache_len`` (deprecated since 5.16, the layers' maximum: none here)
        self.num_layers, self.page_size, self.num_pages = num_layers, page_size, num_pages
        self._tokens_a_sequence = max_cache_len
        self.reset()

    def reset(self) -> None:
        self.columns = 0  # mask columns seen, padding included
        self.store = None  # the PagedKVCache, made at the first forward
        self.batch = self.num_kv_heads = None
        self._step: _Step | None = None
        self._wrappers: dict = {}
        for layer in self.layers:
            layer.is_initialized = False

    # ------------------------------------------------------------------------------------------ update / attend

    def _update(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        step = self._step
        if step is None or layer in step.seen:  # a layer seen again: the next forward
            step = self._step = _Step(key.shape[2])
            self.columns += step.q_len
        step.seen.add(layer)
        step.new[layer] = (key, value)
        self.layers[layer].is_initialized = True
        _active.cache = self
        return key, value

    def holds(self, layer, key: torch.Tensor) -> bool:
        """Whether ``key`` is the new K this cache handed to ``layer`` in the current forward."""
        step = self._step
        return step is not None and layer in step.new and step.new[layer][0] is key

    def attend(self, layer: int, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """Write ``layer``'s new K/V into the pool and attend: ``query [batch, heads, q_len, head_dim]`` -> ``out
        [batch, q_len, heads, head_dim]`` (0 at padded queries)."""
        from ..api import append_kv

        step = self._step
        key, value = step.new.pop(layer)
        batch, heads, q_len, dim = query.shape
        if step.wrapper is None or step.scaling != scaling:
            self._plan(step, query, key, mask, scaling)
        kv = self.layer_kv(layer)
        kv_heads = key.shape[1]
        append_kv(key.transpose(1, 2).reshape(batch * q_len, kv_heads, dim),
                  value.transpose(1, 2).reshape(batch * q_len, kv_heads, value.shape[-1]), kv, slot_mapping=step.slots)
        q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
        q = q.contiguous() if step.rows is None else q.index_select(0, step.rows)
        out = step.wrapper.run(q, kv)
        if step.rows is not None:
            full = out.new_zeros(batch * q_len, heads, out.shape[-1])
            full.index_copy_(0, step.rows, out)
            out = full
        return out.view(batch, q_len, heads, out.shape[-1])

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V: views ``[pages, page_size, num_kv_heads, head_dim]`` of the pool."""
        k, v = self.store.kv
        heads = slice(layer * self.num_kv_heads, (layer + 1) * self.num_kv_heads)
        return k[:, :, heads], v[:, :, heads]

    # ------------------------------------------------------------------------------------------ plan

    def _plan(self, step: _Step, query: torch.Tensor, key: torch.Tensor, mask, scaling) -> None:
        batch, heads, q_len, dim = query.shape
        if self.store is None:
            self._make_store(batch, key)
        elif batch != self.batch or key.shape[1] != self.num_kv_heads:
            raise ValueError(f"query: batch {batch} x {key.shape[1]} kv heads, but this FlashgenCache holds {self.batch} "
                             f"sequences of {self.num_kv_heads} kv heads (use a new cache, or reset() it)")
        valid = valid_tokens(mask, batch, q_len, "attention_mask")
        counts = valid.sum(1)
        slots = np.full((batch, q_len), -1, dtype=np.int64)
        if step.slots is None:  # pages for the new tokens: once a forward (a re-plan for another scaling reuses them)
            for b in np.flatnonzero(counts):  # one allocate a row with new tokens (batch rows, not tokens)
                slots[b, valid[b]] = self.store.allocate(int(b), int(counts[b])).numpy()
            step.slots = torch.from_numpy(slots.reshape(-1)).to(query.device)
            step.rows = None if valid.all() else torch.from_numpy(np.flatnonzero(valid.reshape(-1))).to(query.device)
        tables = self.store.page_tables(list(range(batch)), device=query.device)
        decode = q_len == 1 and step.rows is None
        wrapper = self._wrapper(decode, query, key)
        common = {"num_qo_heads": heads, "num_kv_heads": key.shape[1], "sm_scale": scaling,
                  "num_pages": self.store.num_pages}
        if decode:
            wrapper.plan(**tables.csr(), **common)
        else:
            qo_indptr = np.zeros(batch + 1, dtype=np.int32)
            np.cumsum(counts, out=qo_indptr[1:])
            wrapper.plan(qo_indptr=qo_indptr, **tables.csr(), **common)
        step.wrapper, step.scaling = wrapper, scaling

    def _make_store(self, batch: int, key: torch.Tensor) -> None:
        from ..kvcache import PagedKVCache

        kv_heads, dim = key.shape[1], key.shape[3]
        pages = self.num_pages or batch * -(-self._tokens_a_sequence // self.page_size)
        self.store = PagedKVCache(pages, self.page_size, self.num_layers * kv_heads, dim, dtype=key.dtype,
                                  device=key.device, kv_form="pair", prefix_cache=False)
        for b in range(batch):
            self.store.add(b)
        self.batch, self.num_kv_heads = batch, kv_heads

    def _wrapper(self, decode: bool, query: torch.Tensor, key: torch.Tensor):
        from ..api import BatchDecodeWrapper, BatchPrefillWrapper

        spec = AttentionSpec(query.shape[-1], dtype=str(query.dtype).removeprefix("torch."),
                             kv_dtype=str(key.dtype).removeprefix("torch."), kv_layout=Paged(self.page_size),
                             mask=NoMask() if decode else Causal())
        wrapper = self._wrappers.get(decode)
        if wrapper is None or wrapper.spec.dtype != spec.dtype:
            cls = BatchDecodeWrapper if decode else BatchPrefillWrapper
            wrapper = self._wrappers[decode] = cls(spec, device=query.device)
        return wrapper
