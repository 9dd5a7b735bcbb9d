"""A small Llama-style decoder with seeded random weights, for the serving loop and its dense reference.

The forward pass takes the attention as a callback, so one model serves the paged engine (K/V written to
pages, attention through the wrappers or the fp64 reference) and the dense reference loop (K/V concatenated
per request, plain attention). Per layer: RMSNorm, q/k/v projections (GQA), RoPE on q and k (Llama,
non-interleaved halves, as ``flashgen.testing.reference.apply_rope``), ``attend(layer, q, k, v)``, the o
projection, RMSNorm, SwiGLU MLP. A cache holds rotated K, so the attention spec has ``pos_encoding=None``: K is
rotated before ``attend`` sees it, or (``rotate_k=False``, the GPU loop) by the cache write itself.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA); ``head_dim`` even."""

    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 64
    intermediate: int = 128
    vocab: int = 256
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden", "intermediate", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: got {self.num_heads}, expected a multiple of num_kv_heads = "
                             f"{self.num_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: got {self.head_dim}, expected an even number (RoPE rotates halves)")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: got {self.rope_theta!r}, expected a number > 0")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x [n, hidden]`` normalised by its root mean square (in fp32), times ``weight``; x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE (non-interleaved halves) of ``x [n, heads, dim]`` at ``positions [n]`` (fp32 math)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / x.shape[-1])
    angle = positions.to(x.device, torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


# attend(layer, q [n, num_heads, head_dim], k [n, num_kv_heads, head_dim], v [...]) -> out [n, num_heads, head_dim]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyLlama:
    """The decoder: weights drawn on ``device`` from a generator seeded with ``config.seed`` (the same weights on
    every device of one kind; drawing a demo-sized model on the CPU took 2.2 s of a 2-core machine's start-up),
    in ``dtype``.

    >>> model = TinyLlama(ModelConfig(num_layers=1, hidden=32, intermediate=64, vocab=50))
    >>> def attend(layer, q, k, v):  # one request, causal over its own tokens
    ...     return dense_attention(q, k, v, q_start=0)
    >>> model.forward(torch.tensor([1, 2, 3]), torch.arange(3), attend).shape
    torch.Size([3, 50])
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        c = config
        gen = torch.Generator(self.device).manual_seed(c.seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=self.device)

        def w(rows: int, cols: int) -> torch.Tensor:
            return (randn(rows, cols) / cols ** 0.5).to(dtype)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * randn(n)).to(dtype)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embedding = randn(c.vocab, c.hidden).to(dtype)
        self.layers = [_Layer(norm(c.hidden), w(q_dim, c.hidden), w(kv_dim, c.hidden), w(kv_dim, c.hidden),
                              w(c.hidden, q_dim), norm(c.hidden), w(c.intermediate, c.hidden),
                              w(c.intermediate, c.hidden), w(c.hidden, c.intermediate)) for _ in range(c.num_layers)]
        self.final_norm = norm(c.hidden)
        self.lm_head = w(c.vocab, c.hidden) * 4.0  # logits of std ~4: clear argmax margins at random weights

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                logit_rows: torch.Tensor | None = None, rotate_k: bool = True) -> torch.Tensor:
        """Logits ``[len(logit_rows), vocab]`` fp32 (every row when None) of ``tokens [n]`` at absolute
        ``positions [n]``; ``attend`` writes the new K/V where its cache keeps them and returns the attention.
        ``rotate_k=False``: ``attend`` gets K unrotated (it rotates K as it writes it: ``flashgen.append_kv``'s
        RoPE). Captured in a CUDA graph, ``tokens`` and ``positions`` are device tensors and nothing syncs."""
        c = self.config
        n = tokens.shape[0]
        positions = positions.to(self.device)
        h = self.embedding[tokens.to(self.device)]
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm)
            q = (x @ layer.wq.T).view(n, c.num_heads, c.head_dim)
            k = (x @ layer.wk.T).view(n, c.num_kv_heads, c.head_dim)
            v = (x @ layer.wv.T).view(n, c.num_kv_heads, c.head_dim)
            q = rope(q, positions, c.rope_theta)
            if rotate_k:
                k = rope(k, positions, c.rope_theta)
            out = attend(index, q, k, v)
            h = h + out.reshape(n, -1).to(self.dtype) @ layer.wo.T
            x = rms_norm(h, layer.mlp_norm)
            h = h + (torch.nn.functional.silu(x @ layer.w_gate.T) * (x @ layer.w_up.T)) @ layer.w_down.T
        if logit_rows is not None:
            h = h[logit_rows.to(self.device)]
        return (rms_norm(h, self.final_norm) @ self.lm_head.T).float()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Plain causal attention in fp64 of one request: ``q [n, Hq, D]`` at positions ``q_start + i`` over
    ``k, v [m, Hkv, D]`` at positions ``0..m-1`` (GQA: q head h reads kv head ``h // (Hq / Hkv)``); returns
    ``[n, Hq, D]`` fp64."""
    group = q.shape[1] // k.shape[1]
    qd = q.double().transpose(0, 1)  # [Hq, n, D]
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    logits = qd @ kd.transpose(1, 2) / q.shape[-1] ** 0.5
    q_pos = torch.arange(q_start, q_start + q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return (torch.softmax(logits, dim=-1) @ vd).transpose(0, 1)


def sample(logits: torch.Tensor, keys: list[tuple[int, int]], temperature: float, seed: int) -> list[int]:
    """Next tokens from ``logits [n, vocab]``: greedy (argmax) when ``temperature == 0``, else sampled from
    ``softmax(logits / temperature)`` with a generator seeded by ``(seed, request id, token index)`` per row,
    so a token does not depend on which batch it was computed in."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    out = []
    for row, (rid, index) in zip(probs, keys):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + rid * 10_007 + index) % 2**63)
        out.append(int(torch.multinomial(row, 1, generator=gen)))
    return out
