"""Deployment build plans: read them (TOML, or the older JSON list), and derive one from a Hugging Face
``config.json``.

A plan names the model it serves and the kernels a server of it needs, at the page sizes it uses::

    model = "meta-llama/Meta-Llama-3-8B"
    # decode: one kernel per page size
    [[kernel]]
    op = "decode"
    spec = { head_dim = 128, dtype = "bfloat16", kv_layout = { type = "Paged", page_size = 16 } }

``spec`` is a spec dict (``flashgen.spec.spec_from_dict``; omitted fields take their defaults). A
``prefill_sm90`` item stands for the kernels the sm90 backend runs for its spec. Every item is validated
against its family when the plan is read, so a plan that cannot be built fails before any compile.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .spec import AppendSpec, AttentionSpec, Causal, MergeSpec, NoMask, Paged, Ragged, SlidingWindow, SpecError
from .spec import spec_from_dict, spec_to_dict


class PlanError(ValueError):
    """A plan file or a model config flashgen cannot use: the message names the file, item or field."""


def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the `toml` extra
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise PlanError("reading a TOML plan on Python 3.10 needs tomli: pip install 'flashgen[toml]'") from exc
    return tomllib.loads(text)


def read_plan(path: Path) -> tuple[str, list[tuple[str, object]]]:
    """(model, [(op, spec), ...]) of a plan file: TOML (``model`` and ``[[kernel]]`` items) or the JSON list
    of ``{"op": ..., "spec": {...}}`` items. Raises ``PlanError`` naming the file and the item."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"--plan {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from exc
    if Path(path).suffix == ".json" or text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"--plan {path}: not valid JSON ({exc})") from exc
        model = ""
        if not isinstance(items, list):
            kind = {dict: "object", str: "string", int: "number", float: "number"}.get(type(items), json.dumps(items))
            raise PlanError(f"--plan {path}: got a JSON {kind}, expected a JSON list of "
                            '{"op": ..., "spec": {...}} items (or a TOML plan: plans/)')
    else:
        try:
            data = _toml_loads(text)
        except PlanError:
            raise
        except ValueError as exc:  # tomllib.TOMLDecodeError
            raise PlanError(f"--plan {path}: not valid TOML ({exc})") from exc
        model, items = data.get("model", ""), data.get("kernel", [])
        unknown = sorted(set(data) - {"model", "kernel", "config"})
        if unknown or not isinstance(model, str) or not isinstance(items, list) or not items:
            raise PlanError(f"--plan {path}: expected a string 'model', [[kernel]] items (op, spec) and an "
                            f"optional [config] table; got keys {sorted(data)}")
    return model, [_item(f"--plan {path}: item {i}", item) for i, item in enumerate(items)]


def _item(where: str, item: object) -> tuple[str, object]:
    from .kernels import family, ops

    if not isinstance(item, dict) or not isinstance(item.get("spec"), dict) or "op" not in item:
        raise PlanError(f"{where}: got {json.dumps(item, default=str)[:80]}, expected {{\"op\": ..., \"spec\": {{...}}}}")
    op = item["op"]
    if op not in ops():
        raise PlanError(f"{where}: op {op!r}, expected one of {', '.join(ops())}")
    from .api.backends import kernels_for

    try:
        spec = spec_from_dict(item["spec"])
        for kernel_op, kernel_spec in kernels_for(spec, "sm90") if op == "prefill_sm90" else [(op, spec)]:
            fam = family(kernel_op)
            fam.check(fam.project(kernel_spec))
    except SpecError as exc:
        raise PlanError(f"{where}: spec: {exc}") from exc
    return op, spec


# ----------------------------------------------------------------------------------------- plan-from-config

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def _field(config: dict, name: str, kind: type, default=None):
    value = config.get(name, default)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise PlanError(f"config.json: {name}: got {value!r}, expected {kind.__name__ if kind is not tuple else 'a number'}")
    return value


