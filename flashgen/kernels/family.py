"""Kernel families: what an ``op`` name means to the code generator.

A family turns a spec into everything its template needs (the context), names its entry points, declares
each entry point's params struct, and states how its kernel is launched (``launch(spec) -> LaunchConfig``:
block, shared memory, tiles), so that nothing above it re-derives those. ``kernels/__init__.py`` registers
every family by op name; ``render`` and ``build`` look them up here. A family may take options that shape
its kernel (``configure``): they enter its uri, so the kernel key, never an environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AttentionSpec, SpecError
from .params import Param, ParamsLayout
from .render import render_template
from .variant import render_variant, variant_param

SOURCE_NAME = "kernel.cu"  # what nvcc compiles (compile/ninja_build.py SOURCE): #line directives name it


@dataclass(frozen=True)
class LaunchConfig:
    """How a family's kernel is launched, and the tile sizes the planner must use for it.

    ``block``: threads of a CTA; ``smem_bytes``: its dynamic shared memory (set as the function's maximum
    at load); ``tile_q``: packed q rows a CTA tile covers (the planner's ``tile_rows``); ``tile_kv``: KV tokens
    a pipeline stage holds (the planner's ``kv_granularity``); ``ctas_per_sm``: CTAs resident on one SM (the
    planner fills ``num_sms * ctas_per_sm`` slots); ``stages``: pipeline depth. Hopper prefill only:
    ``gather`` (paged K/V gathered row by row, so K/V are passed as addresses and strides, not tensor maps)
    and ``o_staged`` (the params carry an O tensor map).
    """

    block: tuple[int, int, int]
    smem_bytes: int = 0
    tile_q: int = 0
    tile_kv: int = 0
    ctas_per_sm: int = 1
    stages: int = 0
    gather: bool = False
    o_staged: bool = False

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True)
class EntryPoint:
    """An ``extern "C" __global__`` function of a family and the params struct it takes."""

    name: str
    params: ParamsLayout


class KernelFamily:
    """Base class. Subclasses set ``op`` and ``template`` and implement ``context``, ``entry_points`` and
    ``launch`` (``project``, ``check`` and ``configure`` have defaults)."""

    op: str = ""
    template: str = ""
    options: tuple[tuple[str, str], ...] = ()  # what ``configure`` was given, sorted (part of the kernel key)

    def configure(self, options: dict) -> "KernelFamily":
        """This family with kernel-shaping ``options`` (``{"tiles": "kv32"}``); a family that takes none
        refuses any. The options must enter ``uri`` wherever they change the source."""
        raise SpecError(f"kernel_options: {self.op} takes no options, got {dict(options)!r}")

    def project(self, spec: object) -> object:
        """The spec this family compiles: reduce a general spec to the fields the family depends on."""
        return spec

    def check(self, spec: object) -> None:
        """Raise ``SpecError`` for specs this family cannot compile (names the field and why)."""

    def context(self, spec: object) -> dict:
        raise NotImplementedError

    def entry_points(self, spec: object) -> tuple[EntryPoint, ...]:
        raise NotImplementedError

    def launch(self, spec: object) -> LaunchConfig:
        """Block, shared memory and tiles of the kernel of (projected, checked) ``spec``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ shared

    def uri(self, spec: object) -> str:
        return f"{self.op}_{spec.uri}"

    def render(self, spec: object) -> str:
        spec = self.project(spec)
        self.check(spec)
        context = dict(self.context(spec))
        context["uri"] = self.uri(spec)
        entries = self.entry_points(spec)
        structs = {e.params.struct_name: e.params for e in entries}
        context["structs"] = [layout.context() for layout in structs.values()]
        context["entry_points"] = [{"name": e.name, "struct_name": e.params.struct_name} for e in entries]
        variant = getattr(spec, "variant", None)
        context["VARIANT"] = "flashgen_variant::Hooks" if variant is not None else "flashgen::variant::NoHooks"
        context["VARIANT_SOURCE"] = _VARIANT_MARK if variant is not None else ""
        source = render_template(self.template, context, self.uri(spec))
        return source if variant is None else _insert_variant(source, variant)


_VARIANT_MARK = "// flashgen variant hooks"


def _insert_variant(source: str, variant) -> str:
    """``source`` with its variant mark line replaced by ``render_variant``'s text (whose ``#line`` directives
    need the physical line it starts at)."""
    lines = source.split("\n")
    at = lines.index(_VARIANT_MARK)
    lines[at] = render_variant(variant, SOURCE_NAME, first_line=at + 1).rstrip("\n")
    return "\n".join(lines)


def variant_fields(spec: AttentionSpec) -> tuple:
    """The params field of ``spec``'s variant (``VariantParams``, last in the struct), or none."""
    return (variant_param(spec.variant),) if spec.variant is not None else ()


def k_scale_fields(spec: AttentionSpec) -> tuple:
    """``k_scale`` (float) where a k_transform reads fp8 K: the hook sees the dequantised element (the code times
    k_scale), so the host passes k_scale here and leaves it out of sm_scale (api/wrapper.py fp8_scaled)."""
    return (("float", "k_scale"),) if dequantises_k(spec) else ()


def dequantises_k(spec: AttentionSpec) -> bool:
    """Whether ``spec``'s kernel dequantises fp8 K before a k_transform (``k_scale_fields``)."""
    variant = spec.variant
    return variant is not None and variant.k_transform is not None and spec.kv_dtype.startswith("float8")


class AttentionFamily(KernelFamily):
    """A family compiled from an ``AttentionSpec`` (decode, prefill, prefill_sm90): ``project`` refuses
    anything else; subclasses that drop fields call it first. ``variants``: whether the family's kernel runs a
    spec's variant hooks (``flashgen/common/variant.cuh``: one contract for every family); ``load_transforms``:
    which of the hooks ``q_transform`` / ``k_transform`` it runs (``refuse_transform`` says why not)."""

    variants = False
    load_transforms: tuple[str, ...] = ()

    def refuse_transform(self, name: str) -> str:
        """The ``SpecError`` text for a load transform ``name`` this family does not run."""
        return (f"variant.{name}: the {self.op} kernel does not run {name[0]} transforms yet; use the decode or "
                "the portable prefill kernel (backend='portable')")

    def project(self, spec: object) -> AttentionSpec:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: got {type(spec).__name__}, expected AttentionSpec")
        variant = spec.variant
        if variant is not None and not self.variants:  # never compile a kernel that would drop the hooks
            raise SpecError(f"variant: the {self.op} kernel does not run variant hooks yet; got {variant.uri} "
                            "(spec.replace(variant=None) for the plain kernel)")
        for name in ("q_transform", "k_transform"):
            if variant is not None and getattr(variant, name) is not None and name not in self.load_transforms:
                raise SpecError(self.refuse_transform(name))
        return spec


_FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    _FAMILIES[family.op] = family
    return family


def family(op: str, options: dict | None = None) -> KernelFamily:
    """The family registered as ``op``, configured with ``options`` (kernel-shaping choices) when given."""
    if op not in _FAMILIES:
        raise SpecError(f"op: got {op!r}, expected one of {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[op].configure(options) if options else _FAMILIES[op]


def launch_config(spec: object, op: str, options: dict | None = None) -> LaunchConfig:
    """``family(op, options).launch`` of the projected, checked ``spec``: what ``build`` carries on the
    loaded ``Kernel`` as ``launch_config``, available without building (planning, tests)."""
    fam = family(op, options)
    projected = fam.project(spec)
    fam.check(projected)
    return fam.launch(projected)


def ops() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def struct(name: str, *fields: tuple[str, str]) -> ParamsLayout:
    """``struct("MergeParams", ("const float*", "s"), ...)``: a params layout from (ctype, name) pairs (or
    Param objects)."""
    return ParamsLayout.of(name, tuple(f if isinstance(f, Param) else Param(f[1], f[0]) for f in fields))


_I32 = "const int32_t*"
# the ``positions`` option's params (after every other field, so a default kernel's struct is unchanged):
# kv_page_pos, parallel to kv_indices (the true position of each page-table entry's first token; a token for
# Ragged()), and q_pos, one a query token (its true position)
POSITION_FIELDS = ((_I32, "kv_page_pos"), (_I32, "q_pos"))
# RoPE's runtime values (spec/parts.py RoPE theta, scale; common/rope.cuh)
ROPE_FIELDS = (("float", "rope_rcp_scale"), ("float", "rope_log2_theta"))
# a RoPE scaling's params (Llama-3.1, YaRN: spec/parts.py rope_terms; common/rope.cuh rope_rotate_scaled), after
# every field of a kernel without one
ROPE_SCALING_FIELDS = (("float", "rope_rcp_factor"), ("float", "rope_smooth_a"), ("float", "rope_smooth_b"),
                       ("float", "rope_smooth_c"), ("float", "rope_mscale"))


def rope_scaled(spec) -> bool:
    """Whether ``spec``'s RoPE has a scaling (Llama-3.1, YaRN): its kernels take ``ROPE_SCALING_FIELDS``."""
    rope = spec.pos_encoding
    return getattr(rope, "scaling", None) is not None


def positions_option(op: str, options: dict) -> bool:
    """The ``positions`` kernel option (bool, default False): explicit key and query positions, read from the
    ``kv_page_pos`` and ``q_pos`` params instead of derived from a key's place in its request's page list and
    ``kv_len - qo_len`` (masks, RoPE and ALiBi then use them)."""
    value = options.get("positions", False)
    if not isinstance(value, bool):
        raise SpecError(f"kernel_options['positions']: got {value!r}, expected True or False ({op})")
    return value


def split_kv_struct(name: str, q: str, kv: str, *, before_strides: tuple = (), after: tuple = ()) -> ParamsLayout:
    """The params of a split-KV kernel (decode, the portable prefill): q / k / v / o / lse, the partials, the page
    table, the plan's fields (``SPLIT_KV_SCHEMA``'s names, which the api fills by name) and the merge counters,
    then ``before_strides``, the cache's strides, the runtime values, then ``after``. ``q``, ``kv``: C++ types."""
    return struct(
        name,
        (f"const {q}*", "q"), (f"const {kv}*", "k"), (f"const {kv}*", "v"), (f"{q}*", "o"), ("float*", "lse"),
        ("float*", "tmp_o"), ("float*", "tmp_lse"),
        (_I32, "kv_indptr"), (_I32, "kv_indices"), (_I32, "block_table"),
        (_I32, "qo_indptr"), (_I32, "kv_len"), (_I32, "request_idx"), (_I32, "qo_tile_idx"), (_I32, "chunk_idx"),
        (_I32, "kv_start"), (_I32, "kv_end"), (_I32, "merge_indptr"), (_I32, "num_chunks"), ("int32_t*", "counters"),
        *before_strides,
        ("int64_t", "stride_page"), ("int64_t", "stride_token"), ("int64_t", "stride_head"),
        ("int32_t", "block_table_stride"), ("int32_t", "num_qo_heads"), ("int32_t", "group_size"),
        ("int32_t", "window_left"),
        ("float", "sm_scale"), ("float", "soft_cap"), *ROPE_FIELDS,
        *after,
    )
