"""AttentionSpec: what attention a kernel computes, independent of any batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .parts import (
    DTYPE_SHORT,
    KV_DTYPES,
    KV_LAYOUTS,
    MASKS,
    MERGE_DTYPES,
    POS_ENCODINGS,
    Q_DTYPES,
    Causal,
    NoMask,
    Paged,
    SpecError,
    canonical_dtype,
    check_positive,
    plain_fields,
)
from .builtins import BuiltinHook, builtin_hooks, fold_builtins
from .variant import Variant

HEAD_DIMS = (64, 128, 192, 256)  # the head dims some kernel family takes


def _names(classes: tuple[type, ...]) -> str:
    return ", ".join(f"{c.__name__}(...)" for c in classes)


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a kernel computes.

    Structural fields (head dims, dtypes, KV layout and page size, mask kind, positional-encoding kind,
    soft-cap on/off) change the generated code and form the kernel key. Numbers (``sm_scale``, a window's
    ``left``, RoPE ``theta``/``scale``, the ``soft_cap`` value) are runtime parameters: specs that differ
    only in them share one kernel. ``variant``: user-defined hooks (``flashgen.Variant``); only their text and
    declarations enter the key (the uri ends ``_var<digest>``), never a scalar's value. It may also hold the
    built-ins written as hooks (``flashgen.variants.alibi()``, ``soft_cap(30.0)``, ``sliding_window(128)``,
    ``causal()``, ``custom_mask()``; a list of them beside at most one ``Variant``): they are folded into
    ``pos_encoding``, ``soft_cap`` and ``mask``, so ``AttentionSpec(128, variant=variants.soft_cap(30.0)) ==
    AttentionSpec(128, soft_cap=30.0)``.

    Integer fields (head dims, and the parts' page size, block shape, window) take ints, numpy's included
    (stored as ``int``: ``AttentionSpec(np.int64(128)) == AttentionSpec(128)``); a float or a bool there is a
    ``SpecError`` naming the field, as is a number field (``soft_cap``, ``sm_scale``, RoPE ``theta``/``scale``)
    that is not finite and > 0.

    Logits, in this order (``flashgen.testing.reference`` computes the same): RoPE rotates q and k; ``x = q.k *
    sm_scale``; ALiBi adds ``slope[h] * (k_pos - q_pos)``; the soft-cap maps ``x -> soft_cap * tanh(x /
    soft_cap)``, so ALiBi is applied before the cap (FlashInfer's order); then the mask.

    Example::

        spec = AttentionSpec(head_dim=128, dtype="bfloat16", kv_layout=Paged(16), mask=Causal())
        spec.uri  # 'd128_vo128_bf16_kvbf16_paged16nhd_causal_nopos_nocap'
    """

    head_dim: int
    head_dim_vo: int | None = None
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    kv_layout: object = field(default_factory=lambda: Paged(16))
    mask: object = field(default_factory=NoMask)
    pos_encoding: object | None = None
    soft_cap: float | None = None
    sm_scale: float | None = None
    variant: Variant | None = None

    def __post_init__(self) -> None:
        # normalise equivalent spellings so that equal specs compare, hash and key equal; built-in hooks given
        # as the variant (flashgen.variants.soft_cap(30.0), ...) become the fields they spell
        folded = fold_builtins(self.variant, self.pos_encoding, self.soft_cap, self.mask)
        for name, value in zip(("variant", "pos_encoding", "soft_cap", "mask"), folded):
            object.__setattr__(self, name, value)
        plain_fields(self, "head_dim", "head_dim_vo", "soft_cap", "sm_scale")
        dtype = canonical_dtype(self.dtype, "dtype", Q_DTYPES)
        object.__setattr__(self, "dtype", dtype)
        kv_dtype = dtype if self.kv_dtype is None else canonical_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES)
        object.__setattr__(self, "kv_dtype", kv_dtype)
        if self.head_dim_vo is None:
            object.__setattr__(self, "head_dim_vo", self.head_dim)
        self.validate()

    def validate(self) -> None:
        """Raise ``SpecError`` naming the first invalid field and the values it allows."""
        for name in ("head_dim", "head_dim_vo"):
            value = getattr(self, name)
            if type(value) is not int or value not in HEAD_DIMS:
                raise SpecError(f"{name}: got {value!r}, expected an int, one of {', '.join(map(str, HEAD_DIMS))}")
        canonical_dtype(self.dtype, "dtype", Q_DTYPES)
        canonical_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES)
        if not isinstance(self.kv_layout, KV_LAYOUTS):
            raise SpecError(f"kv_layout: got {self.kv_layout!r}, expected one of {_names(KV_LAYOUTS)}")
        self.kv_layout.validate()
        if not isinstance(self.mask, MASKS):
            raise SpecError(f"mask: got {self.mask!r}, expected one of {_names(MASKS)}")
        self.mask.validate()
        if self.pos_encoding is not None:
            if not isinstance(self.pos_encoding, POS_ENCODINGS):
                raise SpecError(
                    f"pos_encoding: got {self.pos_encoding!r}, expected None or one of {_names(POS_ENCODINGS)}"
                )
            self.pos_encoding.validate()
        check_positive(self.soft_cap, "soft_cap", none=True)
        check_positive(self.sm_scale, "sm_scale", none=True)
        if self.variant is not None:
            if not isinstance(self.variant, Variant):
                raise SpecError(f"variant: got {type(self.variant).__name__}, expected None, Variant(...) or "
                                "built-in hooks (flashgen.variants.alibi(), soft_cap(...), ...)")
            self.variant.validate()

    # ------------------------------------------------------------------------------------------ identity

    def kernel_fields(self) -> dict[str, object]:
        """The structural fields, the only ones that change code (and so the kernel key)."""
        return {
            "head_dim": self.head_dim,
            "head_dim_vo": self.head_dim_vo,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout.uri,
            "mask": self.mask.uri,
            "pos_encoding": "nopos" if self.pos_encoding is None else self.pos_encoding.uri,
            "soft_cap": self.soft_cap is not None,
            "variant": None if self.variant is None else self.variant.uri,
        }

    @property
    def uri(self) -> str:
        """A readable name, unique per structural variant; built here and nowhere else."""
        f = self.kernel_fields()
        return "_".join(
            (
                f"d{f['head_dim']}",
                f"vo{f['head_dim_vo']}",
                DTYPE_SHORT[f["dtype"]],
                "kv" + DTYPE_SHORT[f["kv_dtype"]],
                f["kv_layout"],
                f["mask"],
                f["pos_encoding"],
                "cap" if f["soft_cap"] else "nocap",
                *(() if f["variant"] is None else (f["variant"],)),
            )
        )

    @property
    def default_sm_scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def builtin_hooks(self) -> tuple[BuiltinHook, ...]:
        """The spec's ALiBi, soft-cap and mask as built-in hooks (``flashgen.spec.builtins``): score hooks first,
        ALiBi before the soft-cap, then the mask. ``AttentionSpec(d, variant=spec.builtin_hooks())`` is the spec
        without its built-ins set, built back from them."""
        return builtin_hooks(self.pos_encoding, self.soft_cap, self.mask)

    @property
    def is_causal(self) -> bool:
        return isinstance(self.mask, Causal)

    def replace(self, **changes: object) -> "AttentionSpec":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return AttentionSpec(**values)


@dataclass(frozen=True)
class MergeSpec:
    """The merge-state kernels' only structural choice: the dtype of the partial outputs."""

    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "dtype", MERGE_DTYPES))

    def validate(self) -> None:
        canonical_dtype(self.dtype, "dtype", MERGE_DTYPES)

    def kernel_fields(self) -> dict[str, object]:
        return {"dtype": self.dtype}

    @property
    def uri(self) -> str:
        return DTYPE_SHORT[self.dtype]
