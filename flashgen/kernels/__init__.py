"""Kernel families: spec -> template context -> rendered CUDA source, and each family's launch contract.
Imports ``spec`` only.

Every family is registered here, by op name, and nowhere else: ``decode``, ``prefill`` (portable, mma.sync),
``prefill_sm90`` (Hopper, wgmma + TMA), ``rope_gather`` (the Hopper prefill's RoPE pre-pass),
``merge_states`` and ``append`` (the KV-cache write). Code above this package (``jit``, ``api``, ``cli``) uses only the names exported here.
"""

from .append import AppendFamily, rows_per_block
from .decode import APPEND_RUNTIME_FIELDS, DecodeFamily
from .family import (ROPE_SCALING_FIELDS, EntryPoint, KernelFamily, LaunchConfig, dequantises_k, family, launch_config,
                     ops, register)
from .merge import MergeStatesFamily
from .params import BoundParams, Param, ParamsLayout
from .prefill import PrefillFamily
from .prefill_sm90 import (TILE_HOOK_THREADS, PrefillSM90Family, sm90_qo_tma, sm90_tile_heads, sm90_tile_lists,
                           sm90_tile_prepass)
from .render import TemplateError, include_dir, render_template, templates_dir
from .rope_gather import RopeGatherFamily, prepass, prepass_threads, prepass_variant, ragged_twin, rotates
from .variant import VARIANT_FIELD, hook_signature, render_variant, variant_layout

for _family in (DecodeFamily(), PrefillFamily(), PrefillSM90Family(), RopeGatherFamily(), MergeStatesFamily(),
                AppendFamily()):
    register(_family)
del _family

__all__ = [
    "EntryPoint", "KernelFamily", "LaunchConfig", "family", "launch_config", "ops", "register", "BoundParams",
    "Param", "ParamsLayout", "TemplateError", "include_dir", "render_template", "templates_dir", "sm90_qo_tma",
    "sm90_tile_lists", "sm90_tile_heads", "sm90_tile_prepass", "TILE_HOOK_THREADS",
    "ragged_twin", "prepass", "prepass_threads", "prepass_variant", "rotates", "rows_per_block",
    "APPEND_RUNTIME_FIELDS", "ROPE_SCALING_FIELDS", "hook_signature", "render_variant", "variant_layout",
    "VARIANT_FIELD", "dequantises_k",
]
