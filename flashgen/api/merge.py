"""Merging attention states: partial outputs with their log-sum-exp (natural log), as split-KV and
cascade attention produce them. ``lse = -inf`` marks an empty partial (weight 0)."""

from __future__ import annotations

import torch

from ..spec import MergeSpec
from .checks import check_shape, check_tensor
from .device import current_stream

V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_functions: dict[tuple[torch.dtype, int], tuple] = {}


def _entry(dtype: torch.dtype, device: torch.device):
    """(merge_state, merge_states, block, stream, merge_states_in_place) for tensors of ``dtype`` on ``device``."""
    index = device.index
    found = _functions.get((dtype, index))
    if found is None:
        from ..jit import build

        kernel = build(MergeSpec(str(dtype)), "merge_states", device=index)
        found = _functions[(dtype, index)] = (kernel["merge_state"], kernel["merge_states"],
                                              kernel.launch_config.block, kernel["merge_states_in_place"])
    return found[0], found[1], found[2], current_stream(index), found[3]


def _check_vectors(head_dim: int, dtype: torch.dtype) -> int:
    vec = 16 // dtype.itemsize
    if head_dim % vec:
        raise ValueError(f"head_dim: expected a multiple of {vec} for {dtype} (16-byte vectors), got {head_dim}")
    return vec


