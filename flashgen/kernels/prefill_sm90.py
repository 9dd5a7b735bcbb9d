"""The Hopper prefill family (op ``prefill_sm90``): TMA + wgmma, a producer and two consumer warpgroups (sm_90a).

Scope (``check`` raises ``SpecError`` for the rest): fp16 / bf16 with ``kv_dtype == dtype`` or an fp8 ``kv_dtype``
(e4m3, e5m2: ragged or TMA-loaded pages, no gathered page size, RoPE or variant; ``sm90_kv8_stages``), ``head_dim ==
head_dim_vo`` in {64, 128, 256}, ``Ragged()`` KV or ``Paged(page_size)`` NHD / HND at any page size: TMA loads
a page per box where pages are multiples of 8 that divide the KV tile or are divided by it (8 ... 256 and beyond
at d <= 128), the K and V producer warps gather other page sizes row by row with cp.async (``sm90_gather``),
``NoMask()``, ``Causal()``, ``SlidingWindow()`` or ``CustomMask()`` (planned tile lists: fully masked KV tiles
are skipped, fully visible ones run without the element mask), no positional encoding, ``ALiBi()`` or
``RoPE(k_rotated=True)`` (the cache holds rotated K: q turns in shared memory, Llama-3.1 / YaRN scaling included;
RoPE over unrotated K runs as the ``rope_gather`` pre-pass and this kernel over its output), soft-cap, any GQA group (packed rows), unsplit
plans (``enable_split=False``: every item covers its whole KV). Option ``positions`` (bool, as the portable
prefill's): keys and queries at explicit true positions (``kv_page_pos``, ``q_pos`` params after the others;
``family.positions_option``), not with a custom mask; the uri ends in ``_pos``.
A variant with a ``mask`` hook (without positions or a custom mask: ``sm90_tile_lists``) takes each work item's KV
tiles from a list, so the prefill skips empty tiles and runs full ones without the mask hook: by the ``mask_tile``
predicate, written in the kernel by its producer warp 3 ahead of the scheduler, else by the mask hook itself over
each tile's pairs in a pre-pass over the same params, a second entry point ``prefill_sm90_tiles``
(``sm90_tile_prepass``; ``Variant(..., classify_tiles=False)`` turns the lists off).
The kernel is ``templates/include/flashgen/sm90/kernel.cuh`` (its parts by role beside it); the runner
``flashgen.api.sm90``. Its two consumer warpgroups always take turns issuing their GEMMs (the ping-pong;
``PINGPONG`` stays a template constant, always true).
"""

from __future__ import annotations

from ..spec import ALiBi, AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, RoPE, SlidingWindow, SpecError
from .builtins import builtin_flags
from .family import (POSITION_FIELDS, ROPE_FIELDS, ROPE_SCALING_FIELDS, AttentionFamily, EntryPoint, LaunchConfig,
                     positions_option, rope_scaled, struct, variant_fields)
from .prefill import CPP_TYPES, KV_BYTES  # fp16 / bf16 (and fp8 K/V), as the portable prefill

SM90_HEAD_DIMS = (64, 128, 256)
TILE_Q = 128  # two consumer warpgroups of 64 packed rows
STAGES = 2
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128 x 40 + 256 x 232 = 64512 <= 65536 registers of an SM
# gathered pages up to head_dim 128: the K/V warps hold 8 row addresses ahead of their copies (GATHER_BATCH) in
# 56 registers, the consumers keep 224 (128 x 56 + 256 x 224); at head_dim 256 the consumers spill at 224, so 4
# addresses ahead in the plain split (8 spilled 8-24 bytes in 40 producer registers)
GATHER_PRODUCER_REGS, GATHER_CONSUMER_REGS = 56, 224
THREADS = 384
O_WARP_ROWS = 16  # packed rows of a consumer warp: one TMA store box of O
SMEM_LIMIT = 227 * 1024
TILE_HOOK_THREADS = 256  # the tile-list pre-pass by the mask hook: a CTA a work item (tile_lists.cuh TILE_HOOK_WARPS)


