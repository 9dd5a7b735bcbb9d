"""The fuzz's cases: a fixed list of kernel variants and a seeded generator of batches over them (host only).

``VARIANTS`` is a deterministic function of the spec space: a greedy pairwise covering (AETG) of the options
(wrapper and backend, page size 1 .. 1000 or ragged, NHD / HND, head dim 64 / 128 / 256, mask, positional
encoding, soft-cap, dtype), so every pair of option values meets in some variant. ``case(seed)`` draws one batch
over one variant: GQA groups 1-8, KV lengths 0-64k (long KV with few queries: every case is kept under a bound
of reference work and cache size), both page-table forms, page ids on the host or the device, runtime values,
custom masks in every form, split / unsplit plans, few-SM plans, and CUDA-graph replays of a per-(variant, ids)
graph group (``graph_group``) whose capacities, heads and runtime values are fixed. The same seed gives the
same case (numpy's PCG64 seeded with ``(GENERATOR_VERSION, seed)``); changing the generator changes what a
seed means, so bump ``GENERATOR_VERSION`` then (stored regression seeds keep their summaries).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass

import numpy as np

from flashgen.spec import ALiBi, AttentionSpec, Causal, CustomMask, NoMask, Paged, Ragged, RoPE, SlidingWindow

GENERATOR_VERSION = 1

PAGE_SIZES = (1, 3, 16, 17, 64, 100, 256, 1000)
RAGGED = 0  # the layout value of Ragged() among the page sizes
HEAD_DIMS = (64, 128, 256)
BACKENDS = ("decode", "portable", "auto")  # decode wrapper; prefill wrapper with backend="portable" / "auto"
MASKS = ("none", "causal", "window", "custom")
POSITIONS = ("none", "rope", "alibi")
MASK_KINDS = ("random0.05", "random0.5", "random0.97", "doc", "blocks", "causal", "zeros", "ones", "empty_rows")
MASK_FORMS = ("list", "host", "numpy", "device", "device_unaligned")  # flashgen.testing.masks.FORMS
GRAPH_IDS = ("reused", "host", "fresh")  # page ids of a graph group; ragged groups have none ("none")
HOST_IDS = ("numpy", "int32", "int64")  # how host page ids are handed to plan(): numpy int32, CPU tensors

WORK = 2 ** 25  # sum(qo_len * kv_len) * num_qo_heads: the fp64 reference's logits of a case
MASK_WORK = 2 ** 18  # sum(qo_len * kv_len) of a custom-mask case (its bits are drawn and packed on the host)
POOL = 2 ** 26  # elements of K (and of V) a case's cache may span: pages * page_size * num_kv_heads * head_dim
Q_POOL = 2 ** 24  # elements of q: total_q * num_qo_heads * head_dim
MAX_KV = 65536
MAX_QO_HEADS = 32
GRAPH_SHARE = 0.2  # of the cases of a variant that has graph groups
MIN_VARIANTS = 40
WARMUP_SEED = 1 << 40  # seeds of the graph groups' warm-up batches, past any case's


@dataclass(frozen=True)
class Variant:
    """A kernel variant: the wrapper and backend (``"decode"``, ``"portable"``, ``"auto"``) over one spec."""

    index: int
    backend: str
    spec: AttentionSpec

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.spec.uri}"

    @property
    def decode(self) -> bool:
        return self.backend == "decode"

    @property
    def paged(self) -> bool:
        return isinstance(self.spec.kv_layout, Paged)

    @property
    def graphs(self) -> bool:
        """Whether the variant has CUDA-graph groups (custom masks are left out: their tile lists and bits travel
        with the plan, sized by the first plan, so a graph group's cases would be bound by its warm-up's mask)."""
        return not isinstance(self.spec.mask, CustomMask)


# ---------------------------------------------------------------------------------------------- variants

_FACTORS = (("backend", BACKENDS), ("layout", PAGE_SIZES + (RAGGED,)), ("order", ("NHD", "HND")),
            ("head_dim", HEAD_DIMS), ("mask", MASKS), ("pos", POSITIONS), ("soft_cap", (False, True)),
            ("dtype", ("bfloat16", "float16")))


def _feasible(row: dict) -> bool:
    return not (row["backend"] == "decode" and row["mask"] == "custom") and not (
        row["layout"] == RAGGED and row["order"] == "HND")


def _pairs(row: dict) -> set:
    """The option pairs a row covers (the order of a ragged layout is no option: it covers nothing)."""
    items = [(name, row[name]) for name, _ in _FACTORS if not (name == "order" and row["layout"] == RAGGED)]
    return set(itertools.combinations(items, 2))


def _spec(row: dict, index: int) -> AttentionSpec:
    layout = Ragged() if row["layout"] == RAGGED else Paged(row["layout"], row["order"])
    mask = {"none": NoMask(), "causal": Causal(), "window": SlidingWindow((16, 100, 1000)[index % 3]),
            "custom": CustomMask()}[row["mask"]]
    pos = {"none": None, "rope": (RoPE(), RoPE(500000.0, 8.0))[index % 2], "alibi": ALiBi()}[row["pos"]]
    return AttentionSpec(row["head_dim"], dtype=row["dtype"], kv_layout=layout, mask=mask, pos_encoding=pos,
                         soft_cap=(10.0, 30.0, 50.0)[index % 3] if row["soft_cap"] else None)


def build_variants(minimum: int = MIN_VARIANTS, candidates: int = 64) -> tuple[Variant, ...]:
    """The variant list: rows picked greedily, each the one of ``candidates`` (drawn from a fixed seed) covering
    the most option pairs not yet covered, until every feasible pair is covered and there are ``minimum``."""
    rng = np.random.default_rng(20261201)
    names = [name for name, _ in _FACTORS]
    every = [dict(zip(names, values)) for values in itertools.product(*(v for _, v in _FACTORS))]
    every = [row for row in every if _feasible(row)]
    uncovered = {((a, x), (b, y)) for (a, xs), (b, ys) in itertools.combinations(_FACTORS, 2)
                 for x, y in itertools.product(xs, ys)}
    uncovered -= {(("backend", "decode"), ("mask", "custom"))}  # decode takes no custom mask
    uncovered -= {(("layout", RAGGED), ("order", o)) for o in ("NHD", "HND")}  # ragged KV has no page order
    rows: list[dict] = []
    while uncovered or len(rows) < minimum:
        pool = [every[int(i)] for i in rng.integers(len(every), size=candidates)]
        best = max(pool, key=lambda row: len(_pairs(row) & uncovered))
        if best in rows:
            continue
        rows.append(best)
        uncovered -= _pairs(best)
    return tuple(Variant(i, row["backend"], _spec(row, i)) for i, row in enumerate(rows))


VARIANTS = build_variants()


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One fuzz case: a batch over ``VARIANTS[variant]``. ``form``: ``"csr"``, ``"block_table"`` or ``"ragged"``;
    ``ids``: where the page ids are (``"host"``, ``"device"``; in a graph group ``"host"``, ``"reused"`` (copied
    into the group's device tensor) or ``"fresh"`` (a new device tensor every plan); ``"none"`` for ragged KV);
    ``host_ids``: the host form (``HOST_IDS``); ``spare``: pages (rows, ragged) of the cache past the batch's, NaN;
    ``bt_pad`` / ``bt_fill``: block-table columns past the longest request and their value; ``runtime``: the
    plan's runtime values (also the reference's); ``graph``: replayed in the graph group ``graph_group(variant,
    ids)``, whose heads, form, runtime values and cache it takes."""

    seed: int
    variant: int
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_kv_heads: int
    group: int
    form: str
    ids: str
    host_ids: str
    num_pages_arg: bool
    combined: bool
    spare: int
    bt_pad: int
    bt_fill: int
    runtime: tuple[tuple[str, float], ...]
    mask_kind: str | None
    mask_form: str | None
    enable_split: bool
    num_sms: int | None
    graph: bool

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.group

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GraphGroup:
    """A captured graph's fixed part: one wrapper with ``use_cuda_graph=True`` (``max_batch_size``,
    ``max_total_q``), the heads and runtime values baked into the capture, the page-table form, and a cache of
    ``pool`` pages (rows, ragged) whose address and shape never change; ``width``: block-table columns.
    ``warmup`` is the batch planned and captured first: the largest (every request at ``max_kv``, ``max_total_q``
    queries, all ``pool`` pages), so it sizes whatever a first plan sizes."""

    variant: int
    ids: str
    num_kv_heads: int
    group: int
    form: str
    host_ids: str
    combined: bool
    runtime: tuple[tuple[str, float], ...]
    bt_fill: int
    max_batch_size: int
    max_total_q: int
    max_kv: int
    pool: int
    width: int
    warmup: tuple[tuple[int, ...], tuple[int, ...]]

    @property
    def key(self) -> tuple[int, str]:
        return self.variant, self.ids


