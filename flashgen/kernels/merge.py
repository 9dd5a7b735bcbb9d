"""The merge-state family: merge_state (two states, also in place), merge_states (along a dimension) and
merge_states_in_place (a state and a stack of others merged into it)."""

from __future__ import annotations

from ..spec import AttentionSpec, MergeSpec
from .family import EntryPoint, KernelFamily, LaunchConfig, struct

CPP_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
BLOCK_THREADS = 256


class MergeStatesFamily(KernelFamily):
    op = "merge_states"
    template = "merge_states.cu.j2"

    def project(self, spec: object) -> MergeSpec:
        # an attention spec merges its partials in fp32 (what split-KV writes); a MergeSpec is taken as is
        if isinstance(spec, AttentionSpec):
            return MergeSpec("float32")
        if not isinstance(spec, MergeSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected MergeSpec or AttentionSpec")
        return spec

    def context(self, spec: MergeSpec) -> dict:
        return {"DTypeV": CPP_TYPES[spec.dtype], "BLOCK_THREADS": BLOCK_THREADS}

    def launch(self, spec: MergeSpec) -> LaunchConfig:
        """Every entry point: ``BLOCK_THREADS`` threads, rows spread over lane groups (``api/merge.py``)."""
        return LaunchConfig(block=(BLOCK_THREADS, 1, 1))

    def entry_points(self, spec: MergeSpec) -> tuple[EntryPoint, ...]:
        v = CPP_TYPES[spec.dtype]
        pair = struct(
            "MergeStateParams",
            (f"const {v}*", "v_a"), ("const float*", "s_a"),
            (f"const {v}*", "v_b"), ("const float*", "s_b"),
            (f"{v}*", "v_out"), ("float*", "s_out"),
            ("const uint8_t*", "mask"),
            ("int64_t", "num_rows"), ("int32_t", "num_heads"), ("int32_t", "head_dim"),
            ("int32_t", "threads_per_row"),
        )
        many = struct(
            "MergeStatesParams",
            (f"const {v}*", "v"), ("const float*", "s"),
            (f"{v}*", "v_out"), ("float*", "s_out"),
            ("int64_t", "num_tokens"), ("int32_t", "num_states"), ("int32_t", "num_heads"),
            ("int32_t", "head_dim"), ("int32_t", "threads_per_row"),
        )
        into = struct(
            "MergeStatesInPlaceParams",
            (f"{v}*", "v"), ("float*", "s"),
            (f"const {v}*", "v_parts"), ("const float*", "s_parts"),
            ("int64_t", "num_rows"), ("int32_t", "num_states"), ("int32_t", "head_dim"),
            ("int32_t", "threads_per_row"),
        )
        return (EntryPoint("merge_state", pair), EntryPoint("merge_states", many),
                EntryPoint("merge_states_in_place", into))
