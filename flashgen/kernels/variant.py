"""Render a ``Variant``'s hooks as CUDA device functions, one contract for every kernel family.

``render_variant`` emits, in ``namespace flashgen_variant``: ``struct VariantParams`` (a
``flashgen::variant::Tensor<T, RANK>`` per declared tensor, a value per scalar), ``constexpr bool HAS_<HOOK>`` for
every hook and ``SOFTMAX``, and one ``__device__ __forceinline__`` function per given hook with the fixed
signature ``hook(const VariantParams& params, <the hook's inputs>)``. Each body is preceded by
``#line 1 "variant.<hook>"`` so that an nvcc error in a hook names the hook and its own line; after it a
``#line`` directive returns the numbering to ``source_name`` at the physical line that follows. Last comes
``struct Hooks``: the kernels' view of the variant (the flags of ``flashgen::variant::NoHooks``, ``ANY``, ``HEAVY``
(``heavy_pair_hooks``), ``DISTANCE`` (whether a pair hook reads ``distance``: the kernels compute it only then), and a
static member per given hook), named by a kernel's config as ``using Variant = flashgen_variant::Hooks``.

``variant_layout`` is the host's view of ``VariantParams``: a ``ParamsLayout`` whose fields flatten it (a tensor's
``data`` pointer and one int64 element stride a dimension, then each scalar), with the same offsets, so that
``run()`` packs a variant's arguments with one ``pack_into`` at the offset of the kernel params' ``variant`` field.
"""

from __future__ import annotations

from ..spec import HOOKS, Variant
from ..spec.variant import C_DTYPES, hook_tokens
from .params import Param, ParamsLayout

_C_INPUT = {"int": "int", "float": "float"}
_C_RETURN = {"bool": "bool", "int": "int", "float": "float"}
_SCALAR_C = {"int32": "int32_t", "int64": "int64_t", "float32": "float"}
VARIANT_FIELD = "variant"  # the kernel params' field holding VariantParams
VARIANT_CTYPE = "flashgen_variant::VariantParams"

# What a call or a float division adds to a hook's machine code, in instructions (sm_90a, nvcc 13.0, -O3): an
# accurate logf is a range reduction and a polynomial of ~20 FFMAs, a division by a value not a power of 2 a
# Newton step, a check and a call to its slow path. Arithmetic and loads count nothing: the cost that matters is
# the code a call inlines at every pair the kernel unrolls (T5's bucket: two logf, of which one folds, and a
# division: 73 instructions a pair at sm_90a).
_CALL_WEIGHT = {
    "logf": 24, "log2f": 24, "log10f": 24, "log1pf": 24, "expf": 12, "exp2f": 8, "expm1f": 16, "powf": 48,
    "fg_pow": 48, "tanhf": 24, "sinf": 24, "cosf": 24, "tanf": 32, "atanf": 24, "atan2f": 32, "erff": 24,
    "sqrtf": 8, "fg_floordiv": 12, "/": 12,
}
HEAVY_HOOK_WEIGHT = 32  # a pair hook at least this heavy is instantiated at as few sites a tile as a kernel can


def hook_weight(body: str) -> int:
    """The estimated instructions a hook body's calls and divisions inline (``_CALL_WEIGHT``), e.g. 12 for
    ``return logit / scale;``, 144 for T5's traced bucket (its expression spells ``logf`` four times)."""
    return sum(_CALL_WEIGHT.get(tok, 0) for tok in hook_tokens(body))


def heavy_pair_hooks(variant: Variant | None) -> bool:
    """Whether the pair hooks (``score`` and ``mask``) weigh ``HEAVY_HOOK_WEIGHT`` or more together: a kernel then
    runs them from one site a tile where it has two (the Hopper prefill: the tiles inside the item and its last
    one), at the cost of a clamp a pair (see sm90/softmax.cuh). T5's bias is heavy; ALiBi, sigmoid, the
    document and tree masks are not."""
    if variant is None:
        return False
    return sum(hook_weight(h.body) for h in (variant.score, variant.mask) if h is not None) >= HEAVY_HOOK_WEIGHT


def reads_distance(variant: Variant | None) -> bool:
    """Whether a pair hook (``score``, ``mask``) reads its ``distance`` input, which the kernels then compute (as a
    row's part plus a key's, see common/variant.cuh); a variant that does not read it keeps its code as it was."""
    return variant is not None and (variant.uses("score", "distance") or variant.uses("mask", "distance"))