def sm90_registers(head_dim: int, gathered: bool, fp8: bool = False) -> tuple[int, int, int]:
    """``(PRODUCER_REGS, CONSUMER_REGS, GATHER_BATCH)`` of a variant: the warpgroups' register split and how many
    row addresses a gathering K/V warp reads ahead of its copies. fp8 K/V up to head_dim 128 take the gathered
    split too: the converting K/V warps keep ``sm90_kv8_ahead`` chunk loads in flight (4 registers each)."""
    if (gathered or fp8) and head_dim <= 128:
        return GATHER_PRODUCER_REGS, GATHER_CONSUMER_REGS, 8 if gathered else 4
    return PRODUCER_REGS, CONSUMER_REGS, 4


def sm90_kv8_ahead(head_dim: int) -> int:
    """fp8 K/V: the 16-byte chunk loads a converting lane keeps in flight ahead of the chunk it converts
    (``KV8_AHEAD``, sm90/fp8.cuh ``convert_tile``).

    A chunk is 11 instructions (a shared load, 8 conversions, 2 stores), ~11-19 clk of issue against ~30 clk of
    shared-load latency: 2-3 loads ahead hide it. head_dim <= 128 (56 producer registers): 3, 12 registers of
    loads; head_dim 256 (40 registers, the consumers need 232): 0, a chunk loaded, converted and stored in turn.
    """
    return 3 if sm90_registers(head_dim, False, fp8=True)[0] >= GATHER_PRODUCER_REGS else 0


def sm90_tile_kv(head_dim: int) -> int:
    """KV tokens per stage: the S tile (TILE_KV / 2 fp32 a thread) beside O (head_dim / 2) within the consumer
    budget, and Q plus 2 stages of K and V within 227 KB.

    Worked example: head_dim 128: S 64 + O 64 + P 32 registers; Q 32 KB + 2 x (32 + 32) KB = 160 KB -> 128.
    head_dim 256: O takes 128 registers, and 128-token stages would need Q 64 KB + 2 x 128 KB = 320 KB -> 64
    (S 32, smem 64 + 2 x 64 = 192 KB). head_dim 64: Q 16 KB + 2 x 32 KB = 80 KB -> 128.
    """
    return 64 if head_dim > 128 else 128


def sm90_gather(page_size: int, head_dim: int) -> bool:
    """Whether paged KV of ``page_size`` is gathered row by row (cp.async) rather than loaded a page per TMA box.

    A box must land on whole 8-row 128B-swizzle atoms and never straddle a page: page sizes that are multiples
    of 8 and divide the KV tile or are divided by it. At head_dim 128 (tile 128): 8, 16, 32, 64, 128, 256, 384
    ... by TMA; 1, 5, 12, 24, 48, 96 gathered.
    """
    tile = sm90_tile_kv(head_dim)
    return page_size % 8 != 0 or (tile % page_size != 0 and page_size % tile != 0)


SMEM_FIXED = 256 + 512 + 1024  # barriers, the 4 Work slots, slack to align the dynamic base up to 1024


def _smem(head_dim: int, q_buffers: int, elem: int, gather: bool = False, kv8: int = 0) -> int:
    """Q tiles + STAGES K and V stages + SMEM_FIXED (+ a gathered cache's row offsets: one KV tile of int64 for
    each of the K and V warps; + fp8 K/V's ``kv8`` TMA staging stages of K and of V, one byte an element)."""
    tile = sm90_tile_kv(head_dim)
    return (q_buffers * TILE_Q * head_dim * elem + 2 * STAGES * tile * head_dim * elem + SMEM_FIXED
            + (2 * tile * 8 if gather else 0) + 2 * kv8 * tile * head_dim)


def sm90_q_buffers(head_dim: int, elem: int = 2) -> int:
    """Two Q tiles where they fit beside the KV stages (the next item's Q loads while this one runs), else one.

    head_dim 128: 2 x 32 KB + 2 x (32 + 32) KB = 192 KB -> 2; head_dim 256: 2 x 64 + 2 x (32 + 32) = 256 KB -> 1.
    """
    return 2 if _smem(head_dim, 2, elem, gather=True) <= SMEM_LIMIT else 1


def sm90_o_stage_bytes(head_dim: int, elem: int = 2) -> int:
    """Shared memory of the staged epilogue: each consumer warp's 16 O rows as the box of its TMA stores lies in
    shared memory (``write_rows`` in the kernel: per 64-column block 16 rows of 128 bytes, 128B-swizzled, which
    stmatrix writes without bank conflicts), 8 warps. head_dim 128: 8 x 16 x 256 = 32768 bytes."""
    return 8 * 16 * head_dim * elem


