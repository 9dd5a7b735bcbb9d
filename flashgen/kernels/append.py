"""The KV-cache write (op ``append``): new tokens' K/V into their pages, RoPE on K and fp8 quantisation on the way
(``templates/include/flashgen/append/append_kv.cuh``).

Floor: the bytes moved over the copy rate. A row (token, kv head) reads ``2 * head_dim * sizeof(dtype)`` bytes of
K and V and writes ``2 * head_dim * sizeof(kv_dtype)``; the per-token indices add 4-16 bytes a token. Llama-3-8B
shapes (8 kv heads, d=128), bf16 -> bf16: 8 KiB a token (4 KiB read, 4 KiB written); at ~4.3 TB/s a 4096-token
prefill chunk (33.6 MB) takes ~7.8 µs, a 64- or 256-token decode step (0.5 / 2.1 MB) 0.12 / 0.49 µs, under the
~3-5 µs a launch costs, so small appends are launch-bound. bf16 -> fp8 moves 6 KiB a token (~5.9 µs at 4096).
"""

from __future__ import annotations

from ..spec import AppendSpec
from .family import EntryPoint, KernelFamily, LaunchConfig, struct

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float8_e4m3fn": "__nv_fp8_e4m3",
             "float8_e5m2": "__nv_fp8_e5m2"}
INDEX_TYPES = {"int32": "int32_t", "int64": "int64_t"}
ITEM_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
CTA_THREADS = 128  # at most; a CTA holds whole rows


def _flag(value: bool) -> str:
    return "true" if value else "false"


def threads_per_row(spec: AppendSpec) -> int:
    """Threads a (token, kv head) row: each owns 16 bytes of the cache's dtype in each half of the row (bf16,
    d=128: 8 elements, so 8 threads; fp8: 16 elements, 4 threads)."""
    return spec.head_dim // 2 // (16 // ITEM_BYTES[spec.kv_dtype])


def rows_per_block(spec: AppendSpec) -> int:
    """(token, kv head) rows a CTA writes: the grid is ``ceil(tokens * kv_heads / rows_per_block)`` (d=128: 16
    rows of 8 threads, or 32 of 4 for fp8; d=192 with fp8: 21 rows of 6 threads, 126 threads)."""
    return CTA_THREADS // threads_per_row(spec)


def block_threads(spec: AppendSpec) -> int:
    return rows_per_block(spec) * threads_per_row(spec)


class AppendFamily(KernelFamily):
    op = "append"
    template = "append.cu.j2"

    def project(self, spec: object) -> AppendSpec:
        if not isinstance(spec, AppendSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected AppendSpec")
        return spec

    def context(self, spec: AppendSpec) -> dict:
        return {
            "DTypeIn": CPP_TYPES[spec.dtype], "DTypeKV": CPP_TYPES[spec.kv_dtype],
            "IdType": INDEX_TYPES[spec.index_dtype], "HEAD_DIM": spec.head_dim,
            "PAGE_SIZE": spec.kv_layout.page_size, "ELEMS": 16 // ITEM_BYTES[spec.kv_dtype],
            "THREADS_PER_ROW": threads_per_row(spec), "BLOCK_THREADS": block_threads(spec),
            "ROPE": _flag(spec.rope != "none"), "ROPE_COS_SIN": _flag(spec.rope == "cos_sin_cache"),
            "QUANTIZE": _flag(spec.quantized), "PER_HEAD_SCALE": _flag(spec.scales == "per_head"),
            "SLOT_MAPPING": _flag(spec.page_table == "slot_mapping"),
        }

    def launch(self, spec: AppendSpec) -> LaunchConfig:
        """``rows_per_block(spec)`` rows a CTA (up to 128 threads), no shared memory."""
        return LaunchConfig(block=(block_threads(spec), 1, 1))

    def entry_points(self, spec: AppendSpec) -> tuple[EntryPoint, ...]:
        t_in, t_kv, idx, i32 = "DTypeIn", "DTypeKV", "IdType", "const int32_t*"
        params = struct(
            "AppendParams",
            (f"const {t_in}*", "k"), (f"const {t_in}*", "v"), (f"{t_kv}*", "k_cache"), (f"{t_kv}*", "v_cache"),
            (f"const {idx}*", "batch_indices"), (f"const {idx}*", "positions"), (f"const {idx}*", "slot_mapping"),
            (i32, "kv_indptr"), (i32, "kv_indices"),
            ("const float*", "k_scales"), ("const float*", "v_scales"), ("const float*", "cos_sin_cache"),
            ("int64_t", "k_stride_token"), ("int64_t", "k_stride_head"),
            ("int64_t", "v_stride_token"), ("int64_t", "v_stride_head"),
            ("int64_t", "stride_page"), ("int64_t", "stride_token"), ("int64_t", "stride_head"),
            ("int64_t", "num_pages"), ("int64_t", "cos_sin_rows"),
            ("int32_t", "num_rows"), ("int32_t", "num_kv_heads"), ("int32_t", "batch_size"),
            ("int32_t", "scale_stride"),
            ("float", "k_rcp_scale"), ("float", "v_rcp_scale"),
            ("float", "rope_rcp_scale"), ("float", "rope_log2_theta"), ("float", "rope_rcp_factor"),
            ("float", "rope_smooth_a"), ("float", "rope_smooth_b"), ("float", "rope_smooth_c"), ("float", "rope_mscale"),
        )
        return (EntryPoint("append_kv", params),)
