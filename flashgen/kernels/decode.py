"""The decode family: batch decode over paged or ragged KV on tensor cores, split-KV merged in-kernel."""

from __future__ import annotations

from ..spec import AttentionSpec, Causal, NoMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from .builtins import builtin_flags
from .family import (POSITION_FIELDS, ROPE_SCALING_FIELDS, AttentionFamily, EntryPoint, LaunchConfig, k_scale_fields,
                     positions_option, rope_scaled, split_kv_struct, variant_fields)

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float8_e4m3fn": "__nv_fp8_e4m3",
             "float8_e5m2": "__nv_fp8_e5m2"}
KV_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
DECODE_HEAD_DIMS = (64, 128, 256)
NUM_WARPS = 4
TILE_KV = NUM_WARPS * 16  # KV tokens per pipeline stage
TILE_Q = 16  # packed q rows of a work item: one m16 tile (a decode request's GQA group)
SMEM_TARGET = 113 * 1024  # two CTAs per SM on Hopper (227 KB)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def decode_smem_bytes(head_dim: int, head_dim_vo: int, stages: int, kv_bytes: int = 2) -> int:
    """Shared memory of one CTA (decode/tiles.cuh Layout): the 16-bit Q tile, ``stages`` K/V tiles of ``kv_bytes``
    elements (fp8 tiles stay fp8: they are converted in registers) and two rings of row offsets."""
    return 16 * head_dim * 2 + stages * TILE_KV * (head_dim + head_dim_vo) * kv_bytes + 2 * TILE_KV * 8


def decode_stages(head_dim: int, head_dim_vo: int, kv_bytes: int = 2) -> int:
    """Pipeline depth: as many stages (2..4) as fit two CTAs per SM.

    Worked example: head_dim 128 bf16: a stage is 64 tokens x (256 + 256) B = 32 KB; 4 KB of Q and 1 KB of
    offsets leave room for 3 stages under 113 KB (101 KB), so 3. head_dim 256: 64 KB a stage -> 2 (137 KB,
    one CTA per SM); head_dim 64: 16 KB a stage -> 4.
    """
    for stages in (4, 3):
        if decode_smem_bytes(head_dim, head_dim_vo, stages, kv_bytes) <= SMEM_TARGET:
            return stages
    return 2


