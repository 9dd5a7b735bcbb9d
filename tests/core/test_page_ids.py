"""Device page ids in CUDA-graph mode (copied into the wrapper's fixed buffer at plan time) and under
``check_indices`` (checked on the device), on the CPU: CUDA calls stubbed, "device" tensors are CPU tensors that
say they are CUDA ones (tests/stub_cuda.py). The GPU tests of the same (graph replay with fresh id tensors) are
in tests/decode/test_decode.py, tests/prefill/test_prefill_backend.py and tests/sm90/test_prefill_sm90_paged.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AttentionSpec, Paged
from flashgen.api import page_ids
from flashgen.plan import PlanError

from stub_cuda import on_device, stubbed_cuda

SPEC = AttentionSpec(128, kv_layout=Paged(16))
HEADS = dict(num_qo_heads=8, num_kv_heads=2)
WRAPPERS = ["decode", "portable", "sm90"]


def make(kind: str, **kwargs):
    if kind == "decode":
        return flashgen.BatchDecodeWrapper(SPEC, num_sms=132, **kwargs)
    if kwargs.get("use_cuda_graph"):
        kwargs.setdefault("max_total_q", kwargs["max_batch_size"] * 4)
    return flashgen.BatchPrefillWrapper(SPEC, num_sms=132, backend=kind, **kwargs)


def plan(w, **table):
    batch = len(table["seq_lens"]) if "seq_lens" in table else len(table["kv_indptr"]) - 1
    extra = {} if isinstance(w, flashgen.BatchDecodeWrapper) else {"qo_indptr": list(range(batch + 1))}
    w.plan(**table, **HEADS, **extra)
    return w._impl._params.values()


@pytest.fixture
def stubbed(monkeypatch):
    with stubbed_cuda():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        yield


def csr(lens, seed):
    """A CSR table over shuffled pages: host kv_indptr / kv_last_page_len, "device" kv_indices (a fresh tensor)."""
    lens = np.asarray(lens)
    pages = -(-lens // 16)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.where(pages > 0, lens - (pages - 1) * 16, 0).astype(np.int32)
    ids = torch.from_numpy(np.random.default_rng(seed).permutation(1000)[: indptr[-1]].astype(np.int32))
    return dict(kv_indptr=indptr, kv_indices=on_device(ids), kv_last_page_len=last)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_copies_device_ids_into_a_buffer_that_never_moves(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=8, max_num_pages=64)
    addresses = set()
    for lens, seed in (([40, 17, 300], 0), ([5, 900, 1, 0, 33], 1), ([16], 2)):
        table = csr(lens, seed)
        got = plan(w, **table)
        buf = w._core.page_ids._csr
        n = int(table["kv_indptr"][-1])
        assert buf.numel() == 64 and got["kv_indices"] == buf.data_ptr() != table["kv_indices"].data_ptr()
        assert torch.equal(buf[:n], table["kv_indices"][:n])  # the copy was made, before the kernel reads it
        addresses.add(got["kv_indices"])
    assert len(addresses) == 1


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_copies_block_tables_with_a_fixed_row_stride(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=4)
    first = on_device(torch.arange(12, dtype=torch.int32).reshape(2, 6))
    got = plan(w, block_table=first, seq_lens=[96, 3])
    buf = w._core.page_ids._table
    assert buf.shape == (4, 6) and got["block_table"] == buf.data_ptr() and got["block_table_stride"] == 6
    assert torch.equal(buf[:2], first)
    # a narrower table, then a wider one whose requests use only the first 6 columns: same buffer, same stride
    narrow = on_device(torch.tensor([[7, 8, 9]] * 3, dtype=torch.int32))
    got = plan(w, block_table=narrow, seq_lens=[48, 1, 0])
    assert (got["block_table"], got["block_table_stride"]) == (buf.data_ptr(), 6)
    assert torch.equal(buf[:3, :3], narrow)
    wide = on_device(torch.arange(40, dtype=torch.int32).reshape(4, 10))
    got = plan(w, block_table=wide, seq_lens=[96, 1, 80, 0])
    assert (got["block_table"], got["block_table_stride"]) == (buf.data_ptr(), 6)
    assert torch.equal(buf, wide[:, :6])
    with pytest.raises(PlanError, match=r"^block_table: request 2 uses 7 pages \(seq_lens\[2\] = 97\), more than the "
                                        r"6 columns .*raise max_pages_per_request"):
        plan(w, block_table=wide, seq_lens=[96, 1, 97, 0])


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_buffers_are_sized_by_the_first_plan_or_the_arguments(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=8)
    plan(w, **csr([40, 17], 0))  # 5 pages in a tensor of 5: the buffer holds 5
    with pytest.raises(PlanError, match=r"^kv_indices: the plan uses 6 page ids \(kv_indptr\[-1\]\), more than the "
                                        r"5 .*sized by the first plan; raise max_num_pages"):
        plan(w, **csr([40, 17, 1], 1))
    w = make(kind, use_cuda_graph=True, max_batch_size=8, max_num_pages=5)
    with pytest.raises(PlanError, match=r"than the 5 of the CUDA-graph wrapper's page-id buffer \(max_num_pages\)"):
        plan(w, **csr([40, 17, 1], 1))
    w = make(kind, use_cuda_graph=True, max_batch_size=2, max_pages_per_request=3)
    with pytest.raises(PlanError, match=r"^block_table: request 0 uses 4 pages .*\(max_pages_per_request\)"):
        plan(w, block_table=on_device(torch.zeros(2, 5, dtype=torch.int32)), seq_lens=[64, 2])


@pytest.mark.parametrize("kind", WRAPPERS)
def test_outside_graph_mode_device_ids_are_read_in_place(stubbed, kind):
    w = make(kind)
    assert w._core.page_ids is None
    table = csr([40, 17, 300], 0)
    assert plan(w, **table)["kv_indices"] == table["kv_indices"].data_ptr()
    block = on_device(torch.zeros(3, 20, dtype=torch.int32))
    got = plan(w, block_table=block, seq_lens=[40, 17, 300])
    assert (got["block_table"], got["block_table_stride"]) == (block.data_ptr(), 20)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_pages=0), r"^max_num_pages: got 0, expected None or an int >= 1"),
    (dict(max_pages_per_request=2.5), r"^max_pages_per_request: got 2.5, expected None or an int >= 1"),
    (dict(check_indices="yes"), r"^check_indices: got 'yes', expected True, False or None"),
])
def test_page_id_arguments_are_checked(stubbed, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make("decode", use_cuda_graph=True, max_batch_size=4, **kwargs)


# ---------------------------------------------------------------------------------------------- check_indices


@pytest.mark.parametrize("kind", WRAPPERS)
def test_check_indices_names_the_first_bad_device_id(stubbed, kind):
    w = make(kind, check_indices=True)
    table = csr([40, 17, 300], 0)
    ids = table["kv_indices"]
    ids[5], ids[9] = -1, -7
    with pytest.raises(PlanError, match=r"^kv_indices\[5\] = -1 is outside the page pool \[0, inf\) \(check_indices\)"):
        plan(w, **table)
    ids[5], ids[9] = 3, 2000
    with pytest.raises(PlanError, match=r"^kv_indices\[9\] = 2000 is outside the page pool \[0, 1000\)"):
        plan(w, **table, num_pages=1000)
    block = on_device(torch.full((3, 4), -1, dtype=torch.int32))  # -1 where no request reads
    block[0, :3], block[1, :2], block[2, :1] = torch.tensor([4, 5, 6]), torch.tensor([7, 8]), 9
    plan(w, block_table=block, seq_lens=[40, 17, 16], num_pages=10)
    with pytest.raises(PlanError, match=r"^block_table\[1, 1\] = 8 is outside the page pool \[0, 8\)"):
        plan(w, block_table=block, seq_lens=[40, 17, 16], num_pages=8)
    with pytest.raises(PlanError, match=r"^block_table\[2, 1\] = -1 is outside"):
        plan(w, block_table=block, seq_lens=[40, 17, 17])


def kv_cache(pages: int):
    k = on_device(torch.zeros(pages, 16, 2, 128, dtype=torch.bfloat16))
    return k, on_device(torch.zeros(pages, 16, 2, 128, dtype=torch.bfloat16))


def test_check_indices_without_num_pages_checks_the_cache_at_run(stubbed):
    w = make("decode", check_indices=True)
    table = csr([40, 17, 300], 0)
    ids = table["kv_indices"]
    ids.copy_(torch.arange(ids.numel(), dtype=torch.int32))
    ids[7], ids[8] = 500, 600
    plan(w, **table)
    q = on_device(torch.zeros(3, 8, 128, dtype=torch.bfloat16))
    w.run(q, kv_cache(601))  # every id is a page of this cache
    with pytest.raises(ValueError, match=r"^kv_indices\[7\] = 500 is outside kv_cache's 300 pages"):
        w.run(q, kv_cache(300))
    unchecked = make("decode")
    plan(unchecked, **table)
    unchecked.run(q, kv_cache(300))  # not checked: device ids are never read back


def test_check_indices_follows_the_environment_and_refuses_graph_capture(stubbed, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CHECK_INDICES", "1")
    w = make("decode")
    assert w._core.page_ids.check
    assert make("decode", check_indices=False)._core.page_ids is None
    monkeypatch.setattr(page_ids, "capturing", lambda: True)
    with pytest.raises(PlanError, match=r"^check_indices: plan\(\) checks kv_indices on the GPU and synchronises"):
        plan(w, **csr([40], 0))
    plan(w, kv_indptr=[0, 1], kv_indices=[3], kv_last_page_len=[5])  # host ids: checked on the host anyway


def test_check_indices_in_graph_mode_checks_then_copies(stubbed):
    w = make("decode", use_cuda_graph=True, max_batch_size=4, check_indices=True)
    table = csr([40, 17], 0)
    got = plan(w, **table, num_pages=1000)
    assert got["kv_indices"] == w._core.page_ids._csr.data_ptr()
    table["kv_indices"][1] = 1000
    with pytest.raises(PlanError, match=r"^kv_indices\[1\] = 1000 is outside the page pool \[0, 1000\)"):
        plan(w, **table, num_pages=1000)


# ------------------------------------------------------------------ device custom masks in CUDA-graph mode
# A captured graph keeps the params' mask address as it keeps the page ids': a device mask is copied into the
# wrapper's fixed buffer at each plan, and outside graph mode read in place.

MASK_SPEC = AttentionSpec(64, kv_layout=flashgen.Ragged(), mask=flashgen.CustomMask())


def mask_plan(w, qo_lens, kv_lens, seed):
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    nbytes = -(-int(np.dot(qo_lens, kv_lens)) // 8)
    bits = on_device(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes + 5, dtype=np.uint8)))
    w.plan(qo_indptr=qo, kv_indptr=kv, num_qo_heads=4, num_kv_heads=2, custom_mask=bits)
    return w._impl._params.values()["custom_mask"], bits, nbytes


@pytest.mark.parametrize("kind", ["portable", "sm90"])
def test_graph_mode_copies_device_masks_into_a_buffer_that_never_moves(stubbed, kind):
    w = flashgen.BatchPrefillWrapper(MASK_SPEC, num_sms=132, backend=kind, use_cuda_graph=True, max_batch_size=4,
                                     max_total_q=256)
    addresses = set()
    for qo_lens, kv_lens, seed in (([100, 3], [300, 40], 0), ([7, 1, 60], [7, 90, 200], 1), ([1], [1], 2)):
        address, bits, nbytes = mask_plan(w, qo_lens, kv_lens, seed)
        buf = w._impl._masks.tensor
        assert address == buf.data_ptr() != bits.data_ptr()
        assert torch.equal(buf[:nbytes], bits[:nbytes])  # this plan's bits, copied before the kernel reads them
        addresses.add(address)
    assert len(addresses) == 1
    with pytest.raises(PlanError, match=r"^custom_mask: needs \d+ elements, more than the \d+ sized by the first "
                                        r"plan of this CUDA-graph wrapper \(make the first plan the one with the most"):
        mask_plan(w, [200], [400], 3)


@pytest.mark.parametrize("kind", ["portable", "sm90"])
def test_device_masks_are_read_in_place_outside_graph_mode(stubbed, kind):
    w = flashgen.BatchPrefillWrapper(MASK_SPEC, num_sms=132, backend=kind)
    for qo_lens, kv_lens, seed in (([100, 3], [300, 40], 0), ([7, 1, 60], [7, 90, 200], 1)):
        address, bits, _ = mask_plan(w, qo_lens, kv_lens, seed)
        assert address == bits.data_ptr() and w._impl._masks is None


# ------------------------------------------------------------------ host page ids in CUDA-graph mode
# Host ids travel in the plan buffer, which a CUDA-graph wrapper sizes at its first plan: max_num_pages /
# max_pages_per_request reserve room for later plans' ids.

def host_csr(lens, seed):
    table = csr(lens, seed)
    table["kv_indices"] = table["kv_indices"].clone().as_subclass(torch.Tensor)  # a plain CPU tensor: host ids
    return table


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_host_ids_fit_max_num_pages(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=8, max_num_pages=100)
    plan(w, **host_csr([40, 17], 0))  # 4 pages sizes the buffer, with room for 100
    got = plan(w, **host_csr([600, 900, 1], 1))  # 38 + 57 + 1 = 96 pages
    assert got["kv_indices"] != 0


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_host_ids_past_the_first_plan_name_max_num_pages(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=8)
    plan(w, **host_csr([40, 17], 0))
    with pytest.raises(PlanError, match="pass max_num_pages"):
        plan(w, **host_csr([600, 900, 1], 1))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_graph_mode_host_block_tables_fit_max_pages_per_request(stubbed, kind):
    w = make(kind, use_cuda_graph=True, max_batch_size=4, max_pages_per_request=40)
    plan(w, block_table=torch.arange(2, dtype=torch.int32).reshape(2, 1), seq_lens=[16, 3])
    plan(w, block_table=torch.arange(160, dtype=torch.int32).reshape(4, 40), seq_lens=[640, 3, 16, 600])
