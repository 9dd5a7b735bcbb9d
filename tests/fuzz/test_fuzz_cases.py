"""The fuzz's case generator on the CPU: the variants are valid and cover every pair of options, cases are
deterministic, cover every option and stay within their bounds, every drawn case plans (wrappers with the CUDA
calls stubbed), and small cases' inputs agree between the CPU plan executor and the reference."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from contextlib import ExitStack
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch

from flashgen.api import sm90
from flashgen.api import wrapper as wrapper_module
from flashgen.api.backends import check_sm90, select
from flashgen.kernels import family
from flashgen.plan import plan_decode, plan_prefill
from flashgen.testing.executor import run_plan
from flashgen.testing.reference import reference_attention
from stub_cuda import stubbed_cuda

from . import __main__ as cli
from . import worker_stub
from .cases import (GRAPH_IDS, HOST_IDS, MASK_FORMS, MASK_KINDS, MAX_KV, MAX_QO_HEADS, PAGE_SIZES, VARIANTS,
                    WARMUP_SEED, _FACTORS, _pairs, case, fits, graph_group, summary, warmup_case)
from .inputs import Pools, fill, host_batch, kv_views, mask_argument, masks_of, plan_table, q_view, reference_table
from .runner import Runner, kernels, make_wrapper, needed_kernels, plan

SEEDS = range(5000)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cases():
    return [case(s) for s in SEEDS]


def test_variants_are_valid_and_cover_every_pair_of_options():
    assert len(VARIANTS) >= 40
    covered = set().union(*(_pairs(_row(v)) for v in VARIANTS))
    for (a, xs), (b, ys) in itertools.combinations(_FACTORS, 2):
        for x in xs:
            for y in ys:
                pair = ((a, x), (b, y))
                infeasible = pair == (("backend", "decode"), ("mask", "custom")) or (a, b, x) == ("layout", "order", 0)
                assert infeasible or pair in covered, f"no variant has {pair}"
    for v in VARIANTS:
        if v.decode:
            family("decode").check(family("decode").project(v.spec))
        else:
            spec = family("prefill").project(v.spec)
            family("prefill").check(spec)
            if v.backend == "auto":
                assert select(spec, "auto", (9, 0)) == "sm90", v.name  # every auto variant runs sm90 on an H200
                check_sm90(spec)
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)


def _row(v) -> dict:
    spec = v.spec
    mask = type(spec.mask).__name__
    pos = type(spec.pos_encoding).__name__ if spec.pos_encoding is not None else "none"
    return {"backend": v.backend, "layout": spec.kv_layout.page_size if v.paged else 0,
            "order": spec.kv_layout.order if v.paged else "NHD", "head_dim": spec.head_dim,
            "mask": {"NoMask": "none", "Causal": "causal", "SlidingWindow": "window", "CustomMask": "custom"}[mask],
            "pos": {"none": "none", "RoPE": "rope", "ALiBi": "alibi"}[pos], "soft_cap": spec.soft_cap is not None,
            "dtype": spec.dtype}


def test_every_variant_renders_and_builds_its_wrappers():
    """Every kernel a variant runs renders (the template's checks and context; compiling them all is the GPU
    run's first step), and its wrappers, eager and CUDA-graph, construct."""
    from flashgen.jit import render

    for v in VARIANTS:
        for graph in (False, True):
            for op, spec in kernels(v, (9, 0), graph):
                assert "__global__" in render(spec, op), (v.name, op)
    with _stubbed(), mock.patch.object(wrapper_module, "device_sms", lambda index: 132):
        for v in VARIANTS:
            make_wrapper(v)
            if v.graphs:
                g = graph_group(v.index, "reused" if v.paged else "none")
                backend = getattr(make_wrapper(v, None, g), "backend", "decode")
                assert backend == ("decode" if v.decode else "portable" if v.backend == "portable"
                                   or type(v.spec.pos_encoding).__name__ == "RoPE" else "sm90"), v.name


def test_kernels_to_compile():
    jobs = needed_kernels([case(s) for s in range(2000)], (9, 0))
    ops = Counter(op for op, _ in jobs)
    assert ops["decode"] == sum(v.decode for v in VARIANTS)
    assert ops["prefill_sm90"] == sum(v.backend == "auto" for v in VARIANTS)
    assert ops["rope_gather"] == sum(v.backend == "auto" and type(v.spec.pos_encoding).__name__ == "RoPE"
                                     for v in VARIANTS)
    # auto runs RoPE through the portable kernel in a graph: its kernel is compiled too
    assert ops["prefill"] == sum(v.backend == "portable" for v in VARIANTS) + ops["rope_gather"]
    assert all(op != "prefill_sm90" for v in VARIANTS for op, _ in kernels(v, (8, 0)))


def test_cases_are_deterministic():
    for seed in (0, 1, 17, 4242, 99999, 10 ** 9):
        a, b = case(seed), case(seed)
        assert a == b and summary(a) == summary(b)
        ha, hb = host_batch(a), host_batch(b)
        for name in ("qo_indptr", "kv_lens", "kv_indptr", "kv_indices", "block_table", "valid"):
            x, y = getattr(ha, name), getattr(hb, name)
            assert (x is None and y is None) or np.array_equal(x, y)
    masked = [c for c in (case(s) for s in range(400)) if c.mask_kind][:5]
    for c in masked:
        assert all(torch.equal(x, y) for x, y in zip(masks_of(c), masks_of(c)))
    assert case(3) != case(4)


def test_fresh_graph_ids_change_only_the_ids():
    changed = 0
    for seed in range(3000):
        plain, fresh = case(seed), case(seed, fresh_graph_ids=True)
        if fresh.ids == "fresh":
            changed += 1
            assert plain.graph and plain == replace(fresh, ids="reused")
        else:
            assert plain == fresh
        assert plain.ids != "fresh"
    assert changed > 20


def test_cases_cover_every_option(cases):
    seen = Counter()
    for c in cases:
        v = VARIANTS[c.variant]
        seen.update([("variant", c.variant), ("graph", c.graph), ("form", c.form), ("ids", c.ids, c.graph),
                     ("combined", c.combined), ("group", c.group), ("num_kv_heads", c.num_kv_heads),
                     ("split", c.enable_split), ("sms", c.num_sms is not None), ("num_pages", c.num_pages_arg),
                     ("bt_fill", c.bt_fill), ("spare", c.spare)])
        seen.update(("runtime", name) for name, _ in c.runtime)
        if c.ids == "host":
            seen[("host_ids", c.host_ids)] += 1
        if c.graph:
            seen[("graph_variant", c.variant)] += 1
        if c.mask_kind:
            seen.update([("mask_kind", c.mask_kind), ("mask_form", c.mask_form)])
        kv = c.kv_lens
        seen.update([("kv0", 0 in kv), ("kv1", 1 in kv), ("kv_long", max(kv) > 16384), ("kv_64k", max(kv) > 60000)])
        if not v.decode:
            seen.update([("qo0", 0 in c.qo_lens), ("qo=kv", any(q == k > 0 for q, k in zip(c.qo_lens, kv))),
                         ("append", any(0 < q < k for q, k in zip(c.qo_lens, kv))), ("qo_long", max(c.qo_lens) > 512)])
        if v.paged:
            ps = v.spec.kv_layout.page_size
            seen[("page_boundary", any(k % ps == 0 and k > 0 for k in kv))] += 1
    missing = [v.index for v in VARIANTS if not seen[("variant", v.index)]]
    missing += [v.index for v in VARIANTS if v.graphs and not seen[("graph_variant", v.index)]]
    assert not missing, f"variants never drawn: {missing}"
    expect = [("graph", True), ("graph", False), ("form", "csr"), ("form", "block_table"), ("form", "ragged"),
              ("ids", "host", False), ("ids", "device", False), ("ids", "host", True), ("ids", "reused", True),
              ("ids", "none", True), ("combined", True), ("combined", False), ("split", False), ("sms", True),
              ("num_pages", True), ("bt_fill", -1), ("spare", 3), ("kv0", True), ("kv1", True), ("kv_long", True),
              ("kv_64k", True), ("qo0", True), ("qo=kv", True), ("append", True), ("qo_long", True),
              ("page_boundary", True)]
    expect += [("group", g) for g in range(1, 9)] + [("num_kv_heads", h) for h in (1, 2, 3, 4, 8)]
    expect += [("host_ids", h) for h in HOST_IDS] + [("mask_kind", k) for k in MASK_KINDS]
    expect += [("mask_form", f) for f in MASK_FORMS]
    expect += [("runtime", r) for r in ("sm_scale", "soft_cap", "window_left", "rope_theta", "rope_scale")]
    assert not [e for e in expect if not seen[e]], [e for e in expect if not seen[e]]
    assert {p for v in VARIANTS if v.paged for p in [v.spec.kv_layout.page_size]} == set(PAGE_SIZES)
    assert set(GRAPH_IDS) == {"reused", "host", "fresh"}


def test_cases_keep_within_their_bounds(cases):
    for c in cases:
        v = VARIANTS[c.variant]
        assert fits(v.spec, c.qo_lens, c.kv_lens, c.num_kv_heads, c.group, c.spare), summary(c)
        assert 1 <= c.group <= 8 and c.num_qo_heads <= MAX_QO_HEADS and len(c.kv_lens) >= 1
        assert all(0 <= k <= MAX_KV for k in c.kv_lens)
        if v.decode:
            assert set(c.qo_lens) == {1}
        else:
            assert all(q <= k or (k == 0 and q <= 5) for q, k in zip(c.qo_lens, c.kv_lens)), summary(c)
        if c.graph:
            g = graph_group(c.variant, c.ids)
            assert (c.num_kv_heads, c.group, c.form, c.runtime) == (g.num_kv_heads, g.group, g.form, g.runtime)
            assert len(c.kv_lens) <= g.max_batch_size and sum(c.qo_lens) <= g.max_total_q
            assert max(c.kv_lens) <= g.max_kv
            w = warmup_case(g)
            assert fits(v.spec, (0,) * len(w.kv_lens), w.kv_lens, g.num_kv_heads, g.group)  # the cache bound


def _stubbed() -> ExitStack:
    """Wrappers on the CPU, as on an H200 (the sm90 backend's RoPE scratch maps are stubbed too)."""
    stack = ExitStack()
    for cm in (stubbed_cuda(), mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)),
               mock.patch.object(sm90, "kv_tensor_map", lambda *a, **k: bytes(128))):
        stack.enter_context(cm)
    return stack