def _heads(rng: np.random.Generator) -> tuple[int, int]:
    num_kv_heads = int(rng.choice([1, 2, 4, 8, 3], p=[0.3, 0.3, 0.2, 0.1, 0.1]))
    group = int(rng.integers(1, 9))
    return num_kv_heads, max(1, min(group, MAX_QO_HEADS // num_kv_heads))


def _runtime(rng: np.random.Generator, spec: AttentionSpec, max_kv: int) -> tuple[tuple[str, float], ...]:
    """Plan-time overrides of the spec's runtime values, each drawn with probability 0.3."""
    out = []
    if rng.random() < 0.3:
        out.append(("sm_scale", round(float(rng.uniform(0.02, 0.25)), 4)))
    if spec.soft_cap is not None and rng.random() < 0.3:
        out.append(("soft_cap", round(float(rng.uniform(2.0, 50.0)), 3)))
    if isinstance(spec.mask, SlidingWindow) and rng.random() < 0.3:
        out.append(("window_left", int(rng.choice([0, 1, int(rng.integers(0, 2 * max_kv + 2))]))))
    if isinstance(spec.pos_encoding, RoPE) and rng.random() < 0.3:
        out.append(("rope_theta", float(rng.choice([1e4, 5e5, 1e6]))))
        out.append(("rope_scale", float(rng.choice([1.0, 2.0, 8.0]))))
    return tuple(out)


def _kv_len(rng: np.random.Generator, page_size: int, cap: int) -> int:
    r = rng.random()
    if r < 0.12:
        n = int(rng.choice([0, 1, 2]))
    elif r < 0.5:
        n = int(rng.integers(0, 130))
    elif r < 0.8:
        n = int(rng.integers(0, 2049))
    elif r < 0.95:
        n = int(rng.integers(0, 16385))
    else:
        n = int(rng.integers(0, MAX_KV + 1))
    if rng.random() < 0.25:  # a page or tile boundary, +- 1
        unit = int(rng.choice([page_size, 16, 32, 64, 128]))
        n = max(0, -(-n // unit) * unit + int(rng.integers(-1, 2)))
    return min(n, cap)


def _qo_len(rng: np.random.Generator, kv_len: int) -> int:
    """Queries of a prefill request: its last tokens (qo_len <= kv_len), or a few when its KV is empty."""
    if kv_len == 0:
        return int(rng.choice([0, 1, 5]))
    r = rng.random()
    if r < 0.08:
        return 0
    if r < 0.3:
        return min(kv_len, int(rng.integers(1, 5)))
    if r < 0.5:
        return kv_len
    return min(kv_len, int(np.exp(rng.uniform(0, np.log(2049)))))


def _batch_size(rng: np.random.Generator, decode: bool, cap: int) -> int:
    r = rng.random()
    ranges = ((1, 4), (5, 16), (17, 32)) if decode else ((1, 2), (3, 6), (7, 12))
    low, high = ranges[0] if r < 0.5 else ranges[1] if r < 0.85 else ranges[2]
    return min(cap, int(rng.integers(low, high + 1)))


def _pages(spec: AttentionSpec, kv_lens) -> int:
    page_size = spec.kv_layout.page_size if isinstance(spec.kv_layout, Paged) else 1
    return sum(-(-k // page_size) for k in kv_lens)


def fits(spec: AttentionSpec, qo_lens, kv_lens, num_kv_heads: int, group: int, spare: int = 0) -> bool:
    """Whether a batch keeps within the fuzz's bounds of reference work, mask bits, cache and q size."""
    pairs = sum(q * k for q, k in zip(qo_lens, kv_lens))
    page_size = spec.kv_layout.page_size if isinstance(spec.kv_layout, Paged) else 1
    slots = (_pages(spec, kv_lens) + spare) * page_size * num_kv_heads * spec.head_dim
    return (pairs * num_kv_heads * group <= WORK and slots <= POOL
            and sum(qo_lens) * num_kv_heads * group * spec.head_dim <= Q_POOL
            and (pairs <= MASK_WORK or not isinstance(spec.mask, CustomMask)))


def _shrink(spec, qo_lens: list, kv_lens: list, num_kv_heads, group, spare, decode: bool) -> None:
    """Halve the longest request (its queries stay <= its KV) until the batch fits the bounds (in place)."""
    while not fits(spec, qo_lens, kv_lens, num_kv_heads, group, spare):
        b = max(range(len(kv_lens)), key=lambda i: (max(qo_lens[i], 1) * kv_lens[i], qo_lens[i]))
        if kv_lens[b] == 0 and qo_lens[b] <= 1:
            raise AssertionError("a batch of empty requests exceeds the bounds")  # the bounds leave room for these
        kv_lens[b] //= 2
        if not decode:
            qo_lens[b] = min(qo_lens[b], kv_lens[b]) if kv_lens[b] else min(qo_lens[b], 1)


@functools.lru_cache(maxsize=None)
def graph_group(variant: int, ids: str) -> GraphGroup:
    """The fixed part of the graph group ``(variant, ids)``: a function of the variant (the groups of one variant
    differ only in where their page ids are, so a seed's case is the same whatever ``ids`` the flags give it)."""
    v = VARIANTS[variant]
    rng = np.random.default_rng([GENERATOR_VERSION, 7, variant])
    num_kv_heads, group = _heads(rng)
    spec = v.spec
    max_batch = int(rng.choice([4, 8, 16, 32] if v.decode else [2, 4, 8]))
    max_total_q = max_batch if v.decode else int(rng.choice([64, 256, 700]))
    max_total_q = max(max_total_q, max_batch)
    max_kv = int(rng.choice([600, 2048, 9000]))
    page_size = spec.kv_layout.page_size if v.paged else 1
    per_page = page_size * num_kv_heads * spec.head_dim
    pages = max(1, POOL // per_page // max_batch)  # pages a request may span within the cache bound
    max_kv = max(1, min(max_kv, pages * page_size))
    pool = max_batch * -(-max_kv // page_size)
    form = ("csr", "block_table")[int(rng.integers(2))] if v.paged else "ragged"
    q_each = max(1, max_total_q // max_batch)
    warm_q = (1,) * max_batch if v.decode else tuple(min(q_each, max_kv) for _ in range(max_batch))
    return GraphGroup(variant, ids if v.paged else "none", num_kv_heads, group, form,
                      HOST_IDS[int(rng.integers(3))], bool(rng.integers(2)) and v.paged,
                      _runtime(rng, spec, max_kv), int(rng.choice([0, -1])) if form == "block_table" else 0,
                      max_batch, max_total_q, max_kv, pool, -(-max_kv // page_size) + int(rng.integers(0, 3)),
                      (warm_q, (max_kv,) * max_batch))


def warmup_case(g: GraphGroup) -> Case:
    """The batch a graph group plans and captures first (``GraphGroup.warmup``), as a case of the group."""
    v = VARIANTS[g.variant]
    return Case(seed=WARMUP_SEED + 4 * g.variant + (GRAPH_IDS + ("none",)).index(g.ids), variant=g.variant,
                qo_lens=g.warmup[0], kv_lens=g.warmup[1], num_kv_heads=g.num_kv_heads, group=g.group, form=g.form,
                ids=g.ids, host_ids=g.host_ids, num_pages_arg=False, combined=g.combined, spare=0, bt_pad=0,
                bt_fill=g.bt_fill, runtime=g.runtime, mask_kind=None, mask_form=None, enable_split=True,
                num_sms=None, graph=v.graphs)


def case(seed: int, fresh_graph_ids: bool = False) -> Case:
    """The case of ``seed``. A graph case draws its page ids among ``GRAPH_IDS``; without ``fresh_graph_ids``
    a "fresh" draw runs as "reused" (the rest of the case is the same either way)."""
    rng = np.random.default_rng([GENERATOR_VERSION, seed])
    v = VARIANTS[int(rng.integers(len(VARIANTS)))]
    spec = v.spec
    page_size = spec.kv_layout.page_size if v.paged else 1
    graph = v.graphs and rng.random() < GRAPH_SHARE
    ids_draw = GRAPH_IDS[int(rng.integers(3))]
    if graph:
        ids = ids_draw if (ids_draw != "fresh" or fresh_graph_ids) else "reused"
        g = graph_group(v.index, ids if v.paged else "none")
        num_kv_heads, group, form, host_ids, combined = g.num_kv_heads, g.group, g.form, g.host_ids, g.combined
        runtime, batch_cap, q_cap, kv_cap, spare = g.runtime, g.max_batch_size, g.max_total_q, g.max_kv, 0
        ids, bt_pad, bt_fill, num_sms, enable_split = g.ids, 0, g.bt_fill, None, True
    else:
        num_kv_heads, group = _heads(rng)
        form = ("csr", "block_table")[int(rng.integers(2))] if v.paged else "ragged"
        ids = ("host", "device")[int(rng.integers(2))] if v.paged else "none"
        host_ids, combined = HOST_IDS[int(rng.integers(3))], bool(rng.integers(2)) and v.paged
        batch_cap, q_cap, kv_cap, spare = 64, 1 << 30, MAX_KV, int(rng.choice([0, 1, 3]))
        spare = max(spare, 1) if v.paged else spare
        bt_pad, bt_fill = int(rng.integers(0, 3)), int(rng.choice([0, -1]))
        num_sms = int(rng.choice([1, 3, 8, 33])) if rng.random() < 0.25 else None
        enable_split = bool(rng.random() < 0.85)
        runtime = None
    batch = _batch_size(rng, v.decode, batch_cap)
    kv_lens = [_kv_len(rng, page_size, kv_cap) for _ in range(batch)]
    special = rng.random()
    if special < 0.03:
        kv_lens = [0] * batch
    elif special < 0.05 and v.decode:
        kv_lens = [int(rng.integers(MAX_KV // 2, MAX_KV + 1))]
    kv_lens = [min(k, kv_cap) for k in kv_lens]
    qo_lens = [1] * len(kv_lens) if v.decode else [_qo_len(rng, k) for k in kv_lens]
    if not v.decode and special > 0.97:
        qo_lens = [0] * len(kv_lens)
    while sum(qo_lens) > q_cap:  # a graph group's max_total_q
        b = int(np.argmax(qo_lens))
        qo_lens[b] //= 2
    if runtime is None:
        runtime = _runtime(rng, spec, max(kv_lens, default=0))
    _shrink(spec, qo_lens, kv_lens, num_kv_heads, group, spare, v.decode)
    custom = isinstance(spec.mask, CustomMask)
    return Case(
        seed=seed, variant=v.index, qo_lens=tuple(qo_lens), kv_lens=tuple(kv_lens), num_kv_heads=num_kv_heads,
        group=group, form=form, ids=ids, host_ids=host_ids, num_pages_arg=bool(rng.integers(2)),
        combined=combined, spare=spare, bt_pad=bt_pad, bt_fill=bt_fill, runtime=runtime,
        mask_kind=MASK_KINDS[int(rng.integers(len(MASK_KINDS)))] if custom else None,
        mask_form=MASK_FORMS[int(rng.integers(len(MASK_FORMS)))] if custom else None,
        enable_split=enable_split, num_sms=num_sms, graph=graph)


def summary(c: Case) -> str:
    """One line naming what a case runs (for progress lines, mismatch reports and regression records)."""
    v = VARIANTS[c.variant]

    def lens(xs):
        return str(list(xs)) if len(xs) <= 8 else f"[{', '.join(map(str, xs[:8]))}, ... ({len(xs)})]"

    parts = [f"seed={c.seed}", v.name, f"heads={c.num_qo_heads}/{c.num_kv_heads}"]
    if not v.decode:
        parts.append(f"qo={lens(c.qo_lens)}")
    parts += [f"kv={lens(c.kv_lens)}", c.form, f"ids={c.ids}"]
    if c.combined:
        parts.append("combined")
    if c.graph:
        parts.append("graph")
    if c.runtime:
        parts.append(",".join(f"{k}={val}" for k, val in c.runtime))
    if c.mask_kind:
        parts.append(f"mask={c.mask_kind}/{c.mask_form}")
    if not c.enable_split:
        parts.append("unsplit")
    if c.num_sms:
        parts.append(f"sms={c.num_sms}")
    return " ".join(parts)
