"""The prefill family: batch prefill / append over ragged or paged KV on tensor cores (sm_80+, mma.sync).

Python decides the tiles (``prefill_tiles``; the family option ``tiles`` picks a preset, e.g.
``BatchPrefillWrapper(spec, kernel_options={"tiles": "kv32"})``): a CTA of ``NUM_WARPS`` warps, each owning
``16 * MMA_Q`` packed q rows (token x q head of one GQA group), streams KV tiles of ``TILE_KV`` tokens through a
``STAGES``-deep cp.async pipeline. The tiles are part of the uri.

fp8 K/V (e4m3, e5m2; head dims of at least 128) stay fp8 in shared memory and are converted in registers after
ldmatrix, as in decode (prefill/fp8.cuh): the mma runs in fp16, a bf16 q is multiplied by sm_scale and rounded
to fp16 when staged, k_scale is folded into sm_scale on the host and v_scale applied at the output. A stage takes
half the bytes, so ``prefill_stages`` fits one more (kv64 at d=128: 3 stages, 81 KB); the CTAs an SM stay two,
which the register file (4 warps x ~255 registers), not shared memory, bounds.

Floor, 4 x 4096 causal, 32 q heads, d=128 (the benchmark's count, 4 b h sq sk d / 2): 0.550 TFLOP of mma, 0.70 ms
at the ~790 TFLOP/s bf16 mma.sync peak the H200 measures (flashgen bench); K/V are 4 x 4096 x 8 heads x 2 x 256 B
= 64 MiB in bf16, 32 MiB in fp8, 14-7 us at 4.8 TB/s. fp8 halves K/V's bytes, which are not
the limit (the kernel is compute-bound): the goal is the bf16 rate, with the conversions (one cvt a pair for e4m3
to fp16, a byte move for e5m2: one per mma at 32 rows a warp) hidden under the mma.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from .builtins import builtin_flags
from .family import (POSITION_FIELDS, ROPE_SCALING_FIELDS, AttentionFamily, EntryPoint, LaunchConfig, k_scale_fields,
                     positions_option, rope_scaled, split_kv_struct, variant_fields)

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float8_e4m3fn": "__nv_fp8_e4m3",
             "float8_e5m2": "__nv_fp8_e5m2"}
KV_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
PREFILL_HEAD_DIMS = (64, 128, 192, 256)  # rows of whole 128-byte lines (the swizzle needs 8k chunks)
FP8_HEAD_DIMS = (128, 256)  # the same in one-byte elements


def _flag(value: bool) -> str:
    return "true" if value else "false"


@dataclass(frozen=True)
class PrefillTiles:
    """One tile configuration: ``NUM_WARPS`` warps of ``16 * MMA_Q`` q rows, KV tiles of ``TILE_KV`` tokens,
    ``STAGES`` pipeline stages (None: 3 when they fit the SM's share, else 2), ``CTAS_PER_SM`` (the launch
    bound's minimum, so registers a thread <= 64K / (threads x CTAs))."""

    num_warps: int
    mma_q: int
    tile_kv: int
    stages: int | None = None
    ctas_per_sm: int | None = None

    @property
    def ctas(self) -> int:
        return self.ctas_per_sm or (2 if self.num_warps <= 4 else 1)



def _kv32(widest: int) -> PrefillTiles:
    """The v1 tiles. Up to head_dim 128 a warp owns 32 rows (two m16 tiles), so each K/V fragment brought in
    by ldmatrix feeds two mma (16 rows a warp left the kernel shared-memory bound at ~220 TFLOP/s on the
    H200), and 4 warps make a 128-row CTA tile, two CTAs an SM, with KV tiles of 32 tokens. Up to 192 the
    32-row warp would not fit the register file: 8 warps of 16 rows, one CTA per SM. head_dim 256 doubles O
    (~240 registers), so KV tiles of 32 tokens and 4 warps (two CTAs per SM) keep the register file."""
    if widest <= 128:
        return PrefillTiles(4, 2, 32)
    if widest <= 192:
        return PrefillTiles(8, 1, 64)
    return PrefillTiles(4, 1, 32)


def _kv64(widest: int) -> PrefillTiles:
    """FA2's tiles for d=128 on sm80/sm90 (kBlockM 128, kBlockN 64, 4 warps): up to head_dim 128, 4 warps x 32
    rows and KV tiles of 64 tokens, two stages, two CTAs an SM (Q 32 KB + 2 x 32 KB = 96 KB each). Per key:
    half the barriers, pipeline steps, softmax row reductions and O-rescale checks of ``kv32``, and 17 % fewer
    ldmatrix (Q is re-read once per 64 keys instead of 32). Registers: O 128 + S 64 fp32 a thread; it fits
    255 only with the row state in shared memory (``RowInfo``). Wider heads as ``kv32``."""
    return PrefillTiles(4, 2, 64) if widest <= 128 else _kv32(widest)


PRESETS = {"kv32": _kv32, "kv64": _kv64}
DEFAULT_PRESET = "kv64"  # +17-23 % over kv32 (2026-11-29); its whole GPU test file passed on the H200 (gpu-tests-26abfb1.log)
_GRAMMAR = "one of kv32, kv64 or warps=W,rows=R,kv=K[,stages=S][,ctas=C]"
_KEYS = {"warps": "num_warps", "rows": "mma_q", "kv": "tile_kv", "stages": "stages", "ctas": "ctas_per_sm"}


def parse_tiles(value: str | None, widest: int) -> PrefillTiles:
    """The tiles the ``tiles`` option asks for at head width ``widest``: a preset name (default
    ``DEFAULT_PRESET``), or ``warps=W,rows=R,kv=K[,stages=S][,ctas=C]`` for every head dim (an experiment).

    Example: ``parse_tiles("warps=8,rows=16,kv=64,ctas=2", 128)`` == ``PrefillTiles(8, 1, 64, None, 2)``.
    """
    value = value or DEFAULT_PRESET
    if value in PRESETS:
        return PRESETS[value](widest)
    fields = {}
    for item in value.split(","):
        key, _, number = item.partition("=")
        if key.strip() not in _KEYS or not number.strip().isdigit():
            raise SpecError(f"kernel_options['tiles']: got {value!r}, expected {_GRAMMAR}")
        fields[_KEYS[key.strip()]] = int(number)
    if not {"num_warps", "mma_q", "tile_kv"} <= fields.keys():
        raise SpecError(f"kernel_options['tiles']: got {value!r}, warps, rows and kv are required")
    rows, kv = fields["mma_q"], fields["tile_kv"]
    if rows not in (16, 32) or kv not in (16, 32, 48, 64) or kv > 32 * fields["num_warps"]:
        raise SpecError(f"kernel_options['tiles']: got {value!r}; rows must be 16 or 32, kv 16, 32, 48 or 64 "
                        "and at most 32 x warps")
    fields["mma_q"] = rows // 16
    return PrefillTiles(**fields)


def tiles_for(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> PrefillTiles:
    """The tile configuration of (head_dim, head_dim_vo) under the ``tiles`` option (None: the default)."""
    return parse_tiles(tiles, max(head_dim, head_dim_vo))


def prefill_tiles(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> tuple[int, int, int]:
    """``(NUM_WARPS, MMA_Q, TILE_KV)``: warps per CTA, 16-row mma tiles per warp, KV tokens per stage."""
    t = tiles_for(head_dim, head_dim_vo, tiles)
    return t.num_warps, t.mma_q, t.tile_kv


def prefill_tile_q(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> int:
    """Packed q rows of one CTA tile (the planner's ``tile_rows``)."""
    num_warps, mma_q, _ = prefill_tiles(head_dim, head_dim_vo, tiles)
    return num_warps * 16 * mma_q


def prefill_smem_bytes(head_dim: int, head_dim_vo: int, stages: int, kv_bytes: int = 2,
                       tiles: str | None = None) -> int:
    """Dynamic shared memory of one CTA: the 16-bit Q tile, ``stages`` K/V tiles of ``kv_bytes`` elements (fp8
    tiles stay fp8), two rings of KV row offsets (Layout)."""
    tile_kv = prefill_tiles(head_dim, head_dim_vo, tiles)[2]
    return (prefill_tile_q(head_dim, head_dim_vo, tiles) * head_dim * 2
            + stages * tile_kv * (head_dim + head_dim_vo) * kv_bytes + 2 * tile_kv * 8)


def prefill_static_smem_bytes(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> int:
    """An upper bound of the static shared memory (``RowInfo``: a float4 of softmax statistics a thread and
    mma tile, a query position and an ALiBi slope a row; 512 bytes of scalars). d=128: 4 KB + 1 KB + 0.5 KB."""
    num_warps, mma_q, _ = prefill_tiles(head_dim, head_dim_vo, tiles)
    return 16 * mma_q * 32 * num_warps + 8 * prefill_tile_q(head_dim, head_dim_vo, tiles) + 512


def prefill_ctas_per_sm(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> int:
    """CTAs per SM (the launch bound's minimum): 8-warp CTAs of ~185-250 registers a thread fill the register
    file alone; 4-warp CTAs (<= 255 registers) fit two. Used by the planner (slots = SMs x this) and by
    ``prefill_stages``."""
    return tiles_for(head_dim, head_dim_vo, tiles).ctas


def prefill_stages(head_dim: int, head_dim_vo: int, tiles: str | None = None, kv_bytes: int = 2) -> int:
    """Pipeline depth: 3 stages when they fit the CTAs of one SM (227 KB, 1 KB reserved per CTA, the static
    shared memory), else 2.

    Worked example: head_dim 128, two 4-warp CTAs per SM (budget 112.5 - 1 - 5.5 = 106 KB): Q 32 KB +
    3 x 16 KB = 81 KB -> 3; with 64-token KV tiles Q 32 KB + 3 x 32 KB = 129 KB -> 2 (97 KB). head_dim 64:
    Q 16 KB + 3 x 8 KB = 41 KB -> 3. head_dim 192, one 8-warp CTA: Q 48 KB + 3 x 40 KB = 169 KB -> 3.
    head_dim 256, two CTAs: Q 32 KB + 3 x 32 KB = 129 KB -> 2 (97 KB).
    fp8 K/V (``kv_bytes`` 1) halve a stage: head_dim 128 with 64-token tiles, Q 32 KB + 3 x 16 KB = 81 KB -> 3;
    head_dim 256, Q 32 KB + 3 x 16 KB -> 3. The CTAs an SM do not change (registers bound them, not shared
    memory), so the room goes to a deeper pipeline: more loads in flight, and the fp8 tiles' extra ALU work
    (the conversions) has a tile more of slack before a warp waits on a copy. A fourth stage (97 KB) would
    also fit; decode measured deeper fp8 pipelines no faster (37323de), and the prologue grows with it.
    """
    stages = tiles_for(head_dim, head_dim_vo, tiles).stages
    if stages is not None:
        return stages
    budget = ((227 * 1024) // prefill_ctas_per_sm(head_dim, head_dim_vo, tiles) - 1024
              - prefill_static_smem_bytes(head_dim, head_dim_vo, tiles))
    return 3 if prefill_smem_bytes(head_dim, head_dim_vo, 3, kv_bytes, tiles) <= budget else 2


def prefill_q_in_regs(head_dim: int, head_dim_vo: int, tiles: str | None = None) -> bool:
    """Q fragments in registers (loaded once) rather than re-read from shared memory for every KV tile: when
    the Q tile is narrow and Q, O and the scores together stay within 160 fp32 registers a thread.

    Worked example: head_dim 64, two m16 tiles a warp: Q 32 + O 64 + S 32 = 128 -> registers; head_dim 128
    (Q 64 + O 128 + S 32) -> shared memory.
    """
    _, mma_q, tile_kv = prefill_tiles(head_dim, head_dim_vo, tiles)
    regs = mma_q * (head_dim // 4 + head_dim_vo // 2 + tile_kv // 2)
    return head_dim * mma_q <= 128 and regs <= 160


def prefill_late_copies(spec: AttentionSpec) -> bool:
    """Whether a tile's cp.async copies of the next tile go after the softmax (in the basic block of the exp2 and P V)
    rather than after Q K^T: ragged KV without a custom mask. Measured on the H200 at d=128 against FlashInfer FA2 in
    the same runs (2026-11, cb87f38; docs/performance.md "Portable prefill"): ragged none +1 % (0.99 -> 1.00-1.01x
    FA2), window +0.5-1 %, causal even, and the loop-top barrier waits half as long (ncu stall samples). Paged copies,
    which read their row offsets from shared memory first, lost 1-8 % there (window and causal most), and a custom
    mask's element pass (its bit loads) between Q K^T and the softmax lost 1.5-3 %: both keep the copies after Q K^T.
    Other head dims (other tiles, Q in registers at 64) are not measured yet and keep them too."""
    return (isinstance(spec.kv_layout, Ragged) and not isinstance(spec.mask, CustomMask)
            and spec.head_dim == spec.head_dim_vo == 128)


def _tiles_tag(head_dim: int, head_dim_vo: int, tiles: str | None = None, kv_bytes: int = 2) -> str:
    """``w4r32kv64s2c2``: the tiles as the uri names them (warps, rows a warp, KV tile, stages, CTAs/SM)."""
    warps, mma_q, tile_kv = prefill_tiles(head_dim, head_dim_vo, tiles)
    return (f"w{warps}r{16 * mma_q}kv{tile_kv}s{prefill_stages(head_dim, head_dim_vo, tiles, kv_bytes)}"
            f"c{prefill_ctas_per_sm(head_dim, head_dim_vo, tiles)}")


class PrefillFamily(AttentionFamily):
    """Option ``tiles``: a preset name (``kv64``, the default; ``kv32``) or ``warps=W,rows=R,kv=K[,stages=S]
    [,ctas=C]`` (``parse_tiles``); the uri names the resulting tiles, so every choice is its own kernel. Option
    ``positions`` (bool): keys and queries at explicit true positions (``kv_page_pos``, ``q_pos`` params;
    ``family.positions_option``), not with a custom mask; the uri ends in ``_pos``."""

    op = "prefill"
    template = "prefill.cu.j2"
    variants = True
    load_transforms = ("q_transform", "k_transform")

    def __init__(self, tiles: str | None = None, positions: bool = False):
        self.tiles, self.positions = tiles, positions
        self.options = ((("positions", "true"),) if positions else ()) + ((("tiles", tiles),) if tiles is not None
                                                                          else ())

    def configure(self, options: dict) -> "PrefillFamily":
        unknown = set(options) - {"tiles", "positions"}
        if unknown:
            raise SpecError(f"kernel_options: got {sorted(unknown)}, prefill takes 'tiles' ({_GRAMMAR}) and "
                            "'positions' (True or False)")
        tiles = options.get("tiles")
        if tiles is not None:
            if not isinstance(tiles, str):
                raise SpecError(f"kernel_options['tiles']: got {tiles!r}, expected {_GRAMMAR}")
            parse_tiles(tiles, 128)  # refuse a malformed value here, naming the option
        return PrefillFamily(tiles, positions_option(self.op, options))

    def uri(self, spec: AttentionSpec) -> str:
        tag = _tiles_tag(spec.head_dim, spec.head_dim_vo, self.tiles, KV_BYTES[spec.kv_dtype])
        return f"{self.op}_{spec.uri}_{tag}{'_pos' if self.positions else ''}"

    def launch(self, spec: AttentionSpec) -> LaunchConfig:
        d, dv, tiles, kv_bytes = spec.head_dim, spec.head_dim_vo, self.tiles, KV_BYTES[spec.kv_dtype]
        num_warps, _, tile_kv = prefill_tiles(d, dv, tiles)
        stages = prefill_stages(d, dv, tiles, kv_bytes)
        return LaunchConfig(block=(num_warps * 32, 1, 1), smem_bytes=prefill_smem_bytes(d, dv, stages, kv_bytes, tiles),
                            tile_q=prefill_tile_q(d, dv, tiles), tile_kv=tile_kv,
                            ctas_per_sm=prefill_ctas_per_sm(d, dv, tiles), stages=stages)

    def check(self, spec: AttentionSpec) -> None:
        for name in ("head_dim", "head_dim_vo"):
            if getattr(spec, name) not in PREFILL_HEAD_DIMS:
                raise SpecError(f"{name}: got {getattr(spec, name)}, prefill supports {PREFILL_HEAD_DIMS}")
        fp8 = KV_BYTES[spec.kv_dtype] == 1
        if not fp8 and spec.kv_dtype != spec.dtype:
            raise SpecError(f"kv_dtype: got {spec.kv_dtype}, prefill takes kv_dtype == dtype ({spec.dtype}) or fp8 "
                            "(float8_e4m3fn, float8_e5m2)")
        if fp8 and not {spec.head_dim, spec.head_dim_vo} <= set(FP8_HEAD_DIMS):
            raise SpecError(f"kv_dtype: fp8 K/V need head dims in {FP8_HEAD_DIMS} (rows of whole 128-byte lines), "
                            f"got {spec.head_dim}/{spec.head_dim_vo}")
        if fp8 and prefill_tiles(spec.head_dim, spec.head_dim_vo, self.tiles)[2] % 32:
            raise SpecError(f"kernel_options['tiles']: fp8 K/V need KV tiles of 32 or 64 tokens, got {self.tiles!r}")
        if fp8 and isinstance(spec.pos_encoding, RoPE) and not spec.pos_encoding.k_rotated:
            raise SpecError("pos_encoding: RoPE over unrotated fp8 K is not supported by the prefill (it rotates K in "
                            "shared memory, in K's dtype); store K rotated (append_kv(rope=...)) and use "
                            "RoPE(k_rotated=True), or 16-bit K/V")
        if not isinstance(spec.kv_layout, (Paged, Ragged)):
            raise SpecError(f"kv_layout: got {spec.kv_layout!r}, prefill supports Paged(...) or Ragged()")
        if not isinstance(spec.mask, (NoMask, Causal, SlidingWindow, CustomMask)):
            raise SpecError(f"mask: got {spec.mask!r}, prefill supports NoMask(), Causal(), SlidingWindow(left) "
                            "or CustomMask()")
        if self.positions and isinstance(spec.mask, CustomMask):
            raise SpecError("mask: CustomMask() takes no explicit positions (kernel_options['positions']): its bits "
                            "are indexed by (query, key) places, not positions")

    def context(self, spec: AttentionSpec) -> dict:
        paged = isinstance(spec.kv_layout, Paged)
        d, dv = spec.head_dim, spec.head_dim_vo
        num_warps, mma_q, tile_kv = prefill_tiles(d, dv, self.tiles)
        launch = self.launch(spec)
        return {
            "DTypeQ": CPP_TYPES[spec.dtype],
            "DTypeKV": CPP_TYPES[spec.kv_dtype],
            # fp8 K/V convert to fp16 in one instruction a pair (bf16: three), so the mma runs in fp16 there
            "DTypeMMA": "__half" if KV_BYTES[spec.kv_dtype] == 1 else CPP_TYPES[spec.dtype],
            "DTypeO": CPP_TYPES[spec.dtype],
            "HEAD_DIM": d,
            "HEAD_DIM_VO": dv,
            "PAGE_SIZE": spec.kv_layout.page_size if paged else 1,
            "NUM_WARPS": num_warps,
            "MMA_Q": mma_q,
            "TILE_KV": tile_kv,
            "STAGES": launch.stages,
            "CTAS_PER_SM": launch.ctas_per_sm,
            "SMEM_BYTES": launch.smem_bytes,
            "Q_IN_REGS": _flag(prefill_q_in_regs(d, dv, self.tiles)),
            "LATE_COPIES": _flag(prefill_late_copies(spec)),
            "PAGED": _flag(paged),
            "ROPE": _flag(isinstance(spec.pos_encoding, RoPE)),
            "ROPE_K": _flag(isinstance(spec.pos_encoding, RoPE) and not spec.pos_encoding.k_rotated),
            "ROPE_SCALING": _flag(rope_scaled(spec)),
            **builtin_flags(spec),  # ALIBI, SOFT_CAP, CAUSAL, WINDOW, CUSTOM_MASK: the built-in hooks
            "POSITIONS": _flag(self.positions),
        }

    def entry_points(self, spec: AttentionSpec) -> tuple[EntryPoint, ...]:
        i32 = "const int32_t*"
        mask = (("const uint8_t*", "custom_mask"), ("const int64_t*", "mask_offset"), (i32, "tile_indptr"),
                (i32, "tiles"))
        v_scale = (("float", "v_scale"),) if KV_BYTES[spec.kv_dtype] == 1 else ()  # fp8 V's per-tensor scale
        prefill = split_kv_struct("PrefillParams", CPP_TYPES[spec.dtype], CPP_TYPES[spec.kv_dtype],
                                  before_strides=mask, after=v_scale + (POSITION_FIELDS if self.positions else ())
                                  + (ROPE_SCALING_FIELDS if rope_scaled(spec) else ())
                                  + k_scale_fields(spec) + variant_fields(spec))
        return (EntryPoint("prefill", prefill),)
