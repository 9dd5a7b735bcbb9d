"""BatchPrefillWrapper's backends: which one runs a spec (CPU tests, the capability passed in or patched), and
on a Hopper GPU the sm90 backend behind the wrapper's whole API against the fp64 reference (fresh random
inputs, NaN-poisoned outputs): lengths straddling its 128-row q tiles and 64/128-token KV tiles, CUDA-graph
replay after re-planning, flashgen.attention(), and the argument checks it shares with the portable backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Causal, CustomMask, Llama31Scaling, NoMask, Paged, Ragged, RoPE, SpecError
from flashgen.api.backends import select as _select_backend
from flashgen.plan import PlanError
from flashgen.testing.check import assert_matches_reference, check_attention
from flashgen.testing.layouts import random_batch
from graph_replay import REPLAN_BATCHES, fill_pools, replay_after_replanning

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
on_hopper = [pytest.mark.cuda, pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a)")]

ELIGIBLE = [AttentionSpec(d, dtype=dtype, kv_layout=Ragged(), mask=mask)
            for d, dtype, mask in ((64, "bfloat16", Causal()), (128, "bfloat16", NoMask()),
                                   (128, "float16", Causal()), (256, "bfloat16", Causal()))]
ELIGIBLE_MASKS = [AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask()),
                  AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask())]
ELIGIBLE_GATHERED = [  # page sizes no TMA box takes: gathered by the producer warps
    AttentionSpec(128, kv_layout=Paged(1), mask=Causal()),
    AttentionSpec(128, kv_layout=Paged(24, "HND"), mask=NoMask()),
    AttentionSpec(256, kv_layout=Paged(96), mask=CustomMask()),
]
PORTABLE_ONLY = [  # sm90 takes any page size now: head dims are what it refuses
    AttentionSpec(192, head_dim_vo=128, kv_layout=Ragged(), mask=Causal()),
    AttentionSpec(128, head_dim_vo=64, kv_layout=Paged(1)),
]


CUDA0 = torch.device("cuda", 0)  # a device object: an int would ask torch for the accelerator


def hopper(test):
    for mark in on_hopper:
        test = mark(test)
    return test


# ---------------------------------------------------------------------------------------------- selection (CPU)


@pytest.mark.parametrize("spec", ELIGIBLE + ELIGIBLE_MASKS + ELIGIBLE_GATHERED, ids=lambda s: s.uri)
def test_auto_picks_sm90_on_hopper_only(spec):
    assert _select_backend(spec, "auto", (9, 0)) == "sm90"
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0), (9, 1)):
        assert _select_backend(spec, "auto", capability) == "portable"
    assert _select_backend(spec, "portable", (9, 0)) == "portable"
    assert _select_backend(spec, "sm90", (9, 0)) == "sm90"


@pytest.mark.parametrize("spec", PORTABLE_ONLY, ids=lambda s: s.uri)
def test_auto_falls_back_for_what_sm90_does_not_run(spec):
    def no_device():
        raise AssertionError("the capability is not needed to refuse this spec")

    assert _select_backend(spec, "auto", no_device) == "portable"
    assert _select_backend(spec, "portable", no_device) == "portable"
    with pytest.raises(SpecError, match=r"^backend: 'sm90' cannot run this spec \("):
        _select_backend(spec, "sm90", no_device)


def test_rope_runs_sm90_outside_cuda_graphs():
    """RoPE on sm90 is a pre-pass (rope_gather) plus the kernel of the ragged twin; not graph-safe yet."""
    for layout in (Ragged(), Paged(16)):
        spec = AttentionSpec(128, kv_layout=layout, mask=Causal(), pos_encoding=RoPE())
        assert _select_backend(spec, "auto", (9, 0)) == "sm90"
        assert _select_backend(spec, "auto", (9, 0), graph=True) == "portable"
        with pytest.raises(SpecError, match=r"^backend: 'sm90' cannot run this spec \(pos_encoding: RoPE .*CUDA-graph"):
            _select_backend(spec, "sm90", (9, 0), graph=True)


def test_sm90_needs_compute_capability_9_0():
    with pytest.raises(ValueError, match=r"^backend: 'sm90' needs a GPU of compute capability 9.0.* has 8.0"):
        _select_backend(ELIGIBLE[0], "sm90", (8, 0))
    with pytest.raises(ValueError, match=r"^backend: got 'fa3', expected one of 'auto', 'portable', 'sm90'"):
        _select_backend(ELIGIBLE[0], "fa3", (9, 0))


def test_wrapper_refuses_sm90_before_touching_a_device():
    for spec in PORTABLE_ONLY:
        with pytest.raises(SpecError, match=r"^backend: 'sm90' cannot run this spec \(head_dim"):
            flashgen.BatchPrefillWrapper(spec, backend="sm90")
    with pytest.raises(ValueError, match="^backend: got 'fa2'"):
        flashgen.BatchPrefillWrapper(ELIGIBLE[0], backend="fa2")


@pytest.mark.parametrize("capability,expected", [((9, 0), "sm90"), ((8, 0), "portable")])
def test_wrapper_backend_follows_the_device(monkeypatch, capability, expected):
    """Built with a patched capability query: no device memory is touched before the first plan()."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    wrapper = flashgen.BatchPrefillWrapper(ELIGIBLE[1], device=CUDA0, num_sms=132)
    assert wrapper.backend == expected and asked == [CUDA0]
    forced = flashgen.BatchPrefillWrapper(ELIGIBLE[1], device=CUDA0, num_sms=132, backend="portable")
    assert forced.backend == "portable"
    assert flashgen.BatchPrefillWrapper(PORTABLE_ONLY[0], device=CUDA0, num_sms=132).backend == "portable"
    if expected == "portable":
        with pytest.raises(ValueError, match="^backend: 'sm90' needs a GPU of compute capability 9.0"):
            flashgen.BatchPrefillWrapper(ELIGIBLE[1], device=CUDA0, num_sms=132, backend="sm90")


