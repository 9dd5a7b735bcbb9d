"""The prefill family: batch prefill / append over ragged or paged KV on tensor cores (sm_80+, mma.sync).

Python decides the tiles (``prefill_tiles``): a CTA of ``NUM_WARPS`` warps, each owning ``16 * MMA_Q`` packed q rows (token x q
head of one GQA group), streams KV tiles of ``TILE_KV`` tokens through a ``STAGES``-deep cp.async pipeline.
"""

from __future__ import annotations

from ..spec import ALiBi, AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from .family import EntryPoint, KernelFamily, register, struct

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
PREFILL_HEAD_DIMS = (64, 128, 192, 256)  # rows of whole 128-byte lines (the swizzle needs 8k chunks)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def prefill_tiles(head_dim: int, head_dim_vo: int) -> tuple[int, int, int]:
    """``(NUM_WARPS, MMA_Q, TILE_KV)``: warps per CTA, 16-row mma tiles per warp, KV tokens per stage.

    Up to head_dim 128 a warp owns 32 rows (two m16 tiles), so each K/V fragment brought in by ldmatrix
    feeds two mma (16 rows a warp left the kernel shared-memory bound at ~220 TFLOP/s on the H200), and 4
    warps make a 128-row CTA tile, two CTAs an SM. Worked example: head_dim 128: O takes 128 fp32
    registers; a 32 x 64 score tile (64 more) left no room for the pipeline and mask state (spills), so KV
    tiles are 32 tokens (32 registers) and Q is read from shared memory. head_dim 64: O 64, scores 32, Q 32
    in registers (64-token tiles spilled with a custom mask and ALiBi). Up to 192 the 32-row warp would not
    fit the register file: 8 warps of 16 rows, one CTA per SM. head_dim 256 doubles O and Q (~240 registers), so KV tiles halve to 32 tokens
    and 4 warps (two CTAs per SM) keep the register file.
    """
    widest = max(head_dim, head_dim_vo)
    if widest <= 128:
        return 4, 2, 32
    if widest <= 192:
        return 8, 1, 64
    return 4, 1, 32


def prefill_tile_q(head_dim: int, head_dim_vo: int) -> int:
    """Packed q rows of one CTA tile (the planner's ``tile_rows``)."""
    num_warps, mma_q, _ = prefill_tiles(head_dim, head_dim_vo)
    return num_warps * 16 * mma_q


def prefill_smem_bytes(head_dim: int, head_dim_vo: int, stages: int, elem: int = 2) -> int:
    """Shared memory of one CTA: the Q tile, ``stages`` K/V tiles, two rings of KV row offsets (Layout)."""
    tile_kv = prefill_tiles(head_dim, head_dim_vo)[2]
    return (prefill_tile_q(head_dim, head_dim_vo) * head_dim * elem
            + stages * tile_kv * (head_dim + head_dim_vo) * elem + 2 * tile_kv * 8)


def prefill_ctas_per_sm(head_dim: int, head_dim_vo: int) -> int:
    """CTAs per SM: 8-warp CTAs of ~185-250 registers a thread fill the register file alone; 4-warp CTAs
    (<= 255 registers) fit two. Used by the planner (slots = SMs x this) and by ``prefill_stages``."""
    return 1 if prefill_tiles(head_dim, head_dim_vo)[0] == 8 else 2


def prefill_stages(head_dim: int, head_dim_vo: int) -> int:
    """Pipeline depth: 3 stages when they fit the CTAs of one SM (227 KB, 1 KB reserved per CTA), else 2.

    Worked example: head_dim 128, two 4-warp CTAs per SM: Q 32 KB + 3 x 16 KB = 81 KB <= 112 KB -> 3;
    head_dim 64: Q 16 KB + 3 x 8 KB = 41 KB -> 3. head_dim 192, one 8-warp CTA: Q 48 KB +
    3 x 40 KB = 169 KB -> 3. head_dim 256, two CTAs: Q 32 KB + 3 x 32 KB = 129 KB > 112 KB -> 2 (97 KB).
    """
    budget = (227 * 1024) // prefill_ctas_per_sm(head_dim, head_dim_vo) - 1024
    return 3 if prefill_smem_bytes(head_dim, head_dim_vo, 3) <= budget else 2


