import pytest
import torch

from flashgen.spec import (
    ALiBi, AttentionSpec, BlockSparse, Causal, CustomMask, MergeSpec, NoMask, Paged, Ragged, RoPE, SlidingWindow,
    SpecError, spec_from_dict, spec_to_dict,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"head_dim": 100}, "head_dim"),
        ({"head_dim": 128, "head_dim_vo": 48}, "head_dim_vo"),
        ({"head_dim": 128, "dtype": "float32"}, "dtype"),
        ({"head_dim": 128, "kv_dtype": "int8"}, "kv_dtype"),
        ({"head_dim": 128, "kv_layout": "paged"}, "kv_layout"),
        ({"head_dim": 128, "kv_layout": Paged(0)}, "kv_layout.page_size"),
        ({"head_dim": 128, "kv_layout": Paged(16, "NDH")}, "kv_layout.order"),
        ({"head_dim": 128, "kv_layout": BlockSparse(0, 16)}, "kv_layout.block_q"),
        ({"head_dim": 128, "mask": "causal"}, "mask"),
        ({"head_dim": 128, "mask": SlidingWindow(-1)}, "mask.left"),
        ({"head_dim": 128, "pos_encoding": "rope"}, "pos_encoding"),
        ({"head_dim": 128, "pos_encoding": RoPE(theta=0)}, "pos_encoding.theta"),
        ({"head_dim": 128, "soft_cap": 0.0}, "soft_cap"),
        ({"head_dim": 128, "soft_cap": float("inf")}, "soft_cap"),
        ({"head_dim": 128, "sm_scale": -1.0}, "sm_scale"),
        ({"head_dim": 128.0}, "head_dim"),
        ({"head_dim": True}, "head_dim"),
        ({"head_dim": 128, "head_dim_vo": 128.0}, "head_dim_vo"),
        ({"head_dim": 128, "kv_layout": Paged(16.0)}, "kv_layout.page_size"),
        ({"head_dim": 128, "kv_layout": Paged(True)}, "kv_layout.page_size"),
        ({"head_dim": 128, "mask": SlidingWindow(4.0)}, "mask.left"),
        ({"head_dim": 128, "pos_encoding": RoPE(theta=float("inf"))}, "pos_encoding.theta"),
        ({"head_dim": 128, "pos_encoding": RoPE(theta=float("nan"))}, "pos_encoding.theta"),
        ({"head_dim": 128, "pos_encoding": RoPE(scale=float("inf"))}, "pos_encoding.scale"),
        ({"head_dim": 128, "pos_encoding": RoPE(scale=-2.0)}, "pos_encoding.scale"),
        ({"head_dim": 128, "sm_scale": float("nan")}, "sm_scale"),
    ],
)
def test_invalid_specs_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as info:
        AttentionSpec(**kwargs)
    assert str(info.value).startswith(f"{field}:"), str(info.value)
    assert "expected" in str(info.value)


@pytest.mark.parametrize("page_size", [1, 3, 16, 48, 256, 1000])
def test_any_page_size_is_valid(page_size):
    spec = AttentionSpec(128, kv_layout=Paged(page_size))
    assert f"paged{page_size}nhd" in spec.uri


def test_equivalent_specs_are_equal_and_share_a_uri():
    a = AttentionSpec(128)
    b = AttentionSpec(128, 128, torch.bfloat16, "bf16", Paged(16, "NHD"), NoMask(), None)
    assert a == b and hash(a) == hash(b) and a.uri == b.uri


def test_numpy_numbers_are_stored_as_plain_ones():
    import numpy as np

    spec = AttentionSpec(np.int64(128), kv_layout=Paged(np.int32(16)), mask=SlidingWindow(np.int16(64)),
                         pos_encoding=RoPE(np.float32(500000.0), np.int64(2)), soft_cap=np.float32(30.0))
    plain = AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(64), pos_encoding=RoPE(500000.0, 2.0),
                          soft_cap=30.0)
    assert spec == plain and hash(spec) == hash(plain) and spec.uri == plain.uri == AttentionSpec(
        128, kv_layout=Paged(16), mask=SlidingWindow(64), pos_encoding=RoPE(), soft_cap=1.0).uri
    assert type(spec.head_dim) is int and type(spec.kv_layout.page_size) is int and "128.0" not in spec.uri
    assert spec_from_dict(spec_to_dict(spec)) == plain


def test_runtime_numbers_do_not_change_the_uri():
    base = AttentionSpec(128, mask=SlidingWindow(128), pos_encoding=RoPE(10000.0), soft_cap=30.0, sm_scale=0.1)
    other = base.replace(mask=SlidingWindow(4096), pos_encoding=RoPE(500000.0, 8.0), soft_cap=50.0, sm_scale=0.2)
    assert base != other
    assert base.uri == other.uri
    assert base.kernel_fields() == other.kernel_fields()


def test_structural_fields_change_the_uri():
    base = AttentionSpec(128)
    variants = [
        base.replace(head_dim=64, head_dim_vo=64), base.replace(head_dim_vo=64), base.replace(dtype="float16"),
        base.replace(kv_dtype="float8_e4m3fn"), base.replace(kv_layout=Paged(17)),
        base.replace(kv_layout=Paged(16, "HND")), base.replace(kv_layout=Ragged()),
        base.replace(kv_layout=BlockSparse(64, 64)), base.replace(mask=Causal()), base.replace(mask=CustomMask()),
        base.replace(mask=SlidingWindow(3)), base.replace(pos_encoding=RoPE()), base.replace(pos_encoding=ALiBi()),
        base.replace(soft_cap=30.0),
    ]
    uris = {v.uri for v in variants} | {base.uri}
    assert len(uris) == len(variants) + 1


def test_spec_dict_round_trip():
    spec = AttentionSpec(192, 128, "float16", "e5m2", Paged(5, "HND"), SlidingWindow(7), RoPE(1e6, 2.0), 30.0, 0.05)
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert spec_from_dict(spec_to_dict(MergeSpec("bf16"))) == MergeSpec("bfloat16")
    with pytest.raises(SpecError, match="kv_layout.type"):
        spec_from_dict({"head_dim": 128, "kv_layout": {"type": "Tiled"}})


def test_merge_spec_dtypes():
    assert MergeSpec(torch.float32).uri == "f32"
    with pytest.raises(SpecError, match="dtype"):
        MergeSpec("float8_e4m3fn")