def _launch_shape(num_rows: int, head_dim: int, dtype: torch.dtype, block_threads: int) -> tuple[int, int]:
    """(threads_per_row, blocks): a power-of-two lane group per row, 16-byte vectors per lane."""
    vec = _check_vectors(head_dim, dtype)
    threads_per_row = min(32, 1 << max(0, (head_dim // vec - 1).bit_length()))
    rows_per_block = block_threads // threads_per_row
    return threads_per_row, max(1, min((num_rows + rows_per_block - 1) // rows_per_block, 2**31 - 1))


def _check_pair(v_a, s_a, v_b, s_b, names=("v_a", "s_a", "v_b", "s_b")):
    check_tensor(names[0], v_a, dtypes=V_DTYPES, ndim=3, align=16)
    check_tensor(names[2], v_b, dtypes=(v_a.dtype,), device=v_a.device, align=16)
    check_shape(names[2], v_b, tuple(v_a.shape))
    for name, s in ((names[1], s_a), (names[3], s_b)):
        check_tensor(name, s, dtypes=(torch.float32,), device=v_a.device)
        check_shape(name, s, tuple(v_a.shape[:2]))


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """Merge two attention states.

    v_a, v_b: ``[tokens, heads, head_dim]`` fp16/bf16/fp32; s_a, s_b: ``[tokens, heads]`` fp32 natural-log lse.
    Returns (v ``[tokens, heads, head_dim]`` in v_a's dtype, s ``[tokens, heads]`` fp32).

    Example::

        v, s = flashgen.merge_state(v_prefix, s_prefix, v_suffix, s_suffix)
    """
    _check_pair(v_a, s_a, v_b, s_b)
    v_out, s_out = torch.empty_like(v_a), torch.empty_like(s_a)
    _launch_pair(v_a, s_a, v_b, s_b, v_out, s_out, None)
    return v_out, s_out


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place; with ``mask`` (bool ``[tokens]``), only the
    tokens whose mask is true are merged. Shapes as in ``merge_state``."""
    _check_pair(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    if mask is not None:
        check_tensor("mask", mask, dtypes=(torch.bool, torch.uint8), ndim=1, device=v.device)
        check_shape("mask", mask, (v.shape[0],))
    _launch_pair(v, s, v_other, s_other, v, s, mask)


def _launch_pair(v_a, s_a, v_b, s_b, v_out, s_out, mask) -> None:
    tokens, heads, head_dim = v_a.shape
    if tokens * heads == 0:
        return
    _check_vectors(head_dim, v_a.dtype)
    fn, _, block, stream, _ = _entry(v_a.dtype, v_a.device)
    threads_per_row, blocks = _launch_shape(tokens * heads, head_dim, v_a.dtype, block[0])
    fn.launch((blocks, 1, 1), block, 0, stream,
              v_a.data_ptr(), s_a.data_ptr(), v_b.data_ptr(), s_b.data_ptr(), v_out.data_ptr(), s_out.data_ptr(),
              0 if mask is None else mask.data_ptr(), tokens * heads, heads, head_dim, threads_per_row)


def merge_states(v: torch.Tensor, s: torch.Tensor):
    """Merge ``num_states`` attention states per token.

    v: ``[tokens, num_states, heads, head_dim]`` fp16/bf16/fp32; s: ``[tokens, num_states, heads]`` fp32.
    Returns (v ``[tokens, heads, head_dim]`` in v's dtype, s ``[tokens, heads]`` fp32).

    Example::

        v, s = flashgen.merge_states(partial_v, partial_s)  # e.g. the chunks of a split-KV decode
    """
    check_tensor("v", v, dtypes=V_DTYPES, ndim=4, align=16)
    check_tensor("s", s, dtypes=(torch.float32,), ndim=3, device=v.device)
    tokens, num_states, heads, head_dim = v.shape
    check_shape("s", s, (tokens, num_states, heads))
    v_out = torch.empty((tokens, heads, head_dim), dtype=v.dtype, device=v.device)
    s_out = torch.empty((tokens, heads), dtype=torch.float32, device=v.device)
    if tokens * heads == 0:
        return v_out, s_out
    _check_vectors(head_dim, v.dtype)
    _, fn, block, stream, _ = _entry(v.dtype, v.device)
    threads_per_row, blocks = _launch_shape(tokens * heads, head_dim, v.dtype, block[0])
    fn.launch((blocks, 1, 1), block, 0, stream,
              v.data_ptr(), s.data_ptr(), v_out.data_ptr(), s_out.data_ptr(), tokens, num_states, heads,
              head_dim, threads_per_row)
    return v_out, s_out


def merge_states_in_place(v: torch.Tensor, s: torch.Tensor, v_parts: torch.Tensor, s_parts: torch.Tensor) -> None:
    """Merge ``num_states`` more states into ``(v, s)`` in place, ``num_states + 1`` a row in one launch.

    v: ``[tokens, heads, head_dim]`` fp16/bf16/fp32, s: ``[tokens, heads]`` fp32 (both contiguous);
    v_parts: ``[num_states, tokens, heads, head_dim]`` in v's dtype, s_parts: ``[num_states, tokens, heads]`` fp32,
    both contiguous (state-major: e.g. the chunks of a cascade level split over its keys).

    Example::

        flashgen.api.merge.merge_states_in_place(out, lse, chunk_out, chunk_lse)   # out [128, 32, 128]
    """
    check_tensor("v", v, dtypes=V_DTYPES, ndim=3, align=16)
    check_tensor("s", s, dtypes=(torch.float32,), ndim=2, device=v.device)
    check_shape("s", s, tuple(v.shape[:2]))
    check_tensor("v_parts", v_parts, dtypes=(v.dtype,), ndim=4, device=v.device, align=16)
    num_states = v_parts.shape[0]
    check_shape("v_parts", v_parts, (num_states, *v.shape))
    check_tensor("s_parts", s_parts, dtypes=(torch.float32,), ndim=3, device=v.device)
    check_shape("s_parts", s_parts, (num_states, *s.shape))
    tokens, heads, head_dim = v.shape
    if tokens * heads == 0 or num_states == 0:
        return
    _check_vectors(head_dim, v.dtype)
    _, _, block, stream, fn = _entry(v.dtype, v.device)
    threads_per_row, blocks = _launch_shape(tokens * heads, head_dim, v.dtype, block[0])
    fn.launch((blocks, 1, 1), block, 0, stream, v.data_ptr(), s.data_ptr(), v_parts.data_ptr(), s_parts.data_ptr(),
              tokens * heads, num_states, head_dim, threads_per_row)
