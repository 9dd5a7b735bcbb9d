"""The K pre-pass of the Hopper prefill (op ``rope_gather``): K through a variant's ``k_transform`` and rotated
(RoPE over unrotated K, Llama-3.1 / YaRN scaling included), V copied, q (when it rotates) through the
``q_transform`` and rotated, from any KV layout into ragged scratch tensors
(``templates/include/flashgen/sm90/rope_gather.cuh``); fp8 K/V dequantised on the way into 16-bit scratch (K as
it is, its k_scale left in sm_scale unless a k_transform reads it; V times v_scale).

The sm90 prefill kernel turns no key and runs no k_transform (it turns q alone, for a cache of rotated K): for
such a spec the sm90 backend runs this pass, then the kernel of its ``ragged_twin`` (``kv_layout=Ragged()``, no
RoPE where the pass turned, the variant without the hooks the pass ran) over the scratch. The pass runs a hook once an element (in the kernel, every q
tile that reads a key would run it again: 16 times a key on average at 4 x 4096 causal) and moves K and V twice
(read, write), with RoPE q once too: for a 16k-token prefill at 8 kv heads, d=128, ~100 MB, about 30 µs at the
H200's copy rate against ~3.5 ms of attention; for an append over a long cached KV it is a larger share (the
cost of every cached key and value read and written once).
"""

from __future__ import annotations

from dataclasses import replace

from ..spec import AttentionSpec, NoMask, Paged, Ragged, RoPE, SpecError, Variant
from ..spec.variant import HOOKS
from .family import (POSITION_FIELDS, ROPE_FIELDS, ROPE_SCALING_FIELDS, EntryPoint, KernelFamily, LaunchConfig,
                     positions_option, rope_scaled, struct, variant_fields)

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
FP8_TYPES = {"float8_e4m3fn": "__nv_fp8_e4m3", "float8_e5m2": "__nv_fp8_e5m2"}
BLOCK_THREADS = 256
VEC = 8  # rotation pairs a thread: a 16-byte chunk of each half of a 16-bit row


