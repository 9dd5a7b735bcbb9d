"""fp64 reference attention for every spec option, and the merge-state math.

The reference gathers each request's K/V into dense tensors (``layouts.request_kv``) and then does the
plain dense math, in this order, for query ``i`` of a request at absolute position
``q_pos = kv_len - qo_len + i`` and key ``j`` at ``k_pos = j`` (or at explicit positions: ``q_pos`` per query
token and ``kv_page_pos`` per page-table entry, ``explicit_positions``):

1. RoPE (Llama, non-interleaved halves): q and k rotated by ``pos / rope_scale`` with ``rope_theta`` (and the
   spec's Llama-3.1 / YaRN scaling); with ``RoPE(k_rotated=True)`` the cache holds rotated K and q alone turns.
2. ``logits = q . k * sm_scale`` (``sm_scale`` defaults to ``1 / sqrt(head_dim)``); GQA: q head ``h``
   uses kv head ``h // (num_qo_heads // num_kv_heads)``.
3. ALiBi: ``logits += slope[h] * (k_pos - q_pos)`` (standard slopes, any head count).
4. soft-cap: ``logits = soft_cap * tanh(logits / soft_cap)``.
5. mask: causal ``k_pos <= q_pos``; sliding window ``q_pos - window_left <= k_pos <= q_pos``; custom bit
   mask; block-sparse pattern. Masked logits are ``-inf``.
6. ``lse = log(sum(exp(logits)))`` (natural log), ``out = softmax(logits) @ v``.

A row with no visible key (a fully masked row, or an empty KV) gives ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flashgen.plan.page_table import validate_indptr
from flashgen.spec import ALiBi, AttentionSpec, BlockSparse, Causal, CustomMask, Ragged, RoPE, SlidingWindow  # noqa: F401

from .append import rope_attention_factor, rope_inv_freq
from .layouts import request_kv


@dataclass(frozen=True)
class RuntimeParams:
    """The runtime numbers of an attention call (they never change the kernel)."""

    sm_scale: float
    soft_cap: float | None = None
    window_left: int | None = None
    rope_theta: float = 10000.0
    rope_scale: float = 1.0


def runtime_params(spec: AttentionSpec, *, sm_scale=None, soft_cap=None, window_left=None, rope_theta=None,
                   rope_scale=None) -> RuntimeParams:
    """Resolve runtime values: an explicit argument wins, else the spec's value, else the default.

    >>> runtime_params(AttentionSpec(64)).sm_scale
    0.125
    """
    pos = spec.pos_encoding
    if soft_cap is None:
        soft_cap = spec.soft_cap
    if window_left is None and isinstance(spec.mask, SlidingWindow):
        window_left = spec.mask.left
    return RuntimeParams(
        sm_scale=spec.default_sm_scale if sm_scale is None else sm_scale,
        soft_cap=soft_cap,
        window_left=window_left,
        rope_theta=rope_theta if rope_theta is not None else (pos.theta if isinstance(pos, RoPE) else 10000.0),
        rope_scale=rope_scale if rope_scale is not None else (pos.scale if isinstance(pos, RoPE) else 1.0),
    )


# ---------------------------------------------------------------------------------------------- pieces


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Standard ALiBi slopes ``[num_heads]`` fp64 (Press et al.), also for head counts not a power of two.

    For ``n = 2**k`` heads: ``2**(-8 * i / n)``, i = 1..n. Otherwise the slopes of the largest power of two
    below, followed by every other slope of twice that count.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, theta: float, scale: float, scaling=None) -> torch.Tensor:
    """Llama rotary embedding (non-interleaved halves) of ``x [n, heads, dim]`` at positions ``pos [n]``, with the
    frequencies and attention factor of ``scaling`` (``RoPE.scaling``: Llama-3.1 or YaRN; ``testing.append``).

    Computed in fp64 (or fp32 for lower dtypes) and returned in ``x.dtype``.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = x.shape[-1] // 2
    inv_freq = rope_inv_freq(x.shape[-1], theta, scaling).to(x.device)
    angle = (pos.to(x.device, torch.float64)[:, None] / scale) * inv_freq[None, :]
    mscale = rope_attention_factor(scaling)
    cos, sin = (angle.cos() * mscale).to(work)[:, None, :], (angle.sin() * mscale).to(work)[:, None, :]
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def visible_mask(spec: AttentionSpec, params: RuntimeParams, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 extra: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[nq, nk]`` on the positions' device: which keys each query sees under ``spec.mask`` (and
    ``extra``, if given)."""
    diff = k_pos[None, :] - q_pos[:, None]
    visible = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    if isinstance(spec.mask, (Causal, SlidingWindow)):
        visible &= diff <= 0
    if isinstance(spec.mask, SlidingWindow):
        visible &= diff >= -params.window_left
    if extra is not None:
        visible &= extra.to(diff.device)
    return visible


def attend(spec: AttentionSpec, params: RuntimeParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           q_pos: torch.Tensor, k_pos: torch.Tensor, extra_mask: torch.Tensor | None = None,
           low_precision: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of ``q [nq, Hq, D]`` over ``k [nk, Hkv, D]``, ``v [nk, Hkv, Dv]`` at given positions.

    fp64 in, ``(out [nq, Hq, Dv], lse [nq, Hq])`` fp64 out. With ``low_precision`` the inputs' own dtype is
    kept for the two matrix products (logits and softmax math in fp32), as a kernel would compute. Runs on
    the device of ``q`` (CPU or CUDA; positions and ``extra_mask`` may live on the CPU).
    """
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    group = q.shape[1] // k.shape[1]
    if isinstance(spec.pos_encoding, RoPE):  # k_rotated: the cache holds rotated K, q alone turns
        rope = spec.pos_encoding
        q = apply_rope(q, q_pos, params.rope_theta, params.rope_scale, rope.scaling)
        if not rope.k_rotated:
            k = apply_rope(k, k_pos, params.rope_theta, params.rope_scale, rope.scaling)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    work = torch.float32 if low_precision else torch.float64
    logits = torch.einsum("qhd,khd->hqk", q, k).to(work) * params.sm_scale
    if isinstance(spec.pos_encoding, ALiBi):
        slopes = alibi_slopes(q.shape[1]).to(logits.device, work)
        logits = logits + slopes[:, None, None] * (k_pos[None, :] - q_pos[:, None]).to(work)[None]
    if params.soft_cap is not None:
        logits = params.soft_cap * torch.tanh(logits / params.soft_cap)
    visible = visible_mask(spec, params, q_pos, k_pos, extra_mask)
    logits = logits.masked_fill(~visible[None], float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True) if logits.shape[-1] else torch.full(
        logits.shape[:-1] + (1,), float("-inf"), dtype=work, device=logits.device)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(logits - shift)
    total = p.sum(dim=-1, keepdim=True)
    lse = (torch.log(total) + shift).squeeze(-1).transpose(0, 1)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("hqk,khd->qhd", p.to(v.dtype), v)
    return out.to(torch.float64), lse.to(torch.float64)


