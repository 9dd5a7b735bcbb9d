"""AppendSpec: the KV-cache write (``flashgen.append_kv``), independent of any batch.

Structural choices (head_dim, the dtypes of the new K/V and of the cache, the paged layout, the kind of RoPE,
per-tensor or per-head fp8 scales, the page-table form and the dtype of the per-token index arrays) change the
generated code and form the kernel key. Numbers (RoPE theta / scale / Llama-3.1 scaling, the fp8 scales) are
runtime parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .attention import HEAD_DIMS
from .parts import DTYPE_SHORT, KV_DTYPES, Q_DTYPES, Llama31Scaling, Paged, SpecError, canonical_dtype, plain_fields

__all__ = ["AppendSpec", "Llama31Scaling"]

APPEND_ROPES = ("none", "rope", "cos_sin_cache")
APPEND_SCALES = ("per_tensor", "per_head")
APPEND_PAGE_TABLES = ("csr", "slot_mapping")
INDEX_DTYPES = ("int32", "int64")
_SHORT = {"none": "norope", "rope": "rope", "cos_sin_cache": "cossin", "per_tensor": "tscale",
          "per_head": "hscale", "csr": "csr", "slot_mapping": "slots", "int32": "i32", "int64": "i64"}


def _choice(value: object, name: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(f"{name}: got {value!r}, expected one of {', '.join(allowed)}")


@dataclass(frozen=True)
class AppendSpec:
    """The KV-cache write a kernel performs.

    ``dtype``: the new K/V (float16 / bfloat16); ``kv_dtype``: the cache (``dtype``, or fp8 e4m3 / e5m2, which
    quantises: ``cache = fp8(x / scale)``); ``kv_layout``: ``Paged(page_size, "NHD" | "HND")``; ``rope``:
    ``"none"``, ``"rope"`` (Llama halves at each token's position; theta, scale and Llama-3.1 scaling are runtime
    values) or ``"cos_sin_cache"`` (the caller's float32 ``[max_position, head_dim]`` table, cos then sin);
    ``scales``: ``"per_tensor"`` (two floats) or ``"per_head"`` (float32 device tensors, fp8 caches only);
    ``page_table``: ``"csr"`` (kv_indptr / kv_indices with per-token batch_indices and positions) or
    ``"slot_mapping"`` (page * page_size + offset per token, -1 = skip); ``index_dtype``: the per-token arrays'
    dtype (batch_indices, positions, slot_mapping).

    Example::

        spec = AppendSpec(128, "bfloat16", "float8_e4m3fn", Paged(16), rope="rope")
        spec.uri  # 'd128_bf16_kve4m3_paged16nhd_rope_tscale_csr_i32'
    """

    head_dim: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    kv_layout: object = field(default_factory=lambda: Paged(16))
    rope: str = "none"
    scales: str = "per_tensor"
    page_table: str = "csr"
    index_dtype: str = "int32"

    def __post_init__(self) -> None:
        plain_fields(self, "head_dim")
        dtype = canonical_dtype(self.dtype, "dtype", Q_DTYPES)
        object.__setattr__(self, "dtype", dtype)
        kv_dtype = dtype if self.kv_dtype is None else canonical_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES)
        object.__setattr__(self, "kv_dtype", kv_dtype)
        name = str(self.index_dtype)  # a torch.dtype is taken by its name
        object.__setattr__(self, "index_dtype", name[len("torch."):] if name.startswith("torch.") else name)
        self.validate()

    @property
    def quantized(self) -> bool:
        return self.kv_dtype not in Q_DTYPES

    def validate(self) -> None:
        """Raise ``SpecError`` naming the first invalid field and the values it allows."""
        if type(self.head_dim) is not int or self.head_dim not in HEAD_DIMS:
            raise SpecError(f"head_dim: got {self.head_dim!r}, expected an int, one of "
                            f"{', '.join(map(str, HEAD_DIMS))}")
        canonical_dtype(self.dtype, "dtype", Q_DTYPES)
        canonical_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES)
        if self.kv_dtype in Q_DTYPES and self.kv_dtype != self.dtype:
            raise SpecError(f"kv_dtype: a 16-bit cache holds the new K/V's dtype ({self.dtype}), got {self.kv_dtype}; "
                            "or give float8_e4m3fn / float8_e5m2 to quantise")
        if not isinstance(self.kv_layout, Paged):
            raise SpecError(f"kv_layout: got {self.kv_layout!r}, expected Paged(page_size, order)")
        self.kv_layout.validate()
        _choice(self.rope, "rope", APPEND_ROPES)
        _choice(self.scales, "scales", APPEND_SCALES)
        if self.scales == "per_head" and not self.quantized:
            raise SpecError(f"scales: per_head scales quantise to an fp8 kv_dtype, got kv_dtype {self.kv_dtype}")
        _choice(self.page_table, "page_table", APPEND_PAGE_TABLES)
        _choice(self.index_dtype, "index_dtype", INDEX_DTYPES)

    def kernel_fields(self) -> dict[str, object]:
        """Every field: each one changes code."""
        return {"head_dim": self.head_dim, "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "kv_layout": self.kv_layout.uri, "rope": self.rope, "scales": self.scales,
                "page_table": self.page_table, "index_dtype": self.index_dtype}

    @property
    def uri(self) -> str:
        """A readable name, unique per variant; built here and nowhere else."""
        return "_".join((f"d{self.head_dim}", DTYPE_SHORT[self.dtype], "kv" + DTYPE_SHORT[self.kv_dtype],
                         self.kv_layout.uri, _SHORT[self.rope], _SHORT[self.scales], _SHORT[self.page_table],
                         _SHORT[self.index_dtype]))