def specs_from_config(config: dict, page_sizes: tuple[int, ...] = (16,),
                      dtype: str | None = None) -> tuple[dict, list[tuple[str, object]]]:
    """(model facts, [(op, spec), ...]) for a Hugging Face ``config.json`` dict: paged decode and prefill
    (portable and sm90) at each page size, ragged causal prefill, the merges, and the cache write at each page size
    in the forms flashgen's callers use: an int64 ``slot_mapping`` as given (vLLM's and SGLang's adapters,
    ``PagedKVCache.append``) and an int32 one with RoPE on K (``PagedKVCache.allocate`` then ``write(...,
    rope=)``, the serving loop). ``dtype`` overrides the
    config's ``torch_dtype`` (a float32 checkpoint served in bfloat16). ``PlanError`` names the field flashgen
    cannot serve.

    A multimodal config's attention is its ``text_config``'s. Which masks the layers take (``_layer_masks``):
    ``layer_types`` where the config lists them (full and sliding attention; layers that are not softmax
    attention, such as linear attention, are left to their own kernels), else Gemma's alternation, else a
    window on every layer where ``sliding_window`` is set. gpt-oss's learned per-head sinks are the shipped
    ``flashgen.variants.examples.SINK`` variant (``run(..., sinks=)``), so a server builds its specs with it."""
    from .kernels import family

    config = _text_config(config)
    if "kv_lora_rank" in config:
        raise PlanError("config.json: kv_lora_rank: multi-head latent attention (DeepSeek-V2/V3 MLA) has no "
                        "flashgen kernel; plan its decoder without it")
    heads = _field(config, "num_attention_heads", int)
    kv_heads = _field(config, "num_key_value_heads", int, heads)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise PlanError(f"config.json: num_key_value_heads: got {kv_heads}, expected a divisor of "
                        f"num_attention_heads ({heads})")
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _field(config, "hidden_size", int)
        if hidden % heads:
            raise PlanError(f"config.json: hidden_size: {hidden} is not a multiple of num_attention_heads ({heads}); "
                            "give head_dim")
        head_dim = hidden // heads
    head_dim = _field({"head_dim": head_dim}, "head_dim", int)
    torch_dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if torch_dtype not in _DTYPES:
        raise PlanError(f"config.json: torch_dtype: got {torch_dtype!r}, expected one of bfloat16, float16 "
                        "(flashgen's attention runs in 16-bit: serve a float32 checkpoint with --dtype bfloat16)")
    dtype = _DTYPES[torch_dtype]
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:  # Qwen2: the field is set but off
        window = None
    if window is not None:
        window = _field({"sliding_window": window}, "sliding_window", int)
    soft_cap = config.get("attn_logit_softcapping")
    if soft_cap is not None:
        soft_cap = float(_field({"attn_logit_softcapping": soft_cap}, "attn_logit_softcapping", (int, float)))
    for size in page_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PlanError(f"--page-size: got {size!r}, expected an int >= 1")
    masks, layers = _layer_masks(config, window)
    variant = _sink_variant(config)
    try:
        AttentionSpec(head_dim, dtype=dtype, soft_cap=soft_cap)
    except SpecError as exc:
        raise PlanError(f"config.json: head_dim {head_dim} ({'head_dim' if 'head_dim' in config else 'hidden_size / num_attention_heads'}) "
                        f"is not one flashgen serves: {exc}") from exc
    builds: list[tuple[str, object]] = []

    def spec(layout, mask):
        return AttentionSpec(head_dim, dtype=dtype, kv_layout=layout, mask=mask, soft_cap=soft_cap, variant=variant)

    for mask in masks:
        decode_mask = NoMask() if isinstance(mask, Causal) else mask
        builds += [("decode", spec(Paged(size), decode_mask)) for size in page_sizes]
        for op in ("prefill", "prefill_sm90"):
            builds += [(op, spec(Ragged(), mask))] + [(op, spec(Paged(size), mask)) for size in page_sizes]
    builds += [("merge_states", MergeSpec(dtype)), ("merge_states", MergeSpec("float32"))]
    for size in page_sizes:  # the cache write (append_kv) in the two forms flashgen's own callers use
        builds += [("append", AppendSpec(head_dim, dtype, dtype, Paged(size), page_table="slot_mapping",
                                         index_dtype="int64")),
                   ("append", AppendSpec(head_dim, dtype, dtype, Paged(size), rope="rope", page_table="slot_mapping",
                                         index_dtype="int32"))]
    for op, s in builds:
        try:
            family(op).check(family(op).project(s))
        except SpecError as exc:
            raise PlanError(f"config.json: flashgen's {op} kernel cannot serve this model: {exc}") from exc
    facts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
             "dtype": dtype, "sliding_window": window, "attn_logit_softcapping": soft_cap,
             "layers": layers, "attention_sinks": True if variant is not None else None,
             "rope_theta": config.get("rope_theta"), "rope_scaling": config.get("rope_scaling")}
    return facts, builds


_ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # Causal() and SlidingWindow(sliding_window)
# layer kinds that are not softmax attention over a KV cache: other kernels serve them
_OTHER_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "moe")


def _text_config(config: dict) -> dict:
    """A multimodal config's language model (``text_config``), with the top level's dtype where it has none."""
    text = config.get("text_config")
    if "num_attention_heads" in config or not isinstance(text, dict):
        return config
    dtype = {k: config[k] for k in ("torch_dtype", "dtype") if k in config and k not in text}
    return {**dtype, **text}


def _layer_masks(config: dict, window: int | None) -> tuple[list, str]:
    """The masks the model's attention layers take, and how the config said so (for the plan's [config])."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise PlanError(f"config.json: layer_types: got {types!r}, expected a list of layer kinds")
        kinds = Counter(types)  # in first-seen order
        unknown = [t for t in kinds if t not in _ATTENTION_LAYERS and t not in _OTHER_LAYERS]
        if unknown:
            raise PlanError(f"config.json: layer_types: {unknown[0]!r} layers have no flashgen mask (it plans "
                            f"{', '.join(_ATTENTION_LAYERS)}; {', '.join(_OTHER_LAYERS)} layers are left to "
                            "their own kernels)")
        if "sliding_attention" in kinds and window is None:
            raise PlanError("config.json: sliding_window: layer_types names sliding_attention layers, but no "
                            "window is set")
        masks = ([Causal()] if "full_attention" in kinds else []) + \
            ([SlidingWindow(window)] if "sliding_attention" in kinds else [])
        if not masks:
            raise PlanError(f"config.json: layer_types: no softmax attention layer among {sorted(kinds)}")
        return masks, ", ".join(f"{n} {t}" for t, n in kinds.items())
    if window is None:
        return [Causal()], "full attention on every layer"
    if config.get("sliding_window_pattern") or config.get("attn_logit_softcapping") is not None:
        # Gemma-2 (soft-capped) and Gemma-3 (sliding_window_pattern) alternate windowed and global layers
        return [Causal(), SlidingWindow(window)], "windowed and global layers alternate"
    return [SlidingWindow(window)], "a window on every layer"


def _sink_variant(config: dict):
    """gpt-oss's attention: a learned logit per q head in each softmax's denominator (the SINK example)."""
    if config.get("model_type") != "gpt_oss":
        return None
    from .variants.examples import SINK

    return SINK


def _toml_value(value: object) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def plan_toml(model: str, facts: dict, builds: list[tuple[str, object]], note: str = "") -> str:
    """A plan file's text for ``builds``: one commented ``[[kernel]]`` item each."""
    lines = [f"# flashgen build plan: {model}", *(f"# {line}" for line in note.splitlines() if line)]
    lines += [f"model = {json.dumps(model)}", "", "# the model's attention, as read from its config (for review; "
              "numbers are runtime parameters)", "[config]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in facts.items() if v is not None and not isinstance(v, dict)]
    for op, spec in builds:
        data = {k: v for k, v in spec_to_dict(spec).items() if v is not None and k != "head_dim_vo"}
        if data.get("kv_dtype") == data.get("dtype"):
            data.pop("kv_dtype", None)
        lines += ["", f"# {_describe(op, spec)}", "[[kernel]]", f"op = {json.dumps(op)}",
                  f"spec = {_toml_value(data)}"]
    return "\n".join(lines) + "\n"


def _describe(op: str, spec: object) -> str:
    if isinstance(spec, MergeSpec):
        return f"merge of partial states ({spec.dtype}): split-KV and cascade levels"
    if isinstance(spec, AppendSpec):
        rope = {"none": "", "rope": ", K rotated on the way (RoPE)"}.get(spec.rope, f", rope {spec.rope}")
        return (f"cache write (append_kv), page size {spec.kv_layout.page_size}, {spec.page_table} "
                f"{spec.index_dtype}{rope}")
    layout = f"page size {spec.kv_layout.page_size}" if isinstance(spec.kv_layout, Paged) else "ragged K/V"
    what = {"decode": "decode", "prefill": "prefill, portable (mma.sync)", "prefill_sm90": "prefill, Hopper (wgmma)"}
    hooks = " + attention sinks" if spec.variant is not None and spec.variant.sink is not None else ""
    return f"{what.get(op, op)}, {layout}, {type(spec.mask).__name__}" + (", soft-cap" if spec.soft_cap else "") + hooks
