"""A toy decoder for the torch-op tests: layers of (qkv projection, ``flashgen.ops.append_kv`` into a paged cache,
``flashgen.ops.prefill_run`` or ``decode_run``, output projection), its cache a module buffer, and the page tables
of a batch that prefills its prompts and then decodes a token a step."""

from __future__ import annotations

import copy

import numpy as np
import torch

import flashgen.ops as ops


class ToyDecoder(torch.nn.Module):
    def __init__(self, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                 num_pages: int = 16, page_size: int = 4, dtype=torch.bfloat16, device="cpu", seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, hidden, generator=gen) * hidden**-0.5) for _ in range(layers))
        self.o = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(hidden, heads * head_dim, generator=gen) * (heads * head_dim)**-0.5)
            for _ in range(layers))
        self.register_buffer("kv_cache", torch.zeros(layers, num_pages, 2, page_size, kv_heads, head_dim))
        self.to(dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, wrapper, decode: bool) -> torch.Tensor:
        """``x [tokens, hidden]``; ``slots [tokens]`` (page * page_size + offset) where each token's K/V go."""
        tokens = x.shape[0]
        run = ops.decode_run if decode else ops.prefill_run
        for layer, (w_qkv, w_o) in enumerate(zip(self.qkv, self.o)):
            qkv = (x @ w_qkv.t()).view(tokens, self.heads + 2 * self.kv_heads, self.head_dim)
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            cache = self.kv_cache[layer]
            ops.append_kv(k, v, cache, slot_mapping=slots)
            attn = run(wrapper, q.contiguous(), cache)
            x = x + attn.reshape(tokens, -1) @ w_o.t()
        return x


def twin(model: ToyDecoder) -> ToyDecoder:
    """A copy with the same weights and its own cache."""
    return copy.deepcopy(model)


class Batch:
    """Requests with their own pages (``pages_each`` a request, consecutive ids): prompts, then a token a step."""

    def __init__(self, prompt_lens: list[int], page_size: int, pages_each: int):
        self.lens = np.zeros(len(prompt_lens), np.int64)
        self.prompt_lens = np.asarray(prompt_lens, np.int64)
        self.page_size, self.pages_each = page_size, pages_each

    def _slots(self, request: np.ndarray, position: np.ndarray) -> torch.Tensor:
        page = request * self.pages_each + position // self.page_size
        return torch.from_numpy((page * self.page_size + position % self.page_size).astype(np.int64))

    def tables(self) -> dict:
        """The CSR page table of the requests' current lengths."""
        pages = -(-self.lens // self.page_size)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate([b * self.pages_each + np.arange(n) for b, n in enumerate(pages)]).astype(np.int32)
        last = (self.lens - (pages - 1) * self.page_size).astype(np.int32)
        return {"kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": last}

    def prefill(self) -> tuple[dict, torch.Tensor]:
        """(the plan's tables with qo_indptr, the prompt tokens' slots)"""
        request = np.repeat(np.arange(self.lens.size), self.prompt_lens)
        position = np.concatenate([np.arange(n) for n in self.prompt_lens])
        self.lens = self.prompt_lens.copy()
        qo = np.concatenate([[0], np.cumsum(self.prompt_lens)]).astype(np.int32)
        return {"qo_indptr": qo, **self.tables()}, self._slots(request, position)

    def decode(self) -> tuple[dict, torch.Tensor]:
        """(the plan's tables, the new tokens' slots), one token a request."""
        slots = self._slots(np.arange(self.lens.size), self.lens.copy())
        self.lens = self.lens + 1
        return self.tables(), slots