def prepass_threads(rows: int, head_dim: int) -> int:
    """Threads of the pass over ``rows`` (head rows of q and of K, summed): one a chunk of ``VEC`` pairs."""
    return rows * (head_dim // 2 // VEC)


class RopeGatherFamily(KernelFamily):
    """Option ``positions`` (bool): q rotated by ``q_pos`` and K by the keys' ``kv_page_pos`` positions (the
    ``family.positions_option`` params), each scratch key's position written to ``kv_pos_out`` (the sm90
    kernel's ragged ``kv_page_pos``); the uri ends in ``_pos``."""

    op = "rope_gather"
    template = "rope_gather.cu.j2"

    def __init__(self, positions: bool = False):
        self.positions = positions
        self.options = (("positions", "true"),) if positions else ()

    def configure(self, options: dict) -> "RopeGatherFamily":
        unknown = set(options) - {"positions"}
        if unknown:
            raise SpecError(f"kernel_options: got {sorted(unknown)}, rope_gather takes 'positions' (True or False)")
        return RopeGatherFamily(positions_option(self.op, options))

    def uri(self, spec: AttentionSpec) -> str:
        return f"{self.op}_{spec.uri}{'_pos' if self.positions else ''}"

    def project(self, spec: object) -> AttentionSpec:
        """Only what the pass depends on: dtypes, head dims, the KV layout, whether it rotates (RoPE's theta /
        scale are runtime) and the variant's load hooks it runs (``prepass_variant``)."""
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected AttentionSpec")
        rope = rotates(spec)
        return replace(spec, mask=NoMask(), pos_encoding=_rope_kind(spec.pos_encoding) if rope else None,
                       soft_cap=None, sm_scale=None, variant=prepass_variant(spec.variant, rope))

    def check(self, spec: AttentionSpec) -> None:
        if not rotates(spec) and spec.variant is None and spec.kv_dtype not in FP8_TYPES:
            raise SpecError("spec: rope_gather runs RoPE, a variant's k_transform or fp8 K/V's dequantisation, and "
                            "the spec has none")
        if spec.dtype not in CPP_TYPES or spec.kv_dtype not in (spec.dtype, *FP8_TYPES):
            raise SpecError(f"kv_dtype: rope_gather takes float16 / bfloat16 with kv_dtype == dtype or fp8 "
                            f"(float8_e4m3fn, float8_e5m2), got {spec.dtype} / {spec.kv_dtype}")
        if spec.head_dim != spec.head_dim_vo or spec.head_dim % (2 * VEC):
            raise SpecError(f"head_dim: rope_gather takes a head_dim == head_dim_vo that is a multiple of {2 * VEC} "
                            f"(16-byte halves), got {spec.head_dim} / {spec.head_dim_vo}")
        if not isinstance(spec.kv_layout, (Paged, Ragged)):
            raise SpecError(f"kv_layout: rope_gather takes Paged or Ragged, got {spec.kv_layout!r}")

    def context(self, spec: AttentionSpec) -> dict:
        paged = isinstance(spec.kv_layout, Paged)
        return {"DType": CPP_TYPES[spec.dtype], "DTypeKV": _kv_type(spec), "HEAD_DIM": spec.head_dim,
                "PAGED": "true" if paged else "false",
                "PAGE_SIZE": spec.kv_layout.page_size if paged else 1, "BLOCK_THREADS": BLOCK_THREADS, "VEC": VEC,
                "POSITIONS": "true" if self.positions else "false",
                "ROPE": "true" if rotates(spec) else "false",
                "ROPE_SCALING": "true" if rotates(spec) and rope_scaled(spec) else "false"}

    def launch(self, spec: AttentionSpec) -> LaunchConfig:
        """``BLOCK_THREADS`` threads, a thread ``VEC`` rotation pairs of a row (``prepass_threads``)."""
        return LaunchConfig(block=(BLOCK_THREADS, 1, 1))

    def entry_points(self, spec: AttentionSpec) -> tuple[EntryPoint, ...]:
        t, kv, i32 = CPP_TYPES[spec.dtype], _kv_type(spec), "const int32_t*"
        fp8 = spec.kv_dtype in FP8_TYPES
        params = struct(
            "RopeGatherParams",
            (f"const {t}*", "q"), (f"const {kv}*", "k"), (f"const {kv}*", "v"),
            (f"{t}*", "q_out"), (f"{t}*", "k_out"), (f"{t}*", "v_out"),
            (i32, "qo_indptr"), (i32, "kv_indptr"), (i32, "kv_indices"), (i32, "block_table"), (i32, "kv_len"),
            (i32, "kv_out_indptr"),
            ("int64_t", "stride_page"), ("int64_t", "stride_token"), ("int64_t", "stride_head"),
            ("int64_t", "total_q"), ("int64_t", "total_kv_out"),
            ("int32_t", "block_table_stride"), ("int32_t", "batch"), ("int32_t", "num_qo_heads"),
            ("int32_t", "num_kv_heads"), *ROPE_FIELDS,
            *((("float", "k_scale"), ("float", "v_scale")) if fp8 else ()),
            *((*POSITION_FIELDS, ("int32_t*", "kv_pos_out")) if self.positions else ()),
            *(ROPE_SCALING_FIELDS if rotates(spec) and rope_scaled(spec) else ()), *variant_fields(spec),
        )
        return (EntryPoint("rope_gather", params),)


def _kv_type(spec: AttentionSpec) -> str:
    return FP8_TYPES.get(spec.kv_dtype) or CPP_TYPES[spec.dtype]


def rotates(spec: AttentionSpec) -> bool:
    """Whether the pass rotates (q and K): RoPE over a cache of unrotated K. Where the cache holds rotated K
    (``RoPE(k_rotated=True)``) the sm90 kernel turns q itself (``sm90/q_transform.cuh``) and no key turns."""
    rope = spec.pos_encoding
    return isinstance(rope, RoPE) and not rope.k_rotated


def _rope_kind(rope: RoPE) -> RoPE:
    """What of ``rope`` changes the pass's code: whether and how (the scaling's kind) it turns; theta, scale and
    the scaling's numbers are runtime values."""
    return RoPE(scaling=None if rope.scaling is None else type(rope.scaling)())


def prepass(spec: AttentionSpec, graph: bool = False) -> bool:
    """Whether the sm90 backend runs ``spec`` as this pass and its ``ragged_twin``: RoPE over unrotated K
    (``rotates``), a k_transform, or fp8 K/V outside CUDA-graph mode (the pass is not graph safe yet; in a graph
    the kernel converts fp8 K/V itself, ``sm90/fp8.cuh``, at 0.83x the bf16 rate)."""
    return (rotates(spec) or (spec.variant is not None and spec.variant.k_transform is not None)
            or (spec.kv_dtype in FP8_TYPES and not graph))


def prepass_variant(variant: Variant | None, rope: bool) -> Variant | None:
    """The hooks of ``variant`` the pass runs: its k_transform and, with RoPE (the pass then writes q), its
    q_transform, with every declaration (so the pass's ``VariantParams`` are the kernel's, packed alike); None
    where it runs none."""
    if variant is None or (variant.k_transform is None and not (rope and variant.q_transform is not None)):
        return None
    return Variant(q_transform=variant.q_transform if rope else None, k_transform=variant.k_transform,
                   tensors=variant.tensors, scalars=variant.scalars)


def ragged_twin(spec: AttentionSpec) -> AttentionSpec:
    """The sm90 kernel's spec behind a pre-pass spec (``prepass``): the same attention over the ragged 16-bit
    scratch, without RoPE (ALiBi kept) and without the hooks the pass ran (``prepass_variant``), the variant's
    declarations kept (the kernel's params pack the same run() arguments; the variant None where no hook is left)."""
    variant, rope = spec.variant, rotates(spec)
    if variant is not None:
        q_transform = None if rope else variant.q_transform
        left = any(getattr(variant, name) is not None for name in HOOKS if name not in ("q_transform", "k_transform"))
        variant = replace(variant, k_transform=None, q_transform=q_transform) if left or q_transform else None
    # RoPE over unrotated K: turned by the pass; over rotated K (q alone turns) and ALiBi: the kernel's
    return replace(spec, kv_layout=Ragged(), kv_dtype=spec.dtype, pos_encoding=None if rope else spec.pos_encoding,
                   variant=variant)
