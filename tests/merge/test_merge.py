"""GPU tests of the merge-state kernels against the fp64 reference (fresh random inputs, poisoned outputs)."""

import pytest
import torch

import flashgen
from flashgen.api.merge import merge_states_in_place
from flashgen.testing.check import assert_merge_close, poison_allocator
from flashgen.testing.reference import merge_state_ref, merge_states_ref

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _states(tokens, num_states, heads, dim, dtype, empty_every=5):
    v = torch.randn(tokens, num_states, heads, dim, device="cuda").to(dtype)
    s = torch.randn(tokens, num_states, heads, device="cuda") * 5
    if num_states:
        s[::empty_every, 0] = float("-inf")  # empty partials
    s[1::13] = float("-inf")  # rows with every partial empty (and, with one token, none)
    v[s.isinf()] = float("nan")  # an empty partial's v is garbage and must not be read
    return v, s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_states,heads,dim", [(1, 1, 1, 64), (257, 2, 32, 128), (77, 7, 3, 256),
                                                         (5, 33, 4, 64), (9, 3, 2, 192), (3, 0, 2, 64)])
def test_merge_states(dtype, tokens, num_states, heads, dim):
    v, s = _states(tokens, num_states, heads, dim, dtype)
    poison_allocator((tokens, heads, dim), dtype)
    poison_allocator((tokens, heads), torch.float32)
    out, lse = flashgen.merge_states(v, s)
    ref_v, ref_s = merge_states_ref(v, s)
    assert_merge_close(out, lse, ref_v, ref_s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 64), (1000, 32, 128), (33, 5, 256), (7, 3, 8 * 3)])
def test_merge_state_pair(dtype, tokens, heads, dim):
    if dim % (16 // torch.empty((), dtype=dtype).element_size()):
        pytest.skip("head_dim not a multiple of the vector width")
    v, s = _states(tokens, 2, heads, dim, dtype, empty_every=3)
    v_a, v_b, s_a, s_b = v[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 0].contiguous(), s[:, 1].contiguous()
    poison_allocator((tokens, heads, dim), dtype)
    poison_allocator((tokens, heads), torch.float32)
    out, lse = flashgen.merge_state(v_a, s_a, v_b, s_b)
    ref_v, ref_s = merge_state_ref(v_a, s_a, v_b, s_b)
    assert_merge_close(out, lse, ref_v, ref_s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_mask", [False, True])
def test_merge_state_in_place(dtype, use_mask):
    tokens, heads, dim = 513, 8, 128
    v, s = _states(tokens, 2, heads, dim, dtype)
    v_a, v_b, s_a, s_b = v[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 0].contiguous(), s[:, 1].contiguous()
    mask = torch.rand(tokens, device="cuda") < 0.5 if use_mask else None
    ref_v, ref_s = merge_state_ref(v_a, s_a, v_b, s_b)
    if mask is not None:
        ref_v = torch.where(mask[:, None, None], ref_v, v_a.double())
        ref_s = torch.where(mask[:, None], ref_s, s_a.double())
    flashgen.merge_state_in_place(v_a, s_a, v_b, s_b, mask=mask)
    keep = ~mask if mask is not None else torch.zeros(tokens, dtype=torch.bool, device="cuda")
    torch.testing.assert_close(v_a[keep].double(), ref_v[keep], equal_nan=True, rtol=0, atol=0)
    merged = ~keep
    assert_merge_close(v_a[merged], s_a[merged], ref_v[merged], ref_s[merged])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_states,heads,dim", [(1, 1, 1, 64), (128, 4, 32, 128), (77, 7, 3, 256),
                                                         (5, 16, 4, 64), (9, 3, 2, 192), (3, 1, 2, 64)])
def test_merge_states_in_place(dtype, tokens, num_states, heads, dim):
    # (v, s) and num_states more (state-major, as a cascade's chunks) merged into (v, s): num_states + 1 a row
    v, s = _states(tokens, num_states + 1, heads, dim, dtype)
    own_v, own_s = v[:, 0].contiguous(), s[:, 0].contiguous()
    parts_v, parts_s = v[:, 1:].transpose(0, 1).contiguous(), s[:, 1:].transpose(0, 1).contiguous()
    ref_v, ref_s = merge_states_ref(v, s)
    merge_states_in_place(own_v, own_s, parts_v, parts_s)
    assert_merge_close(own_v, own_s, ref_v, ref_s)


def test_merge_states_in_place_names_bad_arguments():
    v, s = _states(4, 3, 2, 64, torch.float16)
    own_v, own_s = v[:, 0].contiguous(), s[:, 0].contiguous()
    parts_v, parts_s = v[:, 1:].transpose(0, 1).contiguous(), s[:, 1:].transpose(0, 1).contiguous()
    with pytest.raises(ValueError, match=r"^v_parts: expected shape \(2, 4, 2, 64\), got \(2, 3, 2, 64\)"):
        merge_states_in_place(own_v, own_s, parts_v[:, :3].contiguous(), parts_s)
    with pytest.raises(ValueError, match=r"^s_parts: expected shape \(2, 4, 2\)"):
        merge_states_in_place(own_v, own_s, parts_v, parts_s[:1])
    with pytest.raises(TypeError, match=r"^v_parts: expected dtype torch.float16"):
        merge_states_in_place(own_v, own_s, parts_v.float(), parts_s)
    with pytest.raises(ValueError, match=r"^v_parts: expected a contiguous tensor"):
        merge_states_in_place(own_v, own_s, v[:, 1:].transpose(0, 1), parts_s)


def test_merge_states_in_a_cuda_graph():
    v, s = _states(300, 4, 8, 128, torch.bfloat16)
    static_v, static_s = v.clone(), s.clone()
    flashgen.merge_states(static_v, static_s)  # warm: compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashgen.merge_states(static_v, static_s)
    for _ in range(2):
        fresh_v, fresh_s = _states(300, 4, 8, 128, torch.bfloat16)
        static_v.copy_(fresh_v)
        static_s.copy_(fresh_s)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        ref_v, ref_s = merge_states_ref(fresh_v, fresh_s)
        assert out.dtype == torch.bfloat16
        assert_merge_close(out, lse, ref_v, ref_s)


def test_bad_arguments_name_the_argument():
    v, s = _states(4, 2, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="^s: expected shape"):
        flashgen.merge_states(v, s[:, :1].contiguous())
    with pytest.raises(TypeError, match="^s: expected dtype torch.float32"):
        flashgen.merge_states(v, s.half())
    with pytest.raises(ValueError, match="^v: expected a CUDA tensor"):
        flashgen.merge_states(v.cpu(), s)
    with pytest.raises(ValueError, match="^v: expected 4 dimensions"):
        flashgen.merge_states(v[0], s)
    with pytest.raises(ValueError, match="^head_dim: expected a multiple of 8"):
        flashgen.merge_states(torch.randn(4, 2, 2, 12, device="cuda").half(), s)
    with pytest.raises(ValueError, match="^v_b: expected shape"):
        flashgen.merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:1, 1].contiguous(), s[:, 1].contiguous())
    with pytest.raises(ValueError, match="^v: expected a contiguous tensor"):
        flashgen.merge_states(v.transpose(0, 1), s)
