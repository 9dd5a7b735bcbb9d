"""GPU tests of RoPE on the Hopper prefill against the fp64 reference: over unrotated K the rope_gather pre-pass
rotates q and K and copies V into ragged scratch, then the sm90 kernel of the spec's ragged twin runs; over a cache
of rotated K (``RoPE(k_rotated=True)``) the kernel turns q in shared memory and nothing else runs. Plain, Llama-3.1
and YaRN frequencies; fresh random inputs, NaN-poisoned outputs, ragged and paged KV (NaN in every slot no request
owns), TMA and gathered pages, append (qo < kv) and qo = kv."""

from __future__ import annotations

import pytest

from flashgen import AttentionSpec, Causal, Llama31Scaling, NoMask, Paged, Ragged, RoPE, SlidingWindow, YaRNScaling
from flashgen.api.backends import kernels_for

pytestmark = [pytest.mark.cuda, pytest.mark.hopper]

QO = [37, 0, 130, 1, 64, 200]
KV = [300, 9, 130, 1, 1000, 200]


def check(spec, **kw):
    from test_prefill_sm90_paged import check_ragged, run_and_check  # tests/ is on sys.path

    if isinstance(spec.kv_layout, Ragged):
        check_ragged(spec, QO, KV, **kw)
    else:
        run_and_check(spec, QO, KV, **kw)


@pytest.mark.parametrize("layout", [Ragged(), Paged(16), Paged(64, "HND")], ids=str)
@pytest.mark.parametrize("mask", [NoMask(), Causal(), SlidingWindow(100)], ids=lambda m: type(m).__name__)
def test_layouts_and_masks(layout, mask):
    check(AttentionSpec(128, kv_layout=layout, mask=mask, pos_encoding=RoPE()))


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims_and_groups(d):
    check(AttentionSpec(d, dtype="float16", kv_layout=Paged(32), mask=Causal(), pos_encoding=RoPE()), group=7, seed=d)


def test_runtime_theta_scale_and_block_table():
    spec = AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=RoPE(theta=500000.0))
    check(spec, form="block_table", device_ids=True, rope_theta=10000.0, rope_scale=4.0)


# YaRN with a short original context, so that its ramp crosses the frequencies these positions turn through
SCALINGS = [None, Llama31Scaling(), YaRNScaling(factor=8.0, original_max_position=256)]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("layout", [Ragged(), Paged(16), Paged(5), Paged(64, "HND")], ids=str)
def test_rotated_k_turns_q_in_the_kernel(layout, scaling):
    spec = AttentionSpec(128, kv_layout=layout, mask=Causal(), pos_encoding=RoPE(500000.0, scaling=scaling,
                                                                                  k_rotated=True))
    assert kernels_for(spec, "sm90") == (("prefill_sm90", spec),)  # no pre-pass
    check(spec, seed=3)


@pytest.mark.parametrize("d", [64, 256])
def test_rotated_k_head_dims_and_groups(d):
    spec = AttentionSpec(d, dtype="float16", kv_layout=Paged(32), mask=SlidingWindow(100),
                         pos_encoding=RoPE(k_rotated=True, scaling=Llama31Scaling()))
    check(spec, group=7, seed=d, rope_theta=10000.0, rope_scale=2.0)


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("layout", [Ragged(), Paged(16)], ids=str)
def test_scaled_rope_in_the_pre_pass(layout, scaling):
    check(AttentionSpec(128, kv_layout=layout, mask=Causal(), pos_encoding=RoPE(scaling=scaling)), seed=5)


@pytest.mark.parametrize("layout", [Ragged(), Paged(16)], ids=str)
def test_rotated_k_queries_before_position_zero(layout):
    """More queries than keys: the first queries sit at negative positions (kv_len - qo_len + i) and q turns by
    them too; without a mask each of them sees every key, so a row left unturned would show."""
    from test_prefill_sm90_paged import check_ragged, run_and_check  # tests/ is on sys.path

    spec = AttentionSpec(128, kv_layout=layout, pos_encoding=RoPE(k_rotated=True))
    (check_ragged if isinstance(layout, Ragged) else run_and_check)(spec, [50, 3, 20, 1], [10, 1, 20, 0], seed=11)