def test_every_case_plans():
    """Each drawn case plans with the arguments the runner passes (page ids on the host, as the CPU has no
    device); a graph case plans after its group's warm-up, in the group's CUDA-graph wrapper."""
    with _stubbed():
        wrappers, graphs = {}, {}
        for seed in range(1500):
            c = case(seed, fresh_graph_ids=True)
            v = VARIANTS[c.variant]
            batch = host_batch(c, graph_group(c.variant, c.ids) if c.graph else None)
            if c.graph:
                g = graph_group(c.variant, c.ids)
                if g.key not in graphs:
                    graphs[g.key] = make_wrapper(v, 132, g)
                    warm = warmup_case(g)
                    plan(graphs[g.key], warm, host_batch(warm, g), plan_table(warm, host_batch(warm, g), CPU), None)
                wrapper = graphs[g.key]
            else:
                key = (c.variant, c.num_sms)
                wrapper = wrappers.setdefault(key, make_wrapper(v, c.num_sms or 132))
            masks = masks_of(c)
            mask_arg = mask_argument(masks, c.mask_form, CPU) if masks is not None else None
            try:
                plan(wrapper, c, batch, plan_table(c, batch, CPU), mask_arg)
            except Exception as exc:
                raise AssertionError(f"{summary(c)}: {type(exc).__name__}: {exc}") from exc