def sm90_kv8_stages(head_dim: int) -> int:
    """fp8 K/V: the TMA staging stages of K and of V (the producer warp converts one while the next loads), two
    where they fit beside the Q buffers and the 16-bit stages, else one (its load then issued as soon as the
    previous tile is converted, a tile ahead of the consumers); they come before the O staging.

    head_dim 64: 96 KB + 2 x 2 x 8 KB -> 2; head_dim 128: 192 KB + 2 x 2 x 16 KB = 256 KB -> 1 (224 KB); head_dim
    256 (one Q buffer, 64-token tiles): 192 KB + 2 x 2 x 16 KB -> 1.
    """
    return 2 if _smem(head_dim, sm90_q_buffers(head_dim), 2, kv8=2) <= SMEM_LIMIT else 1


def sm90_o_staged(head_dim: int, gather: bool, elem: int = 2, kv8: int = 0) -> bool:
    """Whether the epilogue may stage O in shared memory and store it by TMA (the kernel then does so for a
    warp's rows inside the request where the GQA group divides 16; else, and where this is False, it stores
    straight from registers): where the staging fits beside the Q buffers and KV stages, never at the cost of a
    Q buffer.

    head_dim 128: 192 KB + 1.75 KB + 32 KB = 225.75 KB <= 227 KB -> staged; a gathered cache's 2 KB of row
    offsets push it to 227.75 KB -> not; head_dim 256 (64 KB of staging) -> not; head_dim 64 -> staged; fp8 K/V
    (``kv8`` staging stages): head_dim 128: 224 KB + 1.75 KB -> not; head_dim 64 -> staged.
    """
    return (_smem(head_dim, sm90_q_buffers(head_dim, elem), elem, gather, kv8) + sm90_o_stage_bytes(head_dim, elem)
            <= SMEM_LIMIT)


def sm90_tile_lists(spec: AttentionSpec, positions: bool = False) -> bool:
    """Whether the kernel of ``spec`` takes its items' KV tiles from lists that its pre-pass writes: by the
    variant's tile predicate (``mask_tile``), or, for a mask hook without one, by the mask hook itself evaluated
    over each tile's pairs (unless ``variant.classify_tiles`` is off). Not with explicit positions (keys need not
    be contiguous) nor with a custom mask (whose lists the host plans; a predicate then only spares the mask
    hook)."""
    variant = spec.variant
    return (variant is not None and variant.mask is not None and not positions
            and (variant.mask_tile is not None or variant.classify_tiles)
            and not isinstance(spec.mask, CustomMask))


def sm90_tile_heads(spec: AttentionSpec) -> bool:
    """Whether the tile-list pre-pass of ``spec`` (``sm90_tile_lists``) classifies each kv head's tiles on their
    own: with a tile predicate (which is given the heads), or a mask hook whose text names ``qo_head`` or
    ``kv_head``. Otherwise one CTA an item classifies kv head 0's tiles over the item's distinct query tokens
    (a GQA group's rows of one token get the same answer) and writes the list for every kv head: the pre-pass
    then evaluates ``1 / (num_kv_heads * group)`` of the pairs (``TILE_HEADS``; its grid, api/sm90.py)."""
    variant = spec.variant
    return variant.mask_tile is not None or variant.uses("mask", "qo_head") or variant.uses("mask", "kv_head")


def sm90_tile_prepass(spec: AttentionSpec, positions: bool = False) -> bool:
    """Whether the tile lists of ``spec`` (``sm90_tile_lists``) come from a pre-pass kernel, ``prefill_sm90_tiles``
    (a CTA of ``TILE_HOOK_THREADS`` a work item): for a mask hook without a tile predicate, classified by the hook
    over each tile's pairs. A predicate's lists are written in the prefill itself, by its producer warp 3 a few
    items ahead of the scheduler (``sm90/tile_lists.cuh`` ``produce_lists``): no second launch."""
    return sm90_tile_lists(spec, positions) and spec.variant.mask_tile is None


def sm90_uniform_wg(head_dim: int) -> bool:
    """Whether the kernel takes its warpgroup index through a shuffle from lane 0, so that the compiler keeps it
    and the wgmma descriptors derived from it in uniform registers (~100 fewer SASS a KV tile). At head_dim 256
    the consumers' O takes 128 registers and the uniform copies spilled 16 bytes (custom mask), so not there."""
    return head_dim <= 128