def prefill_q_in_regs(head_dim: int, head_dim_vo: int) -> bool:
    """Q fragments in registers (loaded once) rather than re-read from shared memory for every KV tile: when
    the Q tile is narrow and Q, O and the scores together stay within 160 fp32 registers a thread.

    Worked example: head_dim 64, two m16 tiles a warp: Q 32 + O 64 + S 32 = 128 -> registers; head_dim 128
    (Q 64 + O 128 + S 32) -> shared memory.
    """
    _, mma_q, tile_kv = prefill_tiles(head_dim, head_dim_vo)
    regs = mma_q * (head_dim // 4 + head_dim_vo // 2 + tile_kv // 2)
    return head_dim * mma_q <= 128 and regs <= 160


class PrefillFamily(KernelFamily):
    op = "prefill"
    template = "prefill.cu.j2"

    def project(self, spec: object) -> AttentionSpec:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected AttentionSpec")
        return spec

    def check(self, spec: AttentionSpec) -> None:
        for name in ("head_dim", "head_dim_vo"):
            if getattr(spec, name) not in PREFILL_HEAD_DIMS:
                raise SpecError(f"{name}: got {getattr(spec, name)}, prefill supports {PREFILL_HEAD_DIMS}")
        if spec.kv_dtype != spec.dtype:
            raise SpecError(f"kv_dtype: got {spec.kv_dtype}, prefill supports kv_dtype == dtype ({spec.dtype}) "
                            "so far; fp8 KV is not implemented yet")
        if not isinstance(spec.kv_layout, (Paged, Ragged)):
            raise SpecError(f"kv_layout: got {spec.kv_layout!r}, prefill supports Paged(...) or Ragged()")
        if not isinstance(spec.mask, (NoMask, Causal, SlidingWindow, CustomMask)):
            raise SpecError(f"mask: got {spec.mask!r}, prefill supports NoMask(), Causal(), SlidingWindow(left) "
                            "or CustomMask()")

    def context(self, spec: AttentionSpec) -> dict:
        paged = isinstance(spec.kv_layout, Paged)
        d, dv = spec.head_dim, spec.head_dim_vo
        num_warps, mma_q, tile_kv = prefill_tiles(d, dv)
        stages = prefill_stages(d, dv)
        return {
            "DTypeQ": CPP_TYPES[spec.dtype],
            "DTypeKV": CPP_TYPES[spec.kv_dtype],
            "DTypeO": CPP_TYPES[spec.dtype],
            "HEAD_DIM": d,
            "HEAD_DIM_VO": dv,
            "PAGE_SIZE": spec.kv_layout.page_size if paged else 1,
            "NUM_WARPS": num_warps,
            "MMA_Q": mma_q,
            "TILE_KV": tile_kv,
            "STAGES": stages,
            "SMEM_BYTES": prefill_smem_bytes(d, dv, stages),
            "Q_IN_REGS": _flag(prefill_q_in_regs(d, dv)),
            "PAGED": _flag(paged),
            "ROPE": _flag(isinstance(spec.pos_encoding, RoPE)),
            "ALIBI": _flag(isinstance(spec.pos_encoding, ALiBi)),
            "SOFT_CAP": _flag(spec.soft_cap is not None),
            "CAUSAL": _flag(isinstance(spec.mask, (Causal, SlidingWindow))),
            "WINDOW": _flag(isinstance(spec.mask, SlidingWindow)),
            "CUSTOM_MASK": _flag(isinstance(spec.mask, CustomMask)),
        }

    def entry_points(self, spec: AttentionSpec) -> tuple[EntryPoint, ...]:
        q, kv = CPP_TYPES[spec.dtype], CPP_TYPES[spec.kv_dtype]
        i32 = "const int32_t*"
        prefill = struct(
            "PrefillParams",
            (f"const {q}*", "q"), (f"const {kv}*", "k"), (f"const {kv}*", "v"), (f"{q}*", "o"), ("float*", "lse"),
            ("float*", "tmp_o"), ("float*", "tmp_lse"),
            (i32, "kv_indptr"), (i32, "kv_indices"), (i32, "block_table"),
            (i32, "qo_indptr"), (i32, "kv_len"), (i32, "request_idx"), (i32, "qo_tile_idx"), (i32, "chunk_idx"),
            (i32, "kv_start"), (i32, "kv_end"), (i32, "merge_indptr"), (i32, "num_chunks"), ("int32_t*", "counters"),
            ("const uint8_t*", "custom_mask"), ("const int64_t*", "mask_offset"),
            ("int64_t", "stride_page"), ("int64_t", "stride_token"), ("int64_t", "stride_head"),
            ("int32_t", "block_table_stride"), ("int32_t", "num_qo_heads"), ("int32_t", "group_size"),
            ("int32_t", "window_left"),
            ("float", "sm_scale"), ("float", "soft_cap"), ("float", "rope_rcp_scale"), ("float", "rope_log2_theta"),
        )
        return (EntryPoint("prefill", prefill),)


register(PrefillFamily())