def _small(c) -> bool:
    return len(c.kv_lens) <= 4 and max(c.kv_lens) <= 300 and c.num_qo_heads <= 8 and VARIANTS[c.variant].spec.head_dim <= 128


def test_small_cases_agree_with_the_cpu_executor():
    """The case's inputs as the runner builds them (pool views, NaN in unowned slots, both page-table forms),
    planned as the kernels plan them and run by the CPU executor, equal the reference; nothing reads a NaN."""
    pools = Pools(CPU, q_elements=1 << 20, kv_elements=1 << 22)
    picked = [c for c in (case(s) for s in range(3000)) if _small(c) and not c.graph][:16]
    assert len({VARIANTS[c.variant].backend for c in picked}) == 3
    for c in picked:
        v = VARIANTS[c.variant]
        batch = host_batch(c)
        n = int(batch.qo_indptr[-1])
        q = q_view(pools, c, n)
        kv, k, vv = kv_views(pools, c, batch.pages)
        fill(c, batch, q, k, vv, n)
        masks, table, runtime = masks_of(c), reference_table(c, batch), dict(c.runtime)
        ref, ref_lse = reference_attention(v.spec, q, kv, qo_indptr=batch.qo_indptr, custom_mask=masks, **table,
                                           **runtime)
        assert not torch.isnan(ref).any() and not torch.isnan(ref_lse).any(), summary(c)
        got, got_lse = run_plan(_plan(c, v, batch), v.spec, q, kv, custom_mask=masks, **table, **runtime)
        assert torch.equal(got_lse.isneginf(), ref_lse.isneginf()), summary(c)
        finite = ref_lse.isfinite()
        assert float((got - ref).abs().sum()) < 1e-9 * max(got.numel(), 1), summary(c)
        assert float((got_lse[finite] - ref_lse[finite]).abs().sum()) < 1e-9 * max(got.numel(), 1), summary(c)


