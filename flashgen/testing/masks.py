"""Custom bit masks for tests: the mask kinds both prefill kernels are tested with, and the forms a mask can be
given in (a list of bool matrices, packed host bits as torch or numpy, packed device bits, a device view that
starts off its allocation's alignment)."""

from __future__ import annotations

import torch

from .reference import pack_custom_mask

KINDS = ("random<p>", "doc", "blocks", "causal", "zeros", "ones", "empty_rows")
FORMS = ("list", "host", "numpy", "device", "device_unaligned")


def doc_mask(qo_len: int, kv_len: int, docs: int) -> torch.Tensor:
    """``docs`` causal documents over the KV; the queries are its last qo_len tokens."""
    if qo_len > kv_len:
        return torch.zeros(qo_len, kv_len, dtype=torch.bool)
    doc = torch.arange(kv_len) * docs // max(kv_len, 1)
    pos = torch.arange(kv_len)
    rows = pos[kv_len - qo_len:]  # the queries' positions: only their rows are built
    return (doc[rows][:, None] == doc[None, :]) & (pos[None, :] <= rows[:, None])


def block_mask(qo_len: int, kv_len: int, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32 tokens x 64 keys (a q tile of group 4 x a portable KV tile), each empty (30 %), full (55 %) or
    random (15 %): EMPTY, FULL and PARTIAL tiles side by side; other groups and tile widths straddle the blocks."""
    rows, cols = -(-qo_len // 32), -(-kv_len // 64)
    if rows * cols == 0:
        return torch.zeros(qo_len, kv_len, dtype=torch.bool)
    kind = torch.multinomial(torch.tensor([0.3, 0.55, 0.15]), rows * cols, replacement=True, generator=gen)
    kind = kind.view(rows, cols).repeat_interleave(32, 0).repeat_interleave(64, 1)[:qo_len, :kv_len]
    return (kind == 1) | ((kind == 2) & (torch.rand(qo_len, kv_len, generator=gen) < 0.5))


def make_masks(kind: str, qo_lens, kv_lens, gen: torch.Generator) -> list[torch.Tensor]:
    """One [qo_len, kv_len] bool mask a request (True = visible), of ``kind`` (see ``KINDS``; ``random0.05`` is
    a random mask of density 0.05)."""
    shapes = list(zip(qo_lens, kv_lens))
    if kind.startswith("random"):
        return [torch.rand(a, b, generator=gen) < float(kind[6:]) for a, b in shapes]
    if kind == "doc":
        return [doc_mask(a, b, 3) for a, b in shapes]
    if kind == "blocks":
        return [block_mask(a, b, gen) for a, b in shapes]
    if kind == "causal":
        return [torch.arange(b)[None, :] <= (b - a + torch.arange(a))[:, None] for a, b in shapes]
    if kind == "zeros":
        return [torch.zeros(a, b, dtype=torch.bool) for a, b in shapes]
    if kind == "ones":
        return [torch.ones(a, b, dtype=torch.bool) for a, b in shapes]
    if kind == "empty_rows":  # every other row sees nothing; keys 128 .. 255 hidden from every row
        masks = [torch.rand(a, b, generator=gen) < 0.5 for a, b in shapes]
        for m in masks:
            m[::2] = False
            m[:, 128:256] = False
        return masks
    raise ValueError(f"kind: got {kind!r}, expected one of {KINDS}")


def as_form(masks: list[torch.Tensor], form: str):
    """``masks`` as the wrapper's ``custom_mask`` argument in ``form`` (see ``FORMS``)."""
    if form == "list":
        return masks
    packed = pack_custom_mask(masks)
    if form == "host":
        return packed
    if form == "numpy":
        return packed.numpy()
    if form == "device":
        return packed.cuda()
    if form == "device_unaligned":  # a view 3 bytes into its allocation: the kernels' word reads stay aligned
        return torch.cat([torch.zeros(3, dtype=torch.uint8), packed]).cuda()[3:]
    raise ValueError(f"form: got {form!r}, expected one of {FORMS}")