def sm90_qo_tma(group: int, o_staged: bool) -> tuple[bool, bool]:
    """``(q_tma, o_tma)`` of a plan (the kernel's params of those names): Q by 3-D TMA boxes where an item's
    TILE_Q packed rows are whole tokens times the GQA group's heads (the group divides TILE_Q), else by cp.async;
    O by TMA stores where a consumer warp's 16 rows are (the group divides 16) in a variant that stages O
    (``sm90_o_staged``), else from registers.

    >>> [sm90_qo_tma(g, True) for g in (1, 4, 7, 32)]
    [(True, True), (True, True), (False, False), (True, False)]
    """
    return TILE_Q % group == 0, o_staged and O_WARP_ROWS % group == 0


def sm90_smem_bytes(head_dim: int, elem: int = 2, gather: bool = False, kv8: int = 0) -> int:
    """The dynamic shared memory of a CTA (see ``_smem``, plus the O staging where ``sm90_o_staged``); ``gather``:
    a gathered paged cache (``sm90_gather``); ``kv8``: fp8 K/V's staging stages (``sm90_kv8_stages``)."""
    stage = sm90_o_stage_bytes(head_dim, elem) if sm90_o_staged(head_dim, gather, elem, kv8) else 0
    return _smem(head_dim, sm90_q_buffers(head_dim, elem), elem, gather, kv8) + stage


