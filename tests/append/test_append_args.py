"""append_kv's argument checks on the CPU: "device" tensors are CPU tensors that say they are CUDA ones and the
kernel a fake (tests/stub_cuda.py), so each bad argument must raise a named error before any launch, and good
ones reach the launch with the right grid and fields."""

from unittest import mock

import pytest
import torch

import flashgen
from flashgen import Llama31Scaling, RoPE, SpecError
from flashgen.api import append as append_api

from stub_cuda import fake_build, on_device

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
T, H, D, PAGES, PS = 5, 2, 128, 4, 16


@pytest.fixture(autouse=True)
def stubbed():
    launches = []

    class Recorder:
        def launch(self, grid, block, smem, stream, *values):
            launches.append((grid, block, values))

    def build(spec, op, device=None, arch=None, options=None):
        kernel = fake_build(spec, op, device, arch, options)
        kernel.functions["append_kv"] = Recorder()
        return kernel

    with mock.patch("flashgen.jit.build", build), mock.patch.object(append_api, "current_stream", lambda i: 0), \
            mock.patch.dict(append_api._kernels, clear=True):
        yield launches


def dev(*shape, dtype=BF16):
    return on_device(torch.zeros(*shape, dtype=dtype))


def ints(values, dtype=torch.int32):
    return on_device(torch.tensor(values, dtype=dtype))


def good(**changes):
    args = dict(k=dev(T, H, D), v=dev(T, H, D), kv_cache=dev(PAGES, 2, PS, H, D), kv_indptr=ints([0, 2, 4]),
                kv_indices=ints([0, 1, 2, 3]), batch_indices=ints([0, 0, 1, 1, 1]), positions=ints([0, 1, 2, 3, 4]))
    args.update(changes)
    return {name: value for name, value in args.items() if value is not DROP}


DROP = object()


def call(**changes):
    args = good(**changes)
    flashgen.append_kv(args.pop("k"), args.pop("v"), args.pop("kv_cache"), **args)


def test_good_calls_launch_once_with_the_grid_of_their_rows(stubbed):
    call()
    call(kv_cache=(dev(PAGES, H, PS, D, dtype=E4M3), dev(PAGES, H, PS, D, dtype=E4M3)), kv_layout="HND",
         rope=RoPE(500000.0), rope_scaling=Llama31Scaling(), k_scale=0.5, v_scale=2.0)
    call(kv_indptr=DROP, kv_indices=DROP, batch_indices=DROP, slot_mapping=ints([0, 17, -1, 3, 4], torch.int64),
         positions=ints([0, 1, 2, 3, 4], torch.int64), cos_sin_cache=dev(64, D, dtype=torch.float32))
    qkv = dev(T, 3 * H, D)  # k and v as slices of a fused projection: strided rows
    call(k=on_device(qkv[:, H: 2 * H]), v=on_device(qkv[:, 2 * H:]))
    call(k=dev(0, H, D), v=dev(0, H, D), batch_indices=ints([]), positions=ints([]))  # nothing to write
    assert [(grid, block) for grid, block, _ in stubbed] == [((1, 1, 1), (128, 1, 1))] * 4
    fp8 = stubbed[1][2]
    assert 0.5 * 2.0 in fp8 and 2.0 in fp8  # 1/k_scale, 1/v_scale among the fields


def test_per_head_scales_are_device_tensors(stubbed):
    fp8 = dev(PAGES, 2, PS, H, D, dtype=E4M3)
    call(kv_cache=fp8, k_scale=dev(H, dtype=torch.float32), v_scale=dev(H, dtype=torch.float32))
    call(kv_cache=fp8, k_scale=dev(1, dtype=torch.float32), v_scale=dev(1, dtype=torch.float32))
    assert len(stubbed) == 2


F8 = dict(kv_cache=dev(PAGES, 2, PS, H, D, dtype=E4M3))


