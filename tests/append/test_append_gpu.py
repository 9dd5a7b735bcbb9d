"""GPU tests of append_kv against the CPU reference (flashgen.testing.append_kv_ref): page sizes 1, 16, 17, 256
with appends that cross page boundaries, CSR and slot_mapping, NHD and HND, combined and paired caches, RoPE
(theta, Llama-3.1, a cos/sin table) and fp8 (per-tensor, per-head scales). Every slot of the pool starts as NaN
and those no token writes must stay NaN; padding tokens (batch index or slot -1) write nothing. Run on an H200:

    python -m pytest -q tests/append/test_append_gpu.py
"""

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import flashgen
from flashgen import AppendSpec, Llama31Scaling, Paged, RoPE
from flashgen.compile import choose_arch
from flashgen.testing import append_kv_ref, assert_cache_close, cos_sin_table

pytestmark = pytest.mark.cuda
BF16, F16, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
HEADS = 4

# (page_size, order, form, combined, rope, in dtype, cache dtype, scales, head_dim, index dtype)
CASES = [
    (16, "NHD", "csr", True, None, BF16, BF16, None, 128, torch.int32),
    (1, "HND", "slots", False, None, F16, F16, None, 128, torch.int64),
    (17, "NHD", "slots", True, "rope", BF16, BF16, None, 128, torch.int64),
    (256, "HND", "csr", False, "llama31", F16, F16, None, 128, torch.int32),
    (17, "HND", "csr", True, "table", BF16, BF16, None, 64, torch.int32),
    (16, "NHD", "csr", False, None, BF16, E4M3, "tensor", 128, torch.int32),
    (17, "NHD", "slots", False, "rope", F16, E5M2, "head", 256, torch.int64),
    (1, "NHD", "csr", True, "llama31", BF16, E4M3, "head", 128, torch.int32),
    (256, "HND", "slots", True, "table", BF16, E4M3, "tensor", 192, torch.int32),
    (16, "HND", "csr", True, "rope", F16, E4M3, "head", 128, torch.int64),
]


def _spec(case) -> AppendSpec:
    ps, order, form, _, rope, dtype, cache, scales, dim, index = case
    return AppendSpec(dim, str(dtype)[6:], str(cache)[6:], Paged(ps, order),
                      rope={None: "none", "table": "cos_sin_cache"}.get(rope, "rope"),
                      scales="per_head" if scales == "head" else "per_tensor",
                      page_table="csr" if form == "csr" else "slot_mapping", index_dtype=str(index)[6:])