class PrefillSM90Family(AttentionFamily):
    op = "prefill_sm90"
    template = "prefill_sm90.cu.j2"
    variants = True
    # a k_transform runs in the rope_gather pre-pass, once an element (backends.kernels_for: the kernel then
    # reads its ragged scratch); in the kernel every q tile reading a key would run it again
    load_transforms = ("q_transform",)

    def refuse_transform(self, name: str) -> str:
        return (f"variant.{name}: the sm90 kernel runs no {name[0]} transform itself; the sm90 backend runs it in "
                "the rope_gather pre-pass (flashgen.api.backends.kernels_for)")

    def __init__(self, positions: bool = False):
        self.positions = positions
        self.options = (("positions", "true"),) if positions else ()

    def configure(self, options: dict) -> "PrefillSM90Family":
        unknown = set(options) - {"positions"}
        if unknown:
            raise SpecError(f"kernel_options: got {sorted(unknown)}, prefill_sm90 takes 'positions' (True or False)")
        return PrefillSM90Family(positions_option(self.op, options))

    def uri(self, spec: AttentionSpec) -> str:
        return f"{self.op}_{spec.uri}{'_pos' if self.positions else ''}"

    def check(self, spec: AttentionSpec) -> None:
        if spec.head_dim not in SM90_HEAD_DIMS or spec.head_dim_vo != spec.head_dim:
            raise SpecError(f"head_dim: got {spec.head_dim} (head_dim_vo {spec.head_dim_vo}), prefill_sm90 supports "
                            f"head_dim == head_dim_vo in {SM90_HEAD_DIMS}")
        fp8 = KV_BYTES.get(spec.kv_dtype) == 1
        if spec.dtype not in ("float16", "bfloat16") or (spec.kv_dtype != spec.dtype and not fp8):
            raise SpecError(f"kv_dtype: got dtype {spec.dtype} / kv_dtype {spec.kv_dtype}, prefill_sm90 supports "
                            "float16 or bfloat16 with kv_dtype == dtype, float8_e4m3fn or float8_e5m2")
        layout = spec.kv_layout
        if not isinstance(layout, (Ragged, Paged)):
            raise SpecError(f"kv_layout: got {layout!r}, prefill_sm90 supports Ragged() or Paged(page_size)")
        if fp8:
            _check_fp8(spec)
        if not isinstance(spec.mask, (NoMask, Causal, SlidingWindow, CustomMask)):
            raise SpecError(f"mask: got {spec.mask!r}, prefill_sm90 supports NoMask(), Causal(), SlidingWindow() or "
                            "CustomMask()")
        rope = spec.pos_encoding
        if isinstance(rope, RoPE) and not rope.k_rotated:
            raise SpecError(f"pos_encoding: got {rope!r}; prefill_sm90 turns q alone (RoPE(k_rotated=True): the cache "
                            "holds rotated K); the sm90 backend turns unrotated K in its rope_gather pre-pass "
                            "(flashgen.api.backends.kernels_for)")
        if rope is not None and not isinstance(rope, (ALiBi, RoPE)):
            raise SpecError(f"pos_encoding: got {rope!r}, prefill_sm90 supports None, ALiBi() or "
                            "RoPE(k_rotated=True)")
        if self.positions and isinstance(spec.mask, CustomMask):
            raise SpecError("mask: CustomMask() takes no explicit positions (kernel_options['positions']): its bits "
                            "are indexed by (query, key) places, not positions")

    def context(self, spec: AttentionSpec) -> dict:
        d = spec.head_dim
        paged = isinstance(spec.kv_layout, Paged)
        kv8 = _kv8(spec)
        smem = sm90_smem_bytes(d, gather=_gathered(spec), kv8=kv8)
        assert smem <= SMEM_LIMIT, (d, smem)
        regs = sm90_registers(d, _gathered(spec), fp8=kv8 > 0)
        return {
            "DTypeQ": CPP_TYPES[spec.dtype],
            "DTypeKV": CPP_TYPES[spec.kv_dtype],
            "DTypeMMA": "__half" if kv8 else CPP_TYPES[spec.dtype],  # fp8 K/V: the GEMMs in fp16 (sm90/fp8.cuh)
            "DTypeO": CPP_TYPES[spec.dtype],
            "HEAD_DIM": d,
            "TILE_Q": TILE_Q,
            "TILE_KV": sm90_tile_kv(d),
            "STAGES": STAGES,
            "KV8_STAGES": kv8,
            "KV8_AHEAD": sm90_kv8_ahead(d) if kv8 else 0,
            "Q_BUFFERS": sm90_q_buffers(d),
            "SMEM_BYTES": smem,
            "PRODUCER_REGS": regs[0],
            "CONSUMER_REGS": regs[1],
            "GATHER_BATCH": regs[2],
            "THREADS": THREADS,
            **builtin_flags(spec),  # CAUSAL, WINDOW, CUSTOM_MASK, ALIBI, SOFT_CAP: the built-in hooks
            "ROPE": "true" if isinstance(spec.pos_encoding, RoPE) else "false",
            "ROPE_SCALING": "true" if rope_scaled(spec) else "false",
            "PAGED": "true" if paged else "false",
            "PAGE_SIZE": spec.kv_layout.page_size if paged else 0,
            "HND": "true" if paged and spec.kv_layout.order == "HND" else "false",
            "GATHER": "true" if _gathered(spec) else "false",
            "O_STAGED": "true" if sm90_o_staged(d, _gathered(spec), kv8=kv8) else "false",
            "UNIFORM_WG": "true" if sm90_uniform_wg(d) else "false",
            "PINGPONG": "true",
            "POSITIONS": "true" if self.positions else "false",
            "TILE_LIST": "true" if sm90_tile_lists(spec, self.positions) else "false",
            "TILE_PREPASS": "true" if sm90_tile_prepass(spec, self.positions) else "false",
            "TILE_LIST_THREADS": TILE_HOOK_THREADS,
            "TILE_HEADS": "true" if sm90_tile_lists(spec, self.positions) and sm90_tile_heads(spec) else "false",
        }

    def launch(self, spec: AttentionSpec) -> LaunchConfig:
        """One persistent CTA an SM (the grid is at most ``num_sms``), a producer and two consumer warpgroups."""
        d, gather, kv8 = spec.head_dim, _gathered(spec), _kv8(spec)
        return LaunchConfig(block=(THREADS, 1, 1), smem_bytes=sm90_smem_bytes(d, gather=gather, kv8=kv8),
                            tile_q=TILE_Q, tile_kv=sm90_tile_kv(d), ctas_per_sm=1, stages=STAGES, gather=gather,
                            o_staged=sm90_o_staged(d, gather, kv8=kv8))

    def entry_points(self, spec: AttentionSpec) -> tuple[EntryPoint, ...]:
        q = CPP_TYPES[spec.dtype]
        i32 = "const int32_t*"
        # q and o as 3-D TMA descriptors (qo_tensor_map; o only where the epilogue stages O), first: 128-byte
        # aligned, as the K and V descriptors after them, or for a gathered cache its base pointers and element
        # strides (KVView)
        staged = sm90_o_staged(spec.head_dim, _gathered(spec), kv8=_kv8(spec))
        maps = (("CUtensorMap", "tma_q"),) + ((("CUtensorMap", "tma_o"),) if staged else ())
        kv = ((f"const {q}*", "k"), (f"const {q}*", "v"), ("int64_t", "stride_page"), ("int64_t", "stride_token"),
              ("int64_t", "stride_head")) if _gathered(spec) else (("CUtensorMap", "tma_k"), ("CUtensorMap", "tma_v"))
        params = struct(
            "PrefillSM90Params", *maps, *kv,
            (f"const {q}*", "q"), (f"{q}*", "o"), ("float*", "lse"),
            (i32, "qo_indptr"), (i32, "kv_indptr"), (i32, "kv_len"), (i32, "request_idx"), (i32, "qo_tile_idx"),
            (i32, "kv_start"), (i32, "kv_end"), (i32, "kv_indices"), (i32, "block_table"),
            # the GQA group and its fast divider (FastDiv, api/fastdiv.py): packed row -> (token, q head)
            ("int32_t", "num_qo_heads"), ("int32_t", "group_size"), ("uint32_t", "group_magic"),
            ("int32_t", "group_shift"),
            # Q by tma_q where the group divides TILE_Q, O by tma_o where it divides 16 (sm90_qo_tma), else by
            # cp.async and from registers
            ("int32_t", "q_tma"), ("int32_t", "o_tma"), ("float", "sm_scale"),
            ("int32_t", "num_items"), ("int32_t", "num_kv_heads"), ("int32_t", "block_table_stride"),
            ("int32_t", "window_left"), ("float", "soft_cap"),
            # custom mask: the bits, each request's bit offset into them, each item's tile list (entries
            # tiles[tile_indptr[item] ..]: tile << 2 | kind); a tile predicate's lists (sm90_tile_lists): per
            # (item, kv head), written by the pre-pass (tile_list_of in sm90/tile_scheduler.cuh); null otherwise
            ("const uint8_t*", "custom_mask"), ("const int64_t*", "mask_offset"), (i32, "tile_indptr"), (i32, "tiles"),
            *(POSITION_FIELDS if self.positions else ()), *variant_fields(spec),
            *((("float", "v_scale"),) if _kv8(spec) else ()),  # fp8 V's per-tensor scale, applied to the output
            *(ROPE_FIELDS + (ROPE_SCALING_FIELDS if rope_scaled(spec) else ())  # q's rotation
              if isinstance(spec.pos_encoding, RoPE) else ()),
        )
        tiles = (EntryPoint("prefill_sm90_tiles", params),) if sm90_tile_prepass(spec, self.positions) else ()
        return (EntryPoint("prefill_sm90", params),) + tiles



