"""Plan uploads (HostStaging) with the CUDA calls stubbed: what lands in the device buffer and the addresses
handed back stay right from plan to plan while the plan's length, the extras and the buffers change (the
upload keeps views and addresses from the last plans of the same shape)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from flashgen.api.staging import DeviceBuffer, HostStaging, extra_offsets
from flashgen.plan import plan_decode

from stub_cuda import stubbed_cuda


def _check_upload(staging, device_buffer, lens, extras):
    plan = staging.plan(lambda host: plan_decode(lens, num_qo_heads=8, num_kv_heads=8, num_sms=16,
                                                 host_buffer=host))
    expected_plan = plan.host[: plan.numel].clone()
    addresses = staging.upload(plan, extras, device_buffer)
    dev = device_buffer.tensor
    base = dev.data_ptr()
    starts, end = extra_offsets(plan.numel, {k: v.size for k, v in extras.items()})
    assert addresses["base"] == base
    assert torch.equal(dev[: plan.numel], expected_plan)
    for name, f in plan.schema.items():
        assert addresses[name] == base + 4 * f.offset
    for name, values in extras.items():
        assert addresses[name] == base + 4 * starts[name]
        assert dev[starts[name]: starts[name] + values.size].tolist() == values.tolist()
    with pytest.raises(TypeError):  # shared between plans of one layout: read-only
        addresses["base"] = -1
    return end


def test_uploads_follow_changing_plans_and_buffers():
    rng = np.random.default_rng(0)
    with stubbed_cuda():
        staging = HostStaging(torch.device("cpu"))
        device_buffer = DeviceBuffer(torch.int32, torch.device("cpu"), fixed=False)
        # same shape (views and addresses kept), new values; then longer plans and extras (buffers grow), shorter
        for batch, pages in [(3, 5), (3, 5), (3, 5), (40, 9), (40, 9), (2, 0), (700, 4000), (3, 5), (3, 5)]:
            lens = rng.integers(1, 5000, batch)
            extras = {"kv_indptr": np.cumsum(np.r_[0, rng.integers(0, 9, batch)]).astype(np.int32)}
            if pages:
                extras["pages"] = rng.integers(0, 2**20, pages).astype(np.int32)
            _check_upload(staging, device_buffer, lens, extras)


def test_a_grown_device_buffer_is_copied_into():
    with stubbed_cuda():
        staging = HostStaging(torch.device("cpu"))
        device_buffer = DeviceBuffer(torch.int32, torch.device("cpu"), fixed=False)
        small = {"pages": np.arange(10, dtype=np.int32)}
        _check_upload(staging, device_buffer, [100, 200], small)
        _check_upload(staging, device_buffer, [100, 200], small)
        first = device_buffer.tensor
        _check_upload(staging, device_buffer, [100, 200], {"pages": np.arange(50000, dtype=np.int32)})
        assert device_buffer.tensor is not first
        # the same length as the first plans again, into the grown buffer
        _check_upload(staging, device_buffer, [100, 200], {"pages": np.arange(10, 20, dtype=np.int32)})
        _check_upload(staging, device_buffer, [100, 200], {"pages": np.arange(20, 30, dtype=np.int32)})


def test_a_fixed_buffer_reserve_covers_the_alignment_of_grown_extras():
    # a CUDA-graph buffer sized by a first plan whose extras are shorter than later plans': the reserve (the
    # growth of the page ids) must also cover the extra 16-byte alignment padding the longer arrays take
    with stubbed_cuda():
        for first_pages, later_pages in [(5, 16), (1, 12), (9, 20), (4, 7)]:
            staging = HostStaging(torch.device("cpu"))
            device_buffer = DeviceBuffer(torch.int32, torch.device("cpu"), fixed=True)
            plan = staging.plan(lambda host: plan_decode([100, 200, 300], num_qo_heads=8, num_kv_heads=8,
                                                         num_sms=16, host_buffer=host))
            extras = {"kv_indptr": np.array([0, 1, 3, 5], np.int32), "pages": np.arange(first_pages, dtype=np.int32)}
            staging.upload(plan, extras, device_buffer, reserve=later_pages - first_pages)
            sized = device_buffer.tensor
            for pages in range(first_pages, later_pages + 1):
                extras = {"kv_indptr": np.array([0, 1, 3, 5], np.int32), "pages": np.arange(pages, dtype=np.int32)}
                end = _check_upload(staging, device_buffer, [100, 200, 300], extras)
                assert device_buffer.tensor is sized and end <= sized.numel()