def test_auto_keeps_the_portable_errors_for_specs_neither_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(SpecError, match="^kv_dtype"):
        flashgen.BatchPrefillWrapper(AttentionSpec(128, kv_dtype="float16"), device=CUDA0, num_sms=132)
    with pytest.raises(SpecError, match="^head_dim"):
        flashgen.BatchPrefillWrapper(AttentionSpec(96), device=CUDA0, num_sms=132)


# ---------------------------------------------------------------------------------------------- sm90 (GPU)

# (qo_len, kv_len): empty requests both ways, one token, append (qo < kv), qo = kv, tile boundaries +- 1
QO = [0, 1, 17, 65, 64, 3, 130, 5, 129]
KV = [5, 1, 17, 300, 64, 0, 130, 0, 257]


def make_batch(spec, qo_lens, kv_lens, num_kv_heads, group, seed=0, extra_rows=0):
    """A random ragged batch (CPU); ``extra_rows`` finite rows after the last request's K / V (a larger pool)."""
    gen = torch.Generator().manual_seed(seed)
    q, (k, v), table = random_batch(spec, qo_lens, kv_lens, num_kv_heads, group, generator=gen)
    if extra_rows:
        k, v = (torch.cat([x, torch.randn(extra_rows, *x.shape[1:], generator=gen).to(x.dtype)]) for x in (k, v))
    return q, (k, v), np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32), table["kv_indptr"].numpy()


def run_and_check(wrapper, qo_lens, kv_lens, num_kv_heads, group, seed=0, extra_rows=0, **runtime):
    spec = wrapper.spec
    q, kv, qo_indptr, kv_indptr = make_batch(spec, qo_lens, kv_lens, num_kv_heads, group, seed, extra_rows)
    wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
                 **runtime)
    q_gpu, kv_gpu = q.cuda(), tuple(x.cuda() for x in kv)
    runtime.pop("enable_split", None)  # a planning choice, not a runtime value of the attention
    check_attention(lambda out: wrapper.run(q_gpu, kv_gpu, out=out, return_lse=True), spec, q, kv,
                    qo_indptr=qo_indptr, kv_indptr=kv_indptr, **runtime)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_soft_cap_must_be_positive(cap):
    """The kernels divide by the cap (sm90 folds 1 / cap into the scale): a zero, negative or NaN cap is refused
    at plan time, naming the argument."""
    from flashgen.api.wrapper import runtime_values as _runtime

    spec = AttentionSpec(128, kv_layout=Ragged(), soft_cap=30.0)
    assert _runtime(spec, None, None, None, None, None).soft_cap == 30.0
    assert _runtime(spec, None, None, None, None, 5.0).soft_cap == 5.0
    with pytest.raises(PlanError, match="^soft_cap: got"):
        _runtime(spec, None, None, None, None, cap)


@hopper
@pytest.mark.parametrize("spec", ELIGIBLE, ids=lambda s: s.uri)
def test_auto_runs_sm90(spec):
    wrapper = flashgen.BatchPrefillWrapper(spec)
    assert wrapper.backend == "sm90"
    run_and_check(wrapper, QO, KV, 2, 4)
    # K / V longer than the batch (the tensor maps are bounded by the tensors, not by kv_indptr[-1])
    run_and_check(wrapper, [70, 5, 200], [70, 300, 190], 2, 3, seed=1, extra_rows=77, sm_scale=0.3)


@hopper
def test_replanning_heads_and_caches():
    """One wrapper, re-planned for other head counts and other caches: the memo of validated caches is keyed
    by their shapes and the planned kv heads."""
    wrapper = flashgen.BatchPrefillWrapper(ELIGIBLE[1])
    run_and_check(wrapper, [33, 0, 200, 1, 97], [90, 4, 200, 1, 97], 2, 4)
    run_and_check(wrapper, [33, 0, 200, 1, 97], [90, 4, 200, 1, 97], 1, 7, seed=2)
    run_and_check(wrapper, [1000], [1000], 2, 1, seed=3, enable_split=False)