def _plan(c, v, batch):
    heads = {"num_qo_heads": c.num_qo_heads, "num_kv_heads": c.num_kv_heads}
    if v.decode:
        cfg = family("decode").launch(family("decode").project(v.spec))
        return plan_decode(batch.kv_lens, tile_rows=cfg.tile_q, kv_granularity=cfg.tile_kv, num_sms=c.num_sms or 132,
                           enable_split=c.enable_split, **heads)
    op, spec = kernels(v, (9, 0))[-1]
    cfg = family(op).launch(family(op).project(spec))
    return plan_prefill(batch.qo_indptr, batch.kv_lens, tile_rows=cfg.tile_q, kv_granularity=cfg.tile_kv,
                        num_sms=c.num_sms or 132, enable_split=c.enable_split and op == "prefill", **heads)


def test_regressions_file_and_recording(tmp_path, monkeypatch):
    entries = cli.load_regressions()
    assert isinstance(entries, list)
    for e in entries:  # every recorded seed still makes a case
        case(e["seed"], e.get("fresh_graph_ids", False))
    path = tmp_path / "regressions.json"
    path.write_text(json.dumps({"cases": []}))
    monkeypatch.setattr(cli, "REGRESSIONS", path)
    monkeypatch.setattr(cli.load_regressions, "__defaults__", (path,))
    failed = [{"seed": 5, "status": "mismatch", "summary": summary(case(5)), "error": "out: max |out - fp64| ..."}]
    cli.record_regressions(failed, False, [path])
    cli.record_regressions(failed, False, [path])  # once a seed
    cli.record_regressions(failed, True, [path])  # and fresh flag
    got = json.loads(path.read_text())["cases"]
    assert [(e["seed"], e["fresh_graph_ids"]) for e in got] == [(5, False), (5, True)]


def test_build_plan_lists_the_kernels(tmp_path):
    path = tmp_path / "plan.json"
    assert cli.main(["--cases", "300", "--build-plan", str(path)]) == 0
    plan_items = json.loads(path.read_text())
    assert plan_items and {item["op"] for item in plan_items} <= {"decode", "prefill", "prefill_sm90", "rope_gather"}