def variant_layout(variant: Variant) -> ParamsLayout:
    """``VariantParams`` as the host packs it: per tensor ``<name>.data`` (a pointer) and ``<name>.stride<i>``
    (int64, in elements), then per scalar ``<name>``; ``unused_`` (int32) when nothing is declared."""
    fields = []
    for t in variant.tensors:
        fields.append(Param(f"{t.name}.data", "const void*"))
        fields += [Param(f"{t.name}.stride{i}", "int64_t") for i in range(t.rank)]
    fields += [Param(s.name, _SCALAR_C[s.dtype]) for s in variant.scalars]
    return ParamsLayout.of("VariantParams", tuple(fields) or (Param("unused_", "int32_t"),))


def variant_param(variant: Variant) -> Param:
    """The kernel params' field that holds ``VariantParams`` (an opaque block of its size and alignment)."""
    layout = variant_layout(variant)
    return Param(VARIANT_FIELD, VARIANT_CTYPE, blob=(layout.size, layout.align))


def hook_signature(name: str) -> str:
    """``float score(const VariantParams& params, float logit, int batch, ...)``."""
    sig = HOOKS[name]
    args = ", ".join(f"{_C_INPUT[t]} {n}" for n, t in sig.inputs)
    return f"{_C_RETURN[sig.returns]} {name}(const VariantParams& params, {args})"


def render_variant(variant: Variant, source_name: str = "kernel.cu", first_line: int = 1) -> str:
    """The device code of ``variant`` (see the module docstring); ``first_line`` is the physical line of
    ``source_name`` at which the returned text will start, so that line numbers after each hook stay right.

    Example::

        text = render_variant(Variant(score="return logit * scale;", scalars=[("scale", "float32")]))
        # ... __device__ __forceinline__ float score(const VariantParams& params, float logit, int batch, ...
    """
    if not isinstance(variant, Variant):
        raise TypeError(f"variant: got {type(variant).__name__}, expected Variant")
    lines = [
        f"// variant {variant.uri}: {', '.join(h.name for h in variant.hooks)}",
        "#include <flashgen/common/variant.cuh>",
        "namespace flashgen_variant {",
        "using flashgen::variant::TILE_EMPTY;",
        "using flashgen::variant::TILE_PARTIAL;",
        "using flashgen::variant::TILE_FULL;",
        "struct VariantParams {",
        *(f"  flashgen::variant::Tensor<{C_DTYPES[t.dtype]}, {t.rank}> {t.name};" for t in variant.tensors),
        *(f"  {_SCALAR_C[s.dtype]} {s.name};" for s in variant.scalars),
        *(["  int unused_;"] if not (variant.tensors or variant.scalars) else []),
        "};",
        *(f"constexpr bool HAS_{name.upper()} = {'true' if getattr(variant, name) else 'false'};" for name in HOOKS),
        f"constexpr bool SOFTMAX = {'true' if variant.softmax else 'false'};",
    ]
    aliases = [f"  [[maybe_unused]] const auto& {d.name} = params.{d.name};"
               for d in (*variant.tensors, *variant.scalars)]
    for hook in variant.hooks:
        lines += [f"__device__ __forceinline__ {hook_signature(hook.name)} {{", *aliases,
                  f'#line 1 "variant.{hook.name}"', *hook.body.split("\n")]
        lines.append(f'#line {first_line + len(lines) + 1} "{source_name}"')
        lines.append("}")
    layout = variant_layout(variant)
    lines += [
        f"static_assert(sizeof(VariantParams) == {layout.size} && alignof(VariantParams) == {layout.align}, "
        '"host/device layout of VariantParams");',
        "struct Hooks {",
        "  static constexpr bool ANY = true, SOFTMAX = flashgen_variant::SOFTMAX;",
        f"  static constexpr bool HEAVY = {'true' if heavy_pair_hooks(variant) else 'false'};",
        f"  static constexpr bool DISTANCE = {'true' if reads_distance(variant) else 'false'};",
        *(f"  static constexpr bool {name.upper()} = HAS_{name.upper()};" for name in HOOKS),
    ]
    for hook in variant.hooks:
        sig = HOOKS[hook.name]
        args = ", ".join(n for n, _ in sig.inputs)
        lines += [f"  static __device__ __forceinline__ {hook_signature(hook.name)} {{",
                  f"    return flashgen_variant::{hook.name}(params, {args});", "  }"]
    lines.append("};")
    lines.append("}  // namespace flashgen_variant")
    return "\n".join(lines) + "\n"
