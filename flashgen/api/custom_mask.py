"""The custom-mask intake both prefill backends share: a ``custom_mask`` argument of ``plan()`` as packed bits
and per-request bit offsets."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..plan import PlanError
from ..plan.mask_tiles import mask_bit_offsets
from .staging import extra_offsets


class MaskBits(NamedTuple):
    """A batch's custom mask: request ``b``'s ``[qo_len, kv_len]`` bits start at bit ``offsets[b]`` of
    ``host`` (uint8 numpy, a mask given on the host) or ``device`` (uint8 CUDA tensor, read in place); the
    kernels read its first ``nbytes`` bytes."""

    offsets: np.ndarray
    host: np.ndarray | None
    device: torch.Tensor | None
    nbytes: int


# a CUDA-graph wrapper's copy of device masks is sized by its first plan
MASK_BYTES_HINT = "make the first plan the one with the most mask bits, or give the masks on the host"


def device_mask(bits: MaskBits, buffer) -> torch.Tensor | None:
    """The device mask the kernel reads: ``bits.device`` itself, or in CUDA-graph mode (``buffer``: the wrapper's
    fixed uint8 ``DeviceBuffer``) a copy of its bytes in that buffer. A captured graph keeps the mask's address
    (the params are captured by value), so a later plan's new mask tensor read in place would be ignored,
    silently; the copy is one device-to-device ``copy_`` on torch's current stream at plan time, ordered after
    the replays already queued. None for a host mask (it travels with the plan)."""
    if bits.device is None or buffer is None:
        return bits.device
    dst = buffer.get(bits.nbytes, "custom_mask", MASK_BYTES_HINT)
    if bits.nbytes:
        dst[: bits.nbytes].copy_(bits.device[: bits.nbytes], non_blocking=True)
    return dst


def custom_mask_bits(custom_mask, qo: np.ndarray, kv_lens: np.ndarray) -> MaskBits:
    """Check and pack ``custom_mask``: packed uint8 bits ``[>= ceil(sum(qo_len * kv_len) / 8)]`` (host array
    or tensor, or a contiguous CUDA tensor), or a list of bool ``[qo_len, kv_len]`` (packed here, on the host).

    >>> custom_mask_bits([np.ones((1, 3), bool)], np.array([0, 1]), np.array([3])).host.tolist()
    [7]
    """
    if custom_mask is None:
        raise PlanError("custom_mask: required by a CustomMask spec")
    qo_lens = np.diff(qo).astype(np.int64)
    offsets = mask_bit_offsets(qo_lens, kv_lens)
    need = -(-int((qo_lens * kv_lens.astype(np.int64)).sum()) // 8)
    if isinstance(custom_mask, (list, tuple)):
        if len(custom_mask) != qo_lens.size:
            raise PlanError(f"custom_mask: got {len(custom_mask)} masks, expected batch_size = {qo_lens.size} (one "
                            "bool [qo_len, kv_len] mask a request)")
        for b, m in enumerate(custom_mask):
            if tuple(np.shape(m)) != (int(qo_lens[b]), int(kv_lens[b])):
                raise PlanError(f"custom_mask[{b}]: shape {tuple(np.shape(m))}, expected "
                                f"{(int(qo_lens[b]), int(kv_lens[b]))} (qo_len, kv_len)")
        bits = [np.asarray(torch.as_tensor(m).cpu(), dtype=bool).reshape(-1) for m in custom_mask]
        custom_mask = np.packbits(np.concatenate(bits) if bits else np.zeros(0, bool), bitorder="little")
    if isinstance(custom_mask, torch.Tensor) and custom_mask.is_cuda:
        if custom_mask.dtype != torch.uint8 or custom_mask.dim() != 1 or not custom_mask.is_contiguous():
            raise PlanError(f"custom_mask: expected contiguous uint8 [n] packed bits, got {custom_mask.dtype} "
                            f"{tuple(custom_mask.shape)}")
        if custom_mask.numel() < need:
            raise PlanError(f"custom_mask: {custom_mask.numel()} bytes, expected {need} (sum of qo_len * kv_len bits)")
        return MaskBits(offsets, None, custom_mask, need)
    packed = np.asarray(custom_mask.cpu() if isinstance(custom_mask, torch.Tensor) else custom_mask)
    if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size < need:
        raise PlanError(f"custom_mask: expected uint8 [{need}] packed bits, got {packed.dtype} {packed.shape}")
    return MaskBits(offsets, packed, None, need)


def mask_extras(plan_numel: int, bits: MaskBits, indptr: np.ndarray, entries: np.ndarray, extras: dict,
                pages_host: np.ndarray | None, max_batch_size: int | None) -> dict:
    """``extras`` followed by a custom mask's arrays, as ``HostStaging.upload`` appends them after a plan of
    ``plan_numel`` elements: per-request bit offsets and per-item ``tile_indptr`` (fixed lengths in CUDA-graph
    mode), the host page ids if any, then the tile lists ``entries`` and a host mask's bits. The last two move
    when re-planning changes the lengths before them, so ``tile_indptr`` and a host mask's bit offsets count
    from the start of the device plan buffer (the kernels get its address as ``tiles`` and ``custom_mask``),
    whose address never changes in CUDA-graph mode. A device mask is read in place."""
    offsets = bits.offsets
    if max_batch_size is not None:
        offsets = np.concatenate([offsets, np.zeros(max_batch_size - offsets.size, np.int64)])
    out = {**extras, "mask_offset": offsets.astype("<i8").view(np.int32), "tile_indptr": indptr}
    if pages_host is not None:
        out["pages"] = pages_host
    out["tiles"] = entries
    if bits.host is not None:  # int32 words, the tail zero-filled (the kernel reads whole aligned words)
        words = np.zeros(-(-bits.host.size // 4) * 4, np.uint8)
        words[: bits.host.size] = bits.host
        out["mask"] = words.view("<i4")
    starts, _ = extra_offsets(plan_numel, {name: values.size for name, values in out.items()})
    out["tile_indptr"] = (indptr + starts["tiles"]).astype(np.int32)
    if bits.host is not None:
        out["mask_offset"] = (offsets + np.int64(starts["mask"]) * 32).astype("<i8").view(np.int32)
    return out