def decode_ctas_per_sm(head_dim: int, head_dim_vo: int, kv_bytes: int = 2) -> int:
    """CTAs that fit on one SM (227 KB of shared memory, 1 KB reserved per CTA), at most 2 for 16-bit K/V and 3
    for fp8: the planner fills ``num_sms * ctas_per_sm`` slots, so that a small batch still keeps every resident
    CTA streaming. fp8 tiles take half the shared memory, and the kernel's ~160 registers a thread let three
    128-thread CTAs share an SM's 64K: head_dim 128 gets 3 (B=64, L=16k: 633 -> 557 us planned for 3 rather
    than 2, `experiments/exp_decode_fp8_occupancy.py`), 256 stays at 2 (shared memory)."""
    smem = decode_smem_bytes(head_dim, head_dim_vo, decode_stages(head_dim, head_dim_vo, kv_bytes), kv_bytes)
    return max(1, min(3 if kv_bytes == 1 else 2, (227 * 1024) // (smem + 1024)))


# the ``append`` option's params (after every other field): the new token's K/V rows, their strides, and the
# reciprocal fp8 scales they are quantised with (decode/append.cuh)
APPEND_FIELDS = (("const DTypeQ*", "k_new"), ("const DTypeQ*", "v_new"),
                 ("int64_t", "k_new_stride_token"), ("int64_t", "k_new_stride_head"),
                 ("int64_t", "v_new_stride_token"), ("int64_t", "v_new_stride_head"),
                 ("float", "k_rcp_scale"), ("float", "v_rcp_scale"))
APPEND_RUNTIME_FIELDS = tuple(name for _, name in APPEND_FIELDS[:6])  # written at run()


def _bool_option(options: dict, name: str) -> bool:
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise SpecError(f"kernel_options[{name!r}]: got {value!r}, expected True or False (decode)")
    return value


def rope_parts(spec: AttentionSpec) -> tuple[bool, bool, bool]:
    """(q turns, K turns as it is read, the frequencies are scaled) for ``spec``'s positional encoding."""
    rope = spec.pos_encoding if isinstance(spec.pos_encoding, RoPE) else None
    return rope is not None, rope is not None and not rope.k_rotated, rope_scaled(spec)


class DecodeFamily(AttentionFamily):
    """Option ``positions`` (bool): keys and the query at explicit true positions (``kv_page_pos``, ``q_pos``
    params; family.positions_option); the uri ends in ``_pos``. Option ``append`` (bool): fused append + decode,
    the new token's ``k_new`` / ``v_new`` written into the cache at place ``kv_len - 1`` and attended in the same
    launch (decode/append.cuh; paged caches); the uri ends in ``_append``."""

    op = "decode"
    template = "decode.cu.j2"
    variants = True
    load_transforms = ("q_transform", "k_transform")

    def __init__(self, positions: bool = False, append: bool = False):
        self.positions, self.append = positions, append
        self.options = tuple(sorted((name, "true") for name, on in (("positions", positions), ("append", append))
                                    if on))

    def configure(self, options: dict) -> "DecodeFamily":
        unknown = set(options) - {"positions", "append"}
        if unknown:
            raise SpecError(f"kernel_options: got {sorted(unknown)}, decode takes 'positions' and 'append' (True "
                            "or False)")
        return DecodeFamily(positions_option(self.op, options), _bool_option(options, "append"))

    def uri(self, spec: AttentionSpec) -> str:
        return f"{self.op}_{spec.uri}{'_pos' if self.positions else ''}{'_append' if self.append else ''}"

    def project(self, spec: object) -> AttentionSpec:
        spec = super().project(spec)
        if isinstance(spec.mask, Causal):  # a decode query is the last token: causal sees every key
            spec = spec.replace(mask=NoMask())
        return spec

    def check(self, spec: AttentionSpec) -> None:
        for name in ("head_dim", "head_dim_vo"):
            if getattr(spec, name) not in DECODE_HEAD_DIMS:
                raise SpecError(f"{name}: got {getattr(spec, name)}, decode supports {DECODE_HEAD_DIMS}")
        if KV_BYTES[spec.kv_dtype] == 2 and spec.kv_dtype != spec.dtype:
            raise SpecError(f"kv_dtype: got {spec.kv_dtype}, decode takes kv_dtype == dtype ({spec.dtype}) or fp8")
        if KV_BYTES[spec.kv_dtype] == 1 and min(spec.head_dim, spec.head_dim_vo) < 128:
            raise SpecError(f"kv_dtype: fp8 K/V need head dims of at least 128 (rows of 128 bytes), got "
                            f"{spec.head_dim}/{spec.head_dim_vo}")
        if not isinstance(spec.kv_layout, (Paged, Ragged)):
            raise SpecError(f"kv_layout: got {spec.kv_layout!r}, decode supports Paged(...) or Ragged()")
        if not isinstance(spec.mask, (NoMask, SlidingWindow)):
            raise SpecError(f"mask: got {spec.mask!r}, decode supports NoMask(), Causal() or SlidingWindow(left)")
        if isinstance(spec.pos_encoding, RoPE) and spec.head_dim != spec.head_dim_vo:
            raise SpecError("pos_encoding: RoPE in decode needs head_dim == head_dim_vo")
        if self.append and not isinstance(spec.kv_layout, Paged):
            raise SpecError(f"kv_layout: got {spec.kv_layout!r}; kernel_options['append'] writes into a paged cache, "
                            "expected Paged(page_size, order)")

    def context(self, spec: AttentionSpec) -> dict:
        paged = isinstance(spec.kv_layout, Paged)
        launch = self.launch(spec)
        rope_q, rope_k, scaled = rope_parts(spec)
        builtin = builtin_flags(spec)
        return {
            "DTypeQ": CPP_TYPES[spec.dtype],
            "DTypeKV": CPP_TYPES[spec.kv_dtype],
            # fp8 K/V convert to fp16 in one instruction a pair (bf16: three), so the mma runs in fp16 there
            "DTypeMMA": "__half" if KV_BYTES[spec.kv_dtype] == 1 else CPP_TYPES[spec.dtype],
            "DTypeO": CPP_TYPES[spec.dtype],
            "HEAD_DIM": spec.head_dim,
            "HEAD_DIM_VO": spec.head_dim_vo,
            "PAGE_SIZE": spec.kv_layout.page_size if paged else 1,
            "NUM_WARPS": NUM_WARPS,
            "STAGES": launch.stages,
            "SMEM_BYTES": launch.smem_bytes,
            "PAGED": _flag(paged),
            "ROPE": _flag(rope_q),
            "ROPE_K": _flag(rope_k),
            "ROPE_SCALING": _flag(scaled),
            "APPEND": _flag(self.append),
            "ROPE_K_ON_WRITE": _flag(self.append and rope_q and not rope_k),
            **{name: builtin[name] for name in ("ALIBI", "SOFT_CAP", "WINDOW")},  # decode has one query: no CAUSAL
            "POSITIONS": _flag(self.positions),
        }

    def launch(self, spec: AttentionSpec) -> LaunchConfig:
        kv_bytes = KV_BYTES[spec.kv_dtype]
        stages = decode_stages(spec.head_dim, spec.head_dim_vo, kv_bytes)
        return LaunchConfig(block=(NUM_WARPS * 32, 1, 1),
                            smem_bytes=decode_smem_bytes(spec.head_dim, spec.head_dim_vo, stages, kv_bytes),
                            tile_q=TILE_Q, tile_kv=TILE_KV,
                            ctas_per_sm=decode_ctas_per_sm(spec.head_dim, spec.head_dim_vo, kv_bytes), stages=stages)

    def entry_points(self, spec: AttentionSpec) -> tuple[EntryPoint, ...]:
        q = CPP_TYPES[spec.dtype]
        after = (("float", "v_scale"),) + (POSITION_FIELDS if self.positions else ())
        after += ROPE_SCALING_FIELDS if rope_scaled(spec) else ()
        after += tuple((ctype.replace("DTypeQ", q), name) for ctype, name in APPEND_FIELDS) if self.append else ()
        after += k_scale_fields(spec) + variant_fields(spec)
        decode = split_kv_struct("DecodeParams", q, CPP_TYPES[spec.kv_dtype], after=after)
        return (EntryPoint("decode", decode),)