@pytest.fixture(scope="module", autouse=True)
def compiled(gpu_cache_dir):
    """Every case's kernel compiled in parallel before the first test (the tests then only load)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHGEN_CACHE_DIR", str(gpu_cache_dir))
    arch = choose_arch(None, torch.cuda.current_device())
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda spec: flashgen.ensure_compiled(spec, "append", arch), {_spec(c) for c in CASES}))
    yield
    mp.undo()


def _batch(page_size, cached, new, gen):
    """A CSR page table for requests holding ``cached[b]`` tokens that append ``new[b]`` (shuffled pages, spare
    ones), and the appended tokens' (batch index, position, slot); two padding tokens (-1) at the end."""
    lens = [c + n for c, n in zip(cached, new)]
    npages = [-(-n // page_size) for n in lens]
    total = sum(npages) + 3
    perm = torch.randperm(total, generator=gen)[: sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)])
    batch, pos, slots = [], [], []
    for b, (c, n) in enumerate(zip(cached, new)):
        for p in range(c, c + n):
            batch.append(b)
            pos.append(p)
            slots.append(int(perm[indptr[b] + p // page_size]) * page_size + p % page_size)
    batch, pos, slots = batch + [-1, -1], pos + [0, 3], slots + [-1, -1]
    return total, torch.tensor(indptr, dtype=torch.int32), perm.to(torch.int32), batch, pos, slots


def _pool(total, page_size, order, dim, cache_dtype, combined):
    shape = (total, page_size, HEADS, dim) if order == "NHD" else (total, HEADS, page_size, dim)
    nan = torch.full(shape, float("nan"), device="cuda").to(cache_dtype)
    return torch.stack([nan, nan], dim=1) if combined else (nan, nan.clone())


def _run(case, gen, cached=(0, 5, 30, 1), new=(1, 40, 3, 300)):
    ps, order, form, combined, rope, dtype, cache_dtype, scales, dim, index = case
    total, indptr, indices, batch, pos, slots = _batch(ps, cached, new, gen)
    tokens = len(batch)
    k = (torch.randn(tokens, HEADS, dim, generator=gen) * 2).to(dtype).cuda()
    v = (torch.randn(tokens, HEADS, dim, generator=gen) * 2).to(dtype).cuda()
    kv = _pool(total, ps, order, dim, cache_dtype, combined)
    args = dict(kv_layout=order, positions=torch.tensor(pos, dtype=index).cuda())
    if form == "csr":
        args.update(kv_indptr=indptr.cuda(), kv_indices=indices.cuda(), batch_indices=torch.tensor(batch, dtype=index).cuda())
    else:
        args["slot_mapping"] = torch.tensor(slots, dtype=index).cuda()
    if rope in ("rope", "llama31"):
        args["rope"] = RoPE(500000.0 if rope == "llama31" else 10000.0, 1.0 if rope == "llama31" else 2.0)
        if rope == "llama31":
            args["rope_scaling"] = Llama31Scaling()
    elif rope == "table":
        args["cos_sin_cache"] = cos_sin_table(max(cached) + max(new) + 1, dim).cuda()
    if scales == "tensor":
        args.update(k_scale=0.25, v_scale=2.0)
    elif scales == "head":
        args.update(k_scale=torch.rand(HEADS, generator=gen).add(0.1).cuda(),
                    v_scale=torch.rand(HEADS, generator=gen).add(0.1).cuda())
    ref = append_kv_ref(k, v, kv, **args)
    flashgen.append_kv(k, v, kv, **args)
    torch.cuda.synchronize()
    return kv, ref, _rope_atol(rope, scales, args)


def _rope_atol(rope, scales, args) -> float:
    """The fp32 RoPE's error in the cache's units (inputs ~ N(0, 2), positions up to ~300); 0 without RoPE."""
    if rope is None:
        return 0.0
    k_scale = args.get("k_scale", 1.0)
    return 1e-3 / (float(k_scale.min()) if isinstance(k_scale, torch.Tensor) else k_scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: _spec(c).uri)
def test_append_matches_the_reference(case):
    kv, ref, atol = _run(case, torch.Generator().manual_seed(zlib.crc32(_spec(case).uri.encode())))
    _, _, _, _, rope, _, _, scales, _, _ = case
    assert_cache_close(kv, ref, exact=rope is None and scales is None, atol=atol)


def test_strided_inputs_from_a_fused_projection():
    gen = torch.Generator().manual_seed(1)
    total, indptr, indices, batch, pos, _ = _batch(16, [3, 0], [20, 7], gen)
    qkv = torch.randn(len(batch), 3 * HEADS, 128, generator=gen).bfloat16().cuda()
    k, v = qkv[:, HEADS: 2 * HEADS], qkv[:, 2 * HEADS:]
    kv = _pool(total, 16, "NHD", 128, BF16, True)
    args = dict(kv_indptr=indptr.cuda(), kv_indices=indices.cuda(), batch_indices=torch.tensor(batch).int().cuda(),
                positions=torch.tensor(pos).int().cuda())
    ref = append_kv_ref(k, v, kv, **args)
    flashgen.append_kv(k, v, kv, **args)
    assert_cache_close(kv, ref, exact=True)


def test_index_arrays_on_another_device_are_refused():
    k = torch.zeros(2, HEADS, 128, dtype=BF16, device="cuda")
    with pytest.raises(ValueError, match="slot_mapping: expected a tensor on cuda"):
        flashgen.append_kv(k, k, torch.zeros(4, 2, 16, HEADS, 128, dtype=BF16, device="cuda"),
                           slot_mapping=torch.tensor([0, 1]))


@pytest.mark.parametrize("form", ["csr", "slots"])
def test_cuda_graph_replays_with_new_indices(form):
    """One capture; each replay writes new K/V to new slots (fresh page tables copied into the static buffers)."""
    gen = torch.Generator().manual_seed(7)
    cached, new = (4, 20), (30, 1)
    tokens = sum(new) + 2
    static = dict(k=torch.zeros(tokens, HEADS, 128, dtype=BF16, device="cuda"),
                  v=torch.zeros(tokens, HEADS, 128, dtype=BF16, device="cuda"),
                  positions=torch.zeros(tokens, dtype=torch.int32, device="cuda"),
                  index=torch.zeros(tokens, dtype=torch.int32, device="cuda"))
    total = 16
    kv = _pool(total, 17, "HND", 128, E4M3, True)
    indptr = torch.zeros(3, dtype=torch.int32, device="cuda")
    indices = torch.zeros(total, dtype=torch.int32, device="cuda")
    scales = dict(k_scale=torch.full((HEADS,), 0.5, device="cuda"), v_scale=torch.full((HEADS,), 2.0, device="cuda"))
    table = dict(kv_indptr=indptr, kv_indices=indices, batch_indices=static["index"]) if form == "csr" else \
        dict(slot_mapping=static["index"])
    common = dict(kv_layout="HND", positions=static["positions"], rope=RoPE(), **table, **scales)
    flashgen.append_kv(static["k"], static["v"], kv, **common)  # warm: build and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashgen.append_kv(static["k"], static["v"], kv, **common)
    for _ in range(3):
        pages, ip, ids, batch, pos, slots = _batch(17, cached, new, gen)
        assert pages <= total
        fresh = _pool(total, 17, "HND", 128, E4M3, True)
        kv.copy_(fresh)
        indptr.copy_(ip)
        indices[: ids.numel()].copy_(ids)
        static["k"].copy_(torch.randn(tokens, HEADS, 128, generator=gen).bfloat16())
        static["v"].copy_(torch.randn(tokens, HEADS, 128, generator=gen).bfloat16())
        static["positions"].copy_(torch.tensor(pos))
        static["index"].copy_(torch.tensor(batch if form == "csr" else slots))
        ref = append_kv_ref(static["k"], static["v"], fresh, **common)
        graph.replay()
        torch.cuda.synchronize()
        assert_cache_close(kv, ref, atol=1e-3 / 0.5)