@hopper
@pytest.mark.parametrize("rope", [None, RoPE(k_rotated=True, scaling=Llama31Scaling())], ids=["nopos", "krot"])
def test_cuda_graph_replay_after_replanning(rope):
    """With a cache of rotated K the sm90 kernel turns q itself (no pre-pass), so RoPE runs in the graph too."""
    spec = ELIGIBLE[2].replace(pos_encoding=rope)  # d128 fp16 causal
    max_batch, max_q, max_kv, heads, group = 8, 700, 4000, 2, 4
    wrapper = flashgen.BatchPrefillWrapper(spec, use_cuda_graph=True, max_batch_size=max_batch, max_total_q=max_q)
    assert wrapper.backend == "sm90"
    pool_q = torch.zeros(max_q, heads * group, 128, dtype=torch.float16, device="cuda")
    pool_kv = tuple(torch.zeros(max_kv, heads, 128, dtype=torch.float16, device="cuda") for _ in range(2))

    def load(qo_lens, kv_lens, seed):
        q, kv, qo_indptr, kv_indptr = make_batch(spec, qo_lens, kv_lens, heads, group, seed)
        fill_pools(pool_q, pool_kv, q, kv)
        wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=heads * group, num_kv_heads=heads)
        return q, kv, qo_indptr, kv_indptr

    def check_replay(loaded, out, lse):
        q, kv, qo_indptr, kv_indptr = loaded
        n = q.shape[0]
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=qo_indptr, kv_indptr=kv_indptr)

    out, _ = replay_after_replanning(lambda: wrapper.run(pool_q, pool_kv, return_lse=True), load, check_replay,
                                     ([100, 3], [2000, 50], 0),
                                     [(*b, seed) for seed, b in enumerate(REPLAN_BATCHES, start=1)])
    assert out.shape == (max_q, heads * group, 128)
    with pytest.raises(PlanError, match="max_batch_size"):
        load([1] * 9, [1] * 9, 0)


@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_attention_one_shot_runs_sm90(causal):
    from flashgen.api.prefill import _WRAPPERS

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
    k, v = (torch.randn(700, 2, 128, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True)
    spec = AttentionSpec(128, kv_layout=Ragged(), mask=Causal() if causal else NoMask())
    assert _WRAPPERS[(spec, q.device.index)].backend == "sm90"
    assert_matches_reference(spec, q.cpu(), (k.cpu(), v.cpu()), out, lse, qo_indptr=[0, 300], kv_indptr=[0, 700])


@hopper
def test_sm90_keeps_the_wrappers_argument_checks():
    spec = ELIGIBLE[1]
    wrapper = flashgen.BatchPrefillWrapper(spec)
    assert wrapper.backend == "sm90"
    q, kv, qo_indptr, kv_indptr = make_batch(spec, [10, 20], [40, 100], 2, 4)
    q, kv = q.cuda(), tuple(x.cuda() for x in kv)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(q, kv)
    table = {"kv_indptr": kv_indptr, "num_qo_heads": 8, "num_kv_heads": 2}
    with pytest.raises(PlanError, match="qo_indptr"):
        wrapper.plan(qo_indptr=[0, 10], **table)
    with pytest.raises(PlanError, match="num_qo_heads"):
        wrapper.plan(qo_indptr=qo_indptr, **{**table, "num_qo_heads": 7})
    with pytest.raises(PlanError, match="custom_mask: this spec's mask is not CustomMask"):
        wrapper.plan(qo_indptr=qo_indptr, custom_mask=torch.zeros(4, dtype=torch.uint8), **table)
    with pytest.raises(PlanError, match="soft_cap"):
        wrapper.plan(qo_indptr=qo_indptr, soft_cap=5.0, **table)
    with pytest.raises(PlanError, match="kv_indptr"):
        wrapper.plan(qo_indptr=qo_indptr, kv_indices=[0], **table)
    wrapper.plan(qo_indptr=qo_indptr, **table)
    with pytest.raises(ValueError, match="^q: expected shape"):
        wrapper.run(q[:5], kv)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        wrapper.run(q.half(), kv)
    with pytest.raises(ValueError, match=r"^kv_cache \(k\): expected shape"):
        wrapper.run(q, (kv[0][:, :1], kv[1][:, :1]))
    with pytest.raises(ValueError, match=r"^kv_cache: 139 tokens, fewer than kv_indptr\[-1\] = 140"):
        wrapper.run(q, (kv[0][:139], kv[1][:139]))
    with pytest.raises(ValueError, match="^out: expected shape"):
        wrapper.run(q, kv, out=torch.empty_like(q)[:7])
    with pytest.raises(TypeError, match="^out: expected dtype"):
        wrapper.run(q, kv, out=torch.empty_like(q, dtype=torch.float16))
    out = wrapper.run(q, kv)
    torch.cuda.synchronize()
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