def _gathered(spec: AttentionSpec) -> bool:
    return isinstance(spec.kv_layout, Paged) and sm90_gather(spec.kv_layout.page_size, spec.head_dim)


def _kv8(spec: AttentionSpec) -> int:
    """fp8 K/V's TMA staging stages (``sm90_kv8_stages``), 0 for a 16-bit cache."""
    return sm90_kv8_stages(spec.head_dim) if KV_BYTES.get(spec.kv_dtype) == 1 else 0


def _check_fp8(spec: AttentionSpec) -> None:
    """What fp8 K/V take on Hopper: TMA loads (ragged, or pages a box takes), no RoPE pre-pass, no variant."""
    if _gathered(spec):
        raise SpecError(f"kv_dtype: {spec.kv_dtype} K/V on prefill_sm90 need TMA-loaded pages (a multiple of 8 that "
                        f"divides the KV tile of {sm90_tile_kv(spec.head_dim)} tokens or is divided by it) or "
                        f"Ragged(), got {spec.kv_layout!r}")
    if isinstance(spec.pos_encoding, RoPE):
        raise SpecError(f"kv_dtype: {spec.kv_dtype} K/V on prefill_sm90 take no RoPE (the sm90 backend's rope_gather "
                        "pre-pass dequantises them first, outside CUDA graphs, and the kernel of its ragged twin turns "
                        "q)")
    if spec.variant is not None:
        raise SpecError(f"kv_dtype: {spec.kv_dtype} K/V on prefill_sm90 take no variant hooks (fp16 or bf16 K/V do)")