class CpuRunner(Runner):
    """The runner on the CPU, wrappers stubbed: the stand-in kernel writes the fp64 reference of the planned case,
    rounded to the output dtype, and a "graph" replays by running the captured call again. What it checks is the
    runner's side: inputs, page ids of every placement, graph groups, and the comparison."""

    def __init__(self, corrupt: bool = False):
        super().__init__(CPU, Pools(CPU, q_elements=1 << 21, kv_elements=1 << 24))
        self.corrupt = corrupt

    def launch(self, wrapper, q, kv, out):
        c, batch = self.current
        spec = VARIANTS[c.variant].spec
        rows, n = q.shape[0], int(batch.qo_indptr[-1])
        out = torch.full((rows, q.shape[1], spec.head_dim_vo), float("nan"), dtype=q.dtype) if out is None else out
        lse = torch.full((rows, q.shape[1]), float("nan"))
        if c.seed < WARMUP_SEED:  # a warm-up's output is never checked (and its batch is the largest)
            ref, ref_lse = reference_attention(spec, q[:n], kv, qo_indptr=batch.qo_indptr, custom_mask=masks_of(c),
                                               **reference_table(c, batch), **dict(c.runtime))
            out[:n], lse[:n] = ref.to(out.dtype), ref_lse.float()
            if self.corrupt and n:
                out[n - 1, 0, 0] += 1.0
        return out, lse

    def capture(self, run):
        out, lse = run()
        return _Replayer(self, out, lse), (out, lse)


class _Replayer:
    """A captured "graph" of ``CpuRunner``: replay recomputes the current case into the captured out and lse."""

    def __init__(self, runner, out, lse):
        self.runner, self.out, self.lse = runner, out, lse

    def replay(self):
        c, batch = self.runner.current
        state = self.runner._graphs[graph_group(c.variant, c.ids).key]
        _, lse = self.runner.launch(None, state.q, state.kv, self.out)
        self.lse.copy_(lse)


def _cheap_group(c) -> bool:
    g = graph_group(c.variant, c.ids)
    spec = VARIANTS[c.variant].spec
    page = spec.kv_layout.page_size if VARIANTS[c.variant].paged else 1
    return g.pool * page * g.num_kv_heads * spec.head_dim <= 1 << 24 and g.max_total_q * g.group * g.num_kv_heads \
        * spec.head_dim <= 1 << 21


def test_runner_on_the_cpu():
    """Runner.run end to end with the CUDA calls stubbed: every status "ok" for eager cases of every backend and
    for graph cases of every page-id placement (reused, fresh, host, ragged); a wrong output is a mismatch."""
    eager = [c for c in (case(s) for s in range(2000)) if _small(c) and not c.graph][:8]
    graph = [c for c in (case(s, fresh_graph_ids=True) for s in range(6000)) if c.graph and _cheap_group(c)
             and sum(q * k for q, k in zip(c.qo_lens, c.kv_lens)) * c.num_qo_heads <= 1 << 18]
    picked, seen = [], set()
    for c in graph:  # two cases of each placement
        if sum(1 for p in picked if p.ids == c.ids) < 2:
            picked.append(c)
            seen.add(c.ids)
    assert seen == {"reused", "fresh", "host", "none"}, seen
    with _stubbed(), mock.patch.object(wrapper_module, "device_sms", lambda index: 132):
        runner = CpuRunner()
        for c in eager + picked:
            result = runner.run(c)
            assert result["status"] == "ok", (result["summary"], result["error"])
        assert len(runner._graphs) >= 4
        bad = CpuRunner(corrupt=True).run(next(c for c in eager if sum(c.qo_lens)))
        assert bad["status"] == "mismatch" and bad["error"].startswith("out: max |out - fp64|"), bad


def test_workers_account_for_every_seed():
    """run_workers: every seed reported once, a worker that reports a fatal case or dies inside one is replaced,
    and a case whose worker died without reporting it is reported as fatal."""
    seeds = list(range(40))
    got = []
    with mock.patch.object(cli, "case", lambda seed, fresh=False: case(seed)):
        cli.run_workers(seeds, 3, False, None, got.append, target=worker_stub.worker)
    assert sorted(r["seed"] for r in got) == seeds
    for r in got:
        kind = worker_stub.outcome(r["seed"])
        assert r["status"] == ("ok" if kind == "ok" else "fatal"), r
        if kind == "crash":
            assert "worker process died (exit code 1)" in r["error"]
