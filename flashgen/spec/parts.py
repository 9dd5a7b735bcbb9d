"""The parts of an AttentionSpec: KV layouts, masks, positional encodings, dtypes.

Every part is a frozen dataclass. Structural choices (which part, page size, order, block shape) change
the generated code; numbers such as a window size or RoPE theta are runtime parameters and never reach
the kernel key (see ``AttentionSpec.kernel_fields``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


class SpecError(ValueError):
    """An invalid spec: the message names the field and the allowed values."""


# ---------------------------------------------------------------------------------------------- dtypes

Q_DTYPES = ("float16", "bfloat16")
KV_DTYPES = Q_DTYPES + ("float8_e4m3fn", "float8_e5m2")
MERGE_DTYPES = Q_DTYPES + ("float32",)

# short names used in uris; also accepted as input spellings
DTYPE_SHORT = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}
_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "e4m3": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(value: object, field: str, allowed: tuple[str, ...]) -> str:
    """Return the canonical name of a dtype given as a string or a ``torch.dtype``.

    >>> canonical_dtype("bf16", "dtype", Q_DTYPES)
    'bfloat16'
    """
    name = str(value)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _ALIASES.get(name, name)
    if name not in allowed:
        raise SpecError(f"{field}: got {value!r}, expected one of {', '.join(allowed)}")
    return name


def plain_number(value: object) -> object:
    """A numpy (or other ``numbers``) integer as the ``int``, a real as the ``float`` it stands for; anything else
    (bool included) as given. Specs hold plain numbers, so that equal specs compare, hash, render and serialise
    equal: ``Paged(np.int32(16)) == Paged(16)``; a float where an int belongs (``128.0``) stays a float and is
    refused by ``validate()``."""
    if type(value) is int or type(value) is float or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_fields(part: object, *names: str) -> None:
    """``plain_number`` of each named field of a frozen dataclass (its ``__post_init__``)."""
    for name in names:
        object.__setattr__(part, name, plain_number(getattr(part, name)))


def _check_int(value: object, field: str, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise SpecError(f"{field}: got {value!r}, expected an int >= {minimum}")


def check_positive(value: object, field: str, none: bool = False) -> None:
    """``SpecError`` unless ``value`` is a finite int or float > 0 (or None, when ``none``)."""
    if value is None and none:
        return
    if type(value) not in (int, float) or not (value > 0 and math.isfinite(value)):
        raise SpecError(f"{field}: got {value!r}, expected {'None or ' if none else ''}a finite number > 0")


# ---------------------------------------------------------------------------------------------- layouts

KV_ORDERS = ("NHD", "HND")


@dataclass(frozen=True)
class Paged:
    """Paged KV cache: pages of ``page_size`` tokens (any size >= 1).

    order "NHD": a page is ``[page_size, num_kv_heads, head_dim]``; "HND": ``[num_kv_heads, page_size, head_dim]``.
    """

    page_size: int
    order: str = "NHD"

    def __post_init__(self) -> None:
        plain_fields(self, "page_size")

    def validate(self) -> None:
        _check_int(self.page_size, "kv_layout.page_size", 1)
        if self.order not in KV_ORDERS:
            raise SpecError(f"kv_layout.order: got {self.order!r}, expected one of {', '.join(KV_ORDERS)}")

    @property
    def uri(self) -> str:
        return f"paged{self.page_size}{self.order.lower()}"


@dataclass(frozen=True)
class Ragged:
    """Ragged (contiguous per request) KV: ``[total_kv, num_kv_heads, head_dim]`` with ``kv_indptr``."""

    def validate(self) -> None:
        pass

    @property
    def uri(self) -> str:
        return "ragged"


@dataclass(frozen=True)
class BlockSparse:
    """Block-sparse attention: a BSR pattern of ``block_q`` x ``block_kv`` blocks."""

    block_q: int
    block_kv: int

    def __post_init__(self) -> None:
        plain_fields(self, "block_q", "block_kv")

    def validate(self) -> None:
        _check_int(self.block_q, "kv_layout.block_q", 1)
        _check_int(self.block_kv, "kv_layout.block_kv", 1)

    @property
    def uri(self) -> str:
        return f"bsr{self.block_q}x{self.block_kv}"


KV_LAYOUTS = (Paged, Ragged, BlockSparse)


# ---------------------------------------------------------------------------------------------- masks


@dataclass(frozen=True)
class NoMask:
    def validate(self) -> None:
        pass

    uri = "nomask"


@dataclass(frozen=True)
class Causal:
    """Causal mask aligned to the end of the KV: query i of a request with qo_len < kv_len sees
    keys ``0 .. kv_len - qo_len + i`` (chunked prefill, decode)."""

    def validate(self) -> None:
        pass

    uri = "causal"


@dataclass(frozen=True)
class SlidingWindow:
    """Causal sliding window: a query sees itself and ``left`` keys before it (runtime value)."""

    left: int

    def __post_init__(self) -> None:
        plain_fields(self, "left")

    def validate(self) -> None:
        _check_int(self.left, "mask.left", 0)

    uri = "window"


@dataclass(frozen=True)
class CustomMask:
    """A per-request bit mask given at plan time (packed bits, as FlashInfer's packed_custom_mask)."""

    def validate(self) -> None:
        pass

    uri = "custom"


MASKS = (NoMask, Causal, SlidingWindow, CustomMask)


# ---------------------------------------------------------------------------------------------- positional encodings


@dataclass(frozen=True)
class Llama31Scaling:
    """Llama-3.1 RoPE frequency scaling (runtime values; ``RoPE(scaling=...)``, ``flashgen.append_kv``'s
    ``rope_scaling``).

    With ``wavelen = 2 pi / f`` for each inverse frequency ``f``: wavelengths shorter than
    ``original_max_position / high_freq_factor`` keep ``f``; longer than ``original_max_position /
    low_freq_factor`` take ``f / factor``; between, ``(1 - s) f / factor + s f`` with ``s = (original_max_position
    / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`` (Hugging Face's ``_compute_llama3_parameters``).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        plain_fields(self, "factor", "low_freq_factor", "high_freq_factor", "original_max_position")
        self.validate()

    def validate(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"):
            check_positive(getattr(self, name), f"rope_scaling.{name}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise SpecError(f"rope_scaling.high_freq_factor: got {self.high_freq_factor!r}, expected > "
                            f"low_freq_factor ({self.low_freq_factor!r})")

    uri = "l31"

    def smooth_terms(self) -> tuple[float, float]:
        """``(a, b)`` with ``s = clamp(f * a + b, 0, 1)``: the kernel's form of the blend above."""
        span = self.high_freq_factor - self.low_freq_factor
        return self.original_max_position / (2 * math.pi * span), -self.low_freq_factor / span

    def rope_terms(self, theta: float, head_dim: int) -> tuple[float, float, float, float, float]:
        """``(rcp_factor, a, b, c, mscale)`` of common/rope.cuh's ``rope_scaled_freq`` (c = 0, mscale = 1)."""
        a, b = self.smooth_terms()
        return 1.0 / self.factor, a, b, 0.0, 1.0


@dataclass(frozen=True)
class YaRNScaling:
    """YaRN RoPE scaling (Peng et al.; Hugging Face's ``_compute_yarn_parameters``), runtime values.

    Frequency index ``i`` of ``head_dim / 2`` blends ``f_i / factor`` (interpolation) into ``f_i`` (extrapolation)
    with ``s = 1 - clamp((i - low) / (high - low), 0, 1)``: ``(1 - s) f_i / factor + s f_i``, where ``low``,
    ``high`` are the dims whose wavelengths make ``beta_fast`` and ``beta_slow`` turns over
    ``original_max_position`` (floored / ceiled when ``truncate``). Both q and k are multiplied by
    ``attention_factor`` (default ``0.1 ln(factor) + 1``).
    """

    factor: float = 4.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        plain_fields(self, "factor", "original_max_position", "beta_fast", "beta_slow", "attention_factor")
        self.validate()

    def validate(self) -> None:
        for name in ("factor", "original_max_position", "beta_fast", "beta_slow"):
            check_positive(getattr(self, name), f"rope_scaling.{name}")
        check_positive(self.attention_factor, "rope_scaling.attention_factor", none=True)
        if not self.beta_fast > self.beta_slow:
            raise SpecError(f"rope_scaling.beta_fast: got {self.beta_fast!r}, expected > beta_slow ({self.beta_slow!r})")
        if not isinstance(self.truncate, bool):
            raise SpecError(f"rope_scaling.truncate: got {self.truncate!r}, expected True or False")

    uri = "yarn"

    def mscale(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def rope_terms(self, theta: float, head_dim: int) -> tuple[float, float, float, float, float]:
        """``(rcp_factor, a, b, c, mscale)`` of ``rope_scaled_freq``: ``s = clamp(i c + b, 0, 1)`` (a = 0).

        Worked example: theta 10000, head_dim 128, original 4096, betas 32 / 1: dims 20.9 and 45.0 -> low 20,
        high 46 (c = -1/26, b = 1 + 20/26); frequencies 0..20 keep f_i, 46.. take f_i / factor."""
        def dim_of(turns: float) -> float:
            return head_dim * math.log(self.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        span = high - low
        return 1.0 / self.factor, 0.0, 1.0 + low / span, -1.0 / span, self.mscale()


ROPE_SCALINGS = (Llama31Scaling, YaRNScaling)
NO_SCALING = (1.0, 0.0, 1.0, 0.0, 1.0)  # rope_terms of plain RoPE: f_i unchanged, no attention factor


@dataclass(frozen=True)
class RoPE:
    """Llama-style rotary embedding applied in the kernel to q and k by absolute position.

    ``theta`` and ``scale`` (position interpolation: positions are divided by ``scale``) are runtime values.
    ``scaling``: None, ``Llama31Scaling(...)`` or ``YaRNScaling(...)`` (its kind changes code, its numbers are
    runtime values). ``k_rotated=True``: the cache already holds rotated K (as vLLM and most engines store it,
    e.g. written by ``flashgen.append_kv(rope=...)``), so attention rotates q only.
    """

    theta: float = 10000.0
    scale: float = 1.0
    scaling: object | None = None
    k_rotated: bool = False

    def __post_init__(self) -> None:
        plain_fields(self, "theta", "scale")

    def validate(self) -> None:
        check_positive(self.theta, "pos_encoding.theta")
        check_positive(self.scale, "pos_encoding.scale")
        if self.scaling is not None:
            if not isinstance(self.scaling, ROPE_SCALINGS):
                raise SpecError(f"pos_encoding.scaling: got {self.scaling!r}, expected None, Llama31Scaling(...) "
                                "or YaRNScaling(...)")
            self.scaling.validate()
        if not isinstance(self.k_rotated, bool):
            raise SpecError(f"pos_encoding.k_rotated: got {self.k_rotated!r}, expected True or False")

    @property
    def uri(self) -> str:
        """``rope``, then the scaling's kind (``l31``, ``yarn``) and ``krot`` when set: plain RoPE keeps its name."""
        return "rope" + ("" if self.scaling is None else self.scaling.uri) + ("krot" if self.k_rotated else "")

    def rope_terms(self, head_dim: int, theta: float | None = None) -> tuple[float, float, float, float, float]:
        """The scaling's ``(rcp_factor, a, b, c, mscale)`` (``NO_SCALING`` without one) at ``theta`` (default: the
        spec's)."""
        if self.scaling is None:
            return NO_SCALING
        return self.scaling.rope_terms(self.theta if theta is None else theta, head_dim)


@dataclass(frozen=True)
class ALiBi:
    """ALiBi linear biases with the standard per-head slopes (Press et al.; any head count).

    The bias ``slope[h] * (k_pos - q_pos)`` is added to the scaled logit ``q.k * sm_scale`` *before* the
    soft-cap (``AttentionSpec.soft_cap``) squashes it, as FlashInfer does: with both,
    ``logit = soft_cap * tanh((q.k * sm_scale + slope[h] * (k_pos - q_pos)) / soft_cap)``, then the mask.
    """

    def validate(self) -> None:
        pass

    uri = "alibi"


POS_ENCODINGS = (RoPE, ALiBi)
