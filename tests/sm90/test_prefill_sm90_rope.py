"""GPU tests of RoPE on the Hopper prefill (the rope_gather pre-pass rotates q and K and copies V into ragged
scratch, then the sm90 kernel of the spec's ragged twin runs) against the fp64 reference: fresh random inputs,
NaN-poisoned outputs, ragged and paged KV (NaN in every slot no request owns), append (qo < kv) and qo = kv."""

from __future__ import annotations

import pytest

from flashgen import AttentionSpec, Causal, NoMask, Paged, Ragged, RoPE, SlidingWindow

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
