"""The reference of the KV-cache write (``flashgen.append_kv``): the same write done with torch on the CPU, the
math (RoPE, scaling) in fp64 and one cast into the cache's dtype; and the check of a kernel's cache against it.

Imports ``flashgen.spec`` only: it shares no code with the kernel it checks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flashgen.spec import Llama31Scaling, RoPE, YaRNScaling

# one unit in the last place, relative (rtol), and the smallest subnormal (atol), per cache dtype
_ULP = {torch.float16: (2.0**-10, 2.0**-24), torch.bfloat16: (2.0**-7, 2.0**-133)}
for _name, _ulp in (("float8_e4m3fn", (2.0**-3, 2.0**-9)), ("float8_e5m2", (2.0**-2, 2.0**-16))):
    if hasattr(torch, _name):
        _ULP[getattr(torch, _name)] = _ulp


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama31Scaling | YaRNScaling | None = None) -> torch.Tensor:
    """fp64 ``[head_dim / 2]`` inverse frequencies ``theta^(-2i/head_dim)``, with Llama-3.1 scaling (Hugging
    Face's ``_compute_llama3_parameters``, written out with its wavelengths) or YaRN's (``_compute_yarn_parameters``,
    with its correction range) when given.

    >>> rope_inv_freq(4, 100.0).tolist()
    [1.0, 0.1]
    """
    inv = theta ** (-torch.arange(head_dim // 2, dtype=torch.float64) * 2.0 / head_dim)
    if scaling is None:
        return inv
    if isinstance(scaling, YaRNScaling):
        def correction_dim(turns):
            return (head_dim * math.log(scaling.original_max_position / (turns * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return inv / scaling.factor * (1 - extrapolation) + inv * extrapolation
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return torch.where(wavelen < high_wavelen, inv, torch.where(wavelen > low_wavelen, inv / scaling.factor, blended))


def rope_attention_factor(scaling) -> float:
    """YaRN's attention factor (cos and sin multiplied by it): ``attention_factor``, else ``0.1 ln(factor) + 1``;
    1 for other scalings."""
    if not isinstance(scaling, YaRNScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def cos_sin_table(max_position: int, head_dim: int, theta: float = 10000.0, scale: float = 1.0,
                  scaling: Llama31Scaling | None = None) -> torch.Tensor:
    """float32 ``[max_position, head_dim]``: cos of each position's angles, then their sin (FlashInfer's and
    vLLM's neox ``cos_sin_cache``), computed in fp64."""
    angle = torch.arange(max_position, dtype=torch.float64)[:, None] / scale * rope_inv_freq(head_dim, theta,
                                                                                            scaling)[None, :]
    return torch.cat([angle.cos(), angle.sin()], dim=1).float()


def _host(x) -> np.ndarray | None:
    return None if x is None else torch.as_tensor(x).cpu().numpy().astype(np.int64)


def _destinations(num_pages: int, page_size: int, kv_indptr, kv_indices, batch_indices, positions, slot_mapping):
    """(valid [tokens] bool, page [tokens], offset [tokens]): where each token goes, and whether it is written."""
    if slot_mapping is not None:
        slots = _host(slot_mapping)
        page, offset = np.floor_divide(slots, page_size), np.mod(slots, page_size)
        return (slots >= 0) & (page < num_pages), page, offset
    b, pos, indptr, indices = _host(batch_indices), _host(positions), _host(kv_indptr), _host(kv_indices)
    batch = indptr.size - 1
    valid = (b >= 0) & (b < batch) & (pos >= 0)
    bb = np.where(valid, b, 0)
    entry = indptr[bb] + np.where(valid, pos, 0) // page_size
    valid &= entry < indptr[bb + 1]
    page = np.where(valid, indices[np.where(valid, entry, 0)] if indices.size else 0, 0)
    valid &= (page >= 0) & (page < num_pages)
    return valid, page, np.where(valid, pos, 0) % page_size


def _rotate(k: torch.Tensor, pos: np.ndarray, valid: np.ndarray, rope, rope_scaling, cos_sin_cache):
    """fp64 k rotated at ``pos``; ``valid`` narrowed to the positions a cos/sin table has rows for."""
    half = k.shape[-1] // 2
    if cos_sin_cache is not None:
        table = cos_sin_cache.cpu().double()
        valid &= (pos >= 0) & (pos < table.shape[0])
        rows = table[torch.from_numpy(np.where(valid, pos, 0))]
        cos, sin = rows[:, :half], rows[:, half:]
    else:
        scaling = rope_scaling if rope_scaling is not None else rope.scaling
        angle = torch.from_numpy(pos).double()[:, None] / rope.scale * rope_inv_freq(k.shape[-1], rope.theta,
                                                                                     scaling)[None, :]
        mscale = rope_attention_factor(scaling)
        cos, sin = angle.cos() * mscale, angle.sin() * mscale
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = k[..., :half], k[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1), valid


def _quantize(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    s = scale.detach().cpu().double().reshape(1, -1, 1) if isinstance(scale, torch.Tensor) else \
        (1.0 if scale is None else float(scale))
    top = torch.finfo(dtype).max
    return (x / s).clamp(-top, top).to(dtype)


def append_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache, *, kv_layout: str = "NHD", kv_indptr=None,
                  kv_indices=None, batch_indices=None, positions=None, slot_mapping=None, rope: RoPE | None = None,
                  rope_scaling: Llama31Scaling | None = None, cos_sin_cache=None, k_scale=None, v_scale=None):
    """The cache after ``flashgen.append_kv`` with the same arguments, as CPU tensors in ``kv_cache``'s structure
    (one ``[pages, 2, ...]`` tensor or a ``(k_cache, v_cache)`` pair); ``kv_cache`` itself is left alone.

    Each written row is ``cast(rope(k) / k_scale)`` and ``cast(v / v_scale)`` computed in fp64 (fp8: saturated to
    the largest finite value); tokens that ``append_kv`` skips (negative slots or batch indices, positions beyond
    their request's pages or the cos/sin table, page ids outside the pool) leave their slots as they were.

    >>> cache = torch.zeros(2, 4, 1, 8); k = torch.ones(1, 1, 8)
    >>> out = append_kv_ref(k, 2 * k, (cache, cache), slot_mapping=torch.tensor([5]))
    >>> out[0][1, 1, 0, 0].item(), out[1][1, 1, 0, 0].item(), out[0].sum().item()
    (1.0, 2.0, 8.0)
    """
    if isinstance(kv_cache, (tuple, list)):
        out = (kv_cache[0].detach().cpu().clone(), kv_cache[1].detach().cpu().clone())
        k_cache, v_cache = out
    else:
        out = kv_cache.detach().cpu().clone()
        k_cache, v_cache = out[:, 0], out[:, 1]
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # views: writes land in `out`
    valid, page, offset = _destinations(k_cache.shape[0], k_cache.shape[1], kv_indptr, kv_indices, batch_indices,
                                        positions, slot_mapping)
    k64, v64 = k.detach().cpu().double(), v.detach().cpu().double()
    if rope is not None or cos_sin_cache is not None:
        k64, valid = _rotate(k64, _host(positions), valid, rope, rope_scaling, cos_sin_cache)
    rows = torch.from_numpy(np.flatnonzero(valid))
    at = (torch.from_numpy(page)[rows], torch.from_numpy(offset)[rows])
    k_cache[at] = _quantize(k64[rows], k_scale, k_cache.dtype)
    v_cache[at] = _quantize(v64[rows], v_scale, v_cache.dtype)
    return out


def assert_cache_close(out, ref, *, exact: bool = False, atol: float = 0.0) -> None:
    """A kernel's cache ``out`` against ``append_kv_ref``'s ``ref`` (same structure): slots that hold NaN in one
    hold NaN in the other (poisoned slots nobody writes stay poisoned), and every other value is bit-identical
    (``exact``: a copy) or within one unit in the last place of the cache's dtype (fp8 rounding) plus ``atol``,
    in the cache's units: the error of RoPE's angle and rotation in fp32, ~1e-4 for |x| ~ 2 at positions ~ 300,
    which a result near zero shows in more than one ulp."""
    pairs = zip(out, ref) if isinstance(out, (tuple, list)) else [(out, ref)]
    for got, want in pairs:
        got = got.detach().cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
        if exact:
            same = got.view(torch.uint8) == want.view(torch.uint8)
            assert bool(same.all()), f"{int((~same).sum())} cache bytes differ from the reference"
            continue
        g, w = got.double(), want.double()
        nan_g, nan_w = g.isnan(), w.isnan()
        assert torch.equal(nan_g, nan_w), (f"{int((nan_g & ~nan_w).sum())} written slots left unwritten, "
                                           f"{int((~nan_g & nan_w).sum())} poisoned slots overwritten")
        rtol, floor = _ULP[got.dtype]
        torch.testing.assert_close(g[~nan_g], w[~nan_w], rtol=rtol, atol=max(floor, atol))