# ---------------------------------------------------------------------------------------------- custom masks


def pack_custom_mask(masks: list[torch.Tensor]) -> torch.Tensor:
    """Pack per-request bool masks ``[qo_len_b, kv_len_b]`` into ``uint8 [ceil(total_bits / 8)]``.

    Each mask is flattened row-major, the requests are concatenated (no per-request padding), and bits are
    packed little-endian (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``).

    >>> pack_custom_mask([torch.tensor([[True, False], [True, True]])]).tolist()
    [13]
    """
    bits = np.concatenate([np.asarray(m, dtype=bool).reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def unpack_custom_mask(packed: object, qo_lens: list[int], kv_lens: list[int]) -> list[torch.Tensor]:
    """Inverse of ``pack_custom_mask``: the list of bool masks ``[qo_len_b, kv_len_b]``.

    >>> unpack_custom_mask(torch.tensor([13], dtype=torch.uint8), [2], [2])[0].tolist()
    [[True, False], [True, True]]
    """
    sizes = [int(q) * int(k) for q, k in zip(qo_lens, kv_lens)]
    bits = np.unpackbits(np.asarray(packed, dtype=np.uint8), bitorder="little")
    if bits.size < sum(sizes) or bits.size >= sum(sizes) + 8 + (8 if sum(sizes) == 0 else 0):
        raise ValueError(f"custom_mask: {bits.size} packed bits, expected {sum(sizes)} rounded up to bytes")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [torch.from_numpy(bits[offsets[b]: offsets[b + 1]].astype(bool).reshape(int(q), int(k)))
            for b, (q, k) in enumerate(zip(qo_lens, kv_lens))]


def bsr_mask(indptr: object, indices: object, block_q: int, block_kv: int, qo_len: int, kv_len: int) -> torch.Tensor:
    """Bool ``[qo_len, kv_len]`` of a BSR pattern: block row ``r`` sees column blocks ``indices[indptr[r]:indptr[r+1]]``."""
    indptr = validate_indptr("bsr indptr", indptr)
    indices = np.asarray(indices, dtype=np.int64)
    rows = -(-qo_len // block_q)
    cols = -(-kv_len // block_kv)
    if indptr.size != rows + 1:
        raise ValueError(f"bsr indptr: {indptr.size} entries, expected {rows + 1} (ceil(M / block_q) + 1)")
    blocks = np.zeros((rows, cols), dtype=bool)
    used = indices[: indptr[-1]]
    if used.size and (used.min() < 0 or used.max() >= cols):
        raise ValueError(f"bsr indices: values must lie in [0, {cols}) (ceil(N / block_kv))")
    blocks[np.repeat(np.arange(rows), np.diff(indptr)), used] = True
    dense = blocks.repeat(block_q, axis=0).repeat(block_kv, axis=1)[:qo_len, :kv_len]
    return torch.from_numpy(np.ascontiguousarray(dense))


# ---------------------------------------------------------------------------------------------- entry point


def request_positions(qo_len: int, kv_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions ``(q_pos [qo_len], k_pos [kv_len])``: queries are the last ``qo_len`` tokens."""
    return torch.arange(qo_len, device=device) + (kv_len - qo_len), torch.arange(kv_len, device=device)


def explicit_positions(q_pos, kv_page_pos, qo: np.ndarray, kv_indptr, page_size: int, b: int, kv_len: int,
                       device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s ``(q_pos [qo_len], k_pos [kv_len])`` from explicit positions: ``q_pos`` one a query token,
    ``kv_page_pos`` the position of each page-table entry's first token (a token's own for ``Ragged()``), key
    ``j`` (its place in the request's pages) at ``kv_page_pos[kv_indptr[b] + j // page_size] + j % page_size``."""
    qp = torch.as_tensor(np.asarray(q_pos, dtype=np.int64)[int(qo[b]): int(qo[b + 1])])
    start = int(np.asarray(kv_indptr)[b])
    j = np.arange(kv_len)
    kp = np.asarray(kv_page_pos, dtype=np.int64)[start + j // page_size] + j % page_size
    return qp.to(device), torch.as_tensor(kp).to(device)


def _extra_masks(spec: AttentionSpec, custom_mask, bsr, qo_lens: list[int], kv_lens: list[int]):
    if isinstance(spec.mask, CustomMask):
        if custom_mask is None:
            raise ValueError("custom_mask: required by a CustomMask spec (packed uint8 or a list of bool masks)")
        if isinstance(custom_mask, (list, tuple)):
            masks = [torch.as_tensor(m, dtype=torch.bool) for m in custom_mask]
            for b, m in enumerate(masks):
                if tuple(m.shape) != (qo_lens[b], kv_lens[b]):
                    raise ValueError(f"custom_mask[{b}]: shape {tuple(m.shape)}, expected {(qo_lens[b], kv_lens[b])}")
            return masks
        return unpack_custom_mask(custom_mask, qo_lens, kv_lens)
    if isinstance(spec.kv_layout, BlockSparse):
        if bsr is None:
            raise ValueError("bsr: required by a BlockSparse spec, as (indptr, indices)")
        layout = spec.kv_layout
        return [bsr_mask(bsr[0], bsr[1], layout.block_q, layout.block_kv, qo_lens[0], kv_lens[0])]
    return [None] * len(qo_lens)


def reference_attention(spec: AttentionSpec, q: torch.Tensor, kv: object, *, qo_indptr=None, kv_indptr=None,
                        kv_indices=None, kv_last_page_len=None, block_table=None, seq_lens=None,
                        custom_mask=None, bsr=None, sm_scale=None, soft_cap=None, window_left=None,
                        rope_theta=None, rope_scale=None, low_precision: bool = False, q_pos=None,
                        kv_page_pos=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: ``(out [total_q, num_qo_heads, head_dim_vo], lse [total_q, num_qo_heads])`` fp64.

    ``q [total_q, num_qo_heads, head_dim]`` (requests by ``qo_indptr [batch + 1]``; a BlockSparse spec
    takes one request and needs no qo_indptr); ``kv`` in ``spec.kv_layout`` (see ``layouts.request_kv``).
    ``custom_mask``: packed uint8 (``pack_custom_mask``) or a list of bool ``[qo_len, kv_len]``; ``bsr``:
    ``(indptr, indices)`` with blocks ``spec.kv_layout.block_q x block_kv``. Runtime values not given come
    from the spec. ``lse`` is a natural log; fully masked rows give ``out = 0``, ``lse = -inf``.
    ``low_precision=True`` does the matrix products in q's dtype (the "same-dtype" error yardstick). The
    math runs where ``q`` and ``kv`` live (CPU, or CUDA for large batches); the results are on q's device.
    ``q_pos [total_q]`` with ``kv_page_pos [>= kv_indptr[-1]]`` (CSR page tables and Ragged; host ints): explicit
    true positions (``explicit_positions``) instead of queries at the end of their KV.

    >>> spec = AttentionSpec(64, kv_layout=Ragged(), mask=Causal())
    >>> q, k, v = torch.randn(3, 4, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    >>> out, lse = reference_attention(spec, q, (k, v), qo_indptr=[0, 3], kv_indptr=[0, 5])
    >>> out.shape, lse.shape
    (torch.Size([3, 4, 64]), torch.Size([3, 4]))
    """
    if q.dim() != 3 or q.shape[-1] != spec.head_dim:
        raise ValueError(f"q: shape {tuple(q.shape)}, expected [total_q, num_qo_heads, {spec.head_dim}]")
    params = runtime_params(spec, sm_scale=sm_scale, soft_cap=soft_cap, window_left=window_left,
                            rope_theta=rope_theta, rope_scale=rope_scale)
    if (q_pos is None) != (kv_page_pos is None) or (q_pos is not None and kv_indptr is None):
        raise ValueError("q_pos: explicit positions take q_pos and kv_page_pos together, with kv_indptr")
    requests = request_kv(spec, kv, kv_indptr=kv_indptr, kv_indices=kv_indices,
                          kv_last_page_len=kv_last_page_len, block_table=block_table, seq_lens=seq_lens)
    if qo_indptr is None and isinstance(spec.kv_layout, BlockSparse):
        qo_indptr = [0, q.shape[0]]
    qo = validate_indptr("qo_indptr", qo_indptr, length=q.shape[0])
    if len(requests) != qo.size - 1:
        raise ValueError(f"qo_indptr: {qo.size - 1} requests, but the KV page table has {len(requests)}")
    k0, v0 = requests[0] if requests else (None, None)
    if k0 is not None and (q.shape[1] % k0.shape[1] or k0.shape[2] != spec.head_dim or v0.shape[2] != spec.head_dim_vo):
        raise ValueError(f"kv: k [.., {k0.shape[1]}, {k0.shape[2]}], v [.., {v0.shape[2]}] do not fit q heads "
                         f"{q.shape[1]}, head_dim {spec.head_dim}, head_dim_vo {spec.head_dim_vo}")
    qo_lens, kv_lens = np.diff(qo).tolist(), [k.shape[0] for k, _ in requests]
    extras = _extra_masks(spec, custom_mask, bsr, qo_lens, kv_lens)
    out = torch.zeros(q.shape[0], q.shape[1], spec.head_dim_vo, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64, device=q.device)
    for b, (k, v) in enumerate(requests):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        if q_pos is not None:
            page_size = getattr(spec.kv_layout, "page_size", 1)
            qp, kp = explicit_positions(q_pos, kv_page_pos, qo, kv_indptr, page_size, b, kv_lens[b], q.device)
        else:
            qp, kp = request_positions(qo_lens[b], kv_lens[b], q.device)
        if low_precision:
            qb, k, v = q[rows], k.to(q.dtype), v.to(q.dtype)
        else:
            qb, k, v = q[rows].double(), k.double(), v.double()
        out[rows], lse[rows] = attend(spec, params, qb, k, v, qp, kp, extras[b], low_precision)
    return out, lse


# ---------------------------------------------------------------------------------------------- merge states


def merge_state_ref(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states, in fp64.

    ``v_* [tokens, heads, dim]``, ``s_* [tokens, heads]`` (natural-log lse). Returns
    ``s = log(exp(s_a) + exp(s_b))``, ``v = v_a * exp(s_a - s) + v_b * exp(s_b - s)``. A state with
    ``s = -inf`` is empty (weight 0, never NaN); two empty states give ``v = 0``, ``s = -inf``.

    >>> v, s = merge_state_ref(torch.ones(1, 1, 2), torch.zeros(1, 1), torch.zeros(1, 1, 2), torch.zeros(1, 1))
    >>> v.tolist(), round(float(s), 6)
    ([[[0.5, 0.5]]], 0.693147)
    """
    return merge_states_ref(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))


def merge_states_ref(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` partial states along dim 1, in fp64.

    ``v [tokens, num_states, heads, dim]``, ``s [tokens, num_states, heads]`` (natural-log lse). Returns
    ``(v [tokens, heads, dim], s [tokens, heads])`` fp64; ``-inf`` states weigh 0; all ``-inf`` (or
    ``num_states == 0``) gives ``v = 0``, ``s = -inf``.

    >>> v, s = merge_states_ref(torch.randn(4, 3, 2, 8), torch.full((4, 3, 2), float("-inf")))
    >>> bool((v == 0).all()), bool(torch.isneginf(s).all())
    (True, True)
    """
    v, s = v.double(), s.double()
    if s.shape[1] == 0:
        return v.new_zeros(v.shape[0], v.shape[2], v.shape[3]), s.new_full((s.shape[0], s.shape[2]), float("-inf"))
    top = s.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(s - shift)  # -inf states -> 0
    total = w.sum(dim=1, keepdim=True)
    merged_s = (torch.log(total) + shift).squeeze(1)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    merged_v = (w.unsqueeze(-1) * torch.where(w.unsqueeze(-1) > 0, v, torch.zeros_like(v))).sum(dim=1)
    return merged_v, merged_s