@pytest.mark.parametrize("changes,error,match", [
    (dict(k=torch.zeros(T, H, D, dtype=BF16)), ValueError, "k: expected a CUDA tensor"),
    (dict(k=dev(T, H, D, dtype=torch.float32)), TypeError, "k: expected dtype"),
    (dict(k=dev(T, D)), ValueError, "k: expected 3 dimensions"),
    (dict(v=dev(T, H, D, dtype=torch.float16)), TypeError, "v: expected dtype"),
    (dict(v=dev(T + 1, H, D)), ValueError, "v: expected shape"),
    (dict(k=on_device(dev(T, H, 2 * D)[..., ::2])), ValueError, "k: rows must be contiguous"),
    (dict(k=dev(T, H, D), v=dev(T, H, D)), None, None),
    (dict(k=dev(T, H, 96), v=dev(T, H, 96), kv_cache=dev(PAGES, 2, PS, H, 96)), SpecError, "head_dim"),
    (dict(kv_cache=dev(PAGES, PS, H, D)), ValueError, r"kv_cache: expected one \[pages, 2"),
    (dict(kv_cache=[dev(PAGES, PS, H, D)]), ValueError, "kv_cache: expected a .k_cache, v_cache. pair"),
    (dict(kv_cache="cache"), TypeError, "kv_cache: expected a tensor"),
    (dict(kv_cache=dev(PAGES, 2, PS, H + 1, D)), ValueError, "num_kv_heads = 2"),
    (dict(kv_cache=dev(PAGES, 2, PS, H, D, dtype=torch.float16)), TypeError, "kv_cache: dtype"),
    (dict(kv_cache=(dev(PAGES, PS, H, D), dev(PAGES, PS + 1, H, D))), ValueError, "share dtype, shape"),
    (dict(kv_cache=dev(PAGES, 2, PS, H, D), kv_layout="HDN"), ValueError, "kv_layout"),
    (dict(kv_cache=dev(PAGES, 2, PS, H, D), kv_layout="HND"), ValueError, r"\(HND\)"),
    (dict(kv_indptr=DROP), ValueError, "kv_indptr: append_kv takes slot_mapping"),
    (dict(positions=DROP), ValueError, "kv_indptr: append_kv takes slot_mapping"),
    (dict(kv_indptr=ints([0, 2, 4], torch.int64)), TypeError, "kv_indptr: expected dtype"),
    (dict(kv_indptr=ints([])), ValueError, "kv_indptr: expected shape"),
    (dict(kv_indices=ints([[0, 1, 2, 3]])), ValueError, "kv_indices: expected 1 dimensions"),
    (dict(kv_last_page_len=ints([1, 2, 3])), ValueError, "kv_last_page_len: expected shape"),
    (dict(batch_indices=ints([0, 0, 1])), ValueError, r"batch_indices: expected shape \(5,\)"),
    (dict(batch_indices=dev(T, dtype=torch.float32)), TypeError, "batch_indices: expected dtype"),
    (dict(positions=ints([0, 1, 2, 3, 4], torch.int64)), TypeError, "positions: expected dtype torch.int32"),
    (dict(slot_mapping=ints([0, 1, 2, 3, 4])), ValueError, "slot_mapping: give slot_mapping"),
    (dict(kv_indptr=DROP, kv_indices=DROP, batch_indices=DROP, positions=DROP, slot_mapping=ints([0, 1, 2, 3, 4]),
          rope=RoPE()), ValueError, "positions: RoPE"),
    (dict(rope=10000.0), TypeError, "rope: expected None or flashgen.RoPE"),
    (dict(rope_scaling=Llama31Scaling()), ValueError, "rope_scaling: scales"),
    (dict(rope=RoPE(), rope_scaling={"factor": 8}), TypeError, "rope_scaling: expected"),
    (dict(rope=RoPE(), cos_sin_cache=dev(8, D, dtype=torch.float32)), ValueError, "cos_sin_cache: give rope"),
    (dict(cos_sin_cache=dev(8, D, dtype=BF16)), TypeError, "cos_sin_cache: expected dtype"),
    (dict(cos_sin_cache=dev(8, D // 2, dtype=torch.float32)), ValueError, "partial rotary"),
    (dict(k_scale=0.5), ValueError, "k_scale: scales quantise to an fp8 cache"),
    (dict(F8, k_scale=-1.0), ValueError, "k_scale: got -1.0"),
    (dict(F8, v_scale=float("nan")), ValueError, "v_scale: got nan"),
    (dict(F8, k_scale=dev(H, dtype=torch.float32), v_scale=1.0), ValueError, "both as floats or both as tensors"),
    (dict(F8, k_scale=dev(H + 1, dtype=torch.float32), v_scale=dev(H + 1, dtype=torch.float32)), ValueError,
     r"k_scale: expected shape \(2,\)"),
    (dict(F8, k_scale=dev(H, dtype=torch.float16), v_scale=dev(H, dtype=torch.float16)), TypeError,
     "k_scale: expected dtype"),
    (dict(F8, k_scale=dev(H, dtype=torch.float32), v_scale=dev(1, dtype=torch.float32)), ValueError,
     "v_scale: expected k_scale's shape"),
])
def test_bad_arguments_raise_named_errors_before_any_launch(stubbed, changes, error, match):
    if error is None:
        call(**changes)
        return
    with pytest.raises(error, match=match):
        call(**changes)
    assert not stubbed
