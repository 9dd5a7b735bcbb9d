"""BlockSparseWrapper: block-sparse attention (a BSR pattern over an M x N score matrix) as a paged prefill.

A BSR pattern of ``R x C`` blocks is a page plan (``plan.block_sparse.bsr_page_table``): block row ``r`` is a
request whose queries are rows ``r*R .. min((r+1)*R, M)`` and whose pages are its kept column blocks, each
``C`` tokens of the dense K / V. The wrapper runs that page table through an inner ``BatchPrefillWrapper`` over
a ``Paged(C, "NHD")`` spec whose cache is K / V seen as pages, so a block that is not kept is never read and
time grows with the kept blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import family, launch_config
from ..plan import PlanError, bsr_page_table
from ..plan.host import check_heads, check_int
from ..spec import AttentionSpec, BlockSparse, CustomMask, Paged, Ragged, SpecError
from . import handles
from .backends import BACKENDS, check_sm90
from .positions import wants_positions
from .checks import check_count
from .kv_inputs import KVView
from .prefill import BatchPrefillWrapper, prefill_kv_view
from .sparse_pages import position_free
from .wrapper import resolve_device


def sm90_reads_whole_pages(spec: AttentionSpec) -> bool:
    """Whether the Hopper kernel loads ``spec``'s pages (a ``Paged`` spec) whole, a page per TMA box, rather
    than gathering rows below each request's length (page sizes TMA cannot take); False where it does not run
    the spec at all. A TMA box of a partial last page would read past the end of K / V."""
    try:
        return not launch_config(spec, "prefill_sm90").gather
    except SpecError:
        return False


def positions_options(spec: AttentionSpec, backend: str, kernel_options: dict | None, what: str) -> dict | None:
    """The inner wrapper's kernel options: ``kernel_options`` as given for a position-free spec, else with
    explicit positions on (``SpecError`` for a custom mask, which has no positions)."""
    if position_free(spec):
        return kernel_options
    if isinstance(spec.mask, CustomMask):
        raise SpecError(f"mask: {what} takes NoMask(), Causal() or SlidingWindow(left), got {spec.mask!r}")
    return {**(kernel_options or {}), "positions": True}


def check_prefill_spec(spec: AttentionSpec, backend: str, kernel_options: dict | None = None) -> None:
    """The prefill families' checks of head dims and dtypes (``SpecError``), before any plan fixes a page size:
    the sm90 backend's for ``backend="sm90"`` (with explicit positions where ``kernel_options`` asks for them),
    else the portable one's (which ``"auto"`` falls back to). fp8 K/V are refused: the block-sparse plans take no
    k_scale / v_scale yet."""
    if spec.kv_dtype != spec.dtype:
        raise SpecError(f"kv_dtype: block-sparse wrappers take K/V in q's dtype ({spec.dtype}), got {spec.kv_dtype} "
                        "(their plan() takes no fp8 k_scale / v_scale yet; BatchPrefillWrapper does)")
    probe = spec.replace(kv_layout=Paged(16))
    if backend == "sm90":
        check_sm90(probe, options={"positions": True} if wants_positions(kernel_options) else None)
    else:
        family("prefill", kernel_options).check(family("prefill").project(probe))


def inner_backend(spec: AttentionSpec, backend: str, kv_len: int, block_kv: int) -> str:
    """The backend the inner ``BatchPrefillWrapper`` is asked for: ``backend`` itself, except that where N is
    not a multiple of C and the sm90 kernel would load the last, partial page whole (past N), ``"auto"`` becomes
    ``"portable"`` and ``"sm90"`` raises ``PlanError``. ``spec``: the inner ``Paged(C)`` spec.

    >>> inner_backend(AttentionSpec(128, kv_layout=Paged(64)), "auto", 1000, 64)
    'portable'
    >>> inner_backend(AttentionSpec(128, kv_layout=Paged(64)), "auto", 1024, 64)
    'auto'
    """
    if backend == "portable" or kv_len % block_kv == 0 or not sm90_reads_whole_pages(spec):
        return backend
    if backend == "sm90":
        raise PlanError(f"N: {kv_len} is not a multiple of C = {block_kv}; backend='sm90' loads a page of C = "
                        f"{block_kv} tokens whole (TMA), so the last, partial block would be read past the end of "
                        "K and V (backend='auto' runs such plans on the portable kernel)")
    return "portable"


def dense_pages(page_size: int):
    """The inner wrapper's view of a dense ``(k [N, Hkv, D], v [N, Hkv, Dv])`` pair as ``ceil(N / C)`` pages of
    ``C = page_size`` tokens (NHD): a ``KVView`` whose page stride is ``C`` token strides. With N a multiple of C
    K and V are viewed as ``[N / C, C, Hkv, D]`` tensors (no copy; what the Hopper kernel's TMA maps read);
    otherwise the last page is partial, K / V stay 3-D and the kernels address them through pointers and
    strides only (the portable kernel and the Hopper kernel's gathered pages read rows below each request's
    length, so nothing past row N)."""

    def view(spec: AttentionSpec, kv_cache, num_kv_heads: int) -> KVView:
        if not isinstance(kv_cache, tuple) or len(kv_cache) != 2:
            raise ValueError("kv_cache: expected the pair (k, v)")
        dense = prefill_kv_view(spec.replace(kv_layout=Ragged()), kv_cache, num_kv_heads)
        k, v = dense.k, dense.v
        n = k.shape[0]
        pages = -(-n // page_size)
        if n % page_size == 0:
            k, v = k.view(pages, page_size, *k.shape[1:]), v.view(pages, page_size, *v.shape[1:])
        return KVView(k, v, page_size * dense.stride_token, dense.stride_token, dense.stride_head, pages)

    return view


class BlockSparseWrapper:
    """Block-sparse attention: ``q [M, Hq, D]`` attends ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` through the kept
    ``R x C`` blocks of a BSR pattern (FlashInfer's ``BlockSparseAttentionWrapper``; the spec carries head_dim
    and dtypes).

    Example::

        wrapper = flashgen.BlockSparseWrapper(AttentionSpec(128, kv_layout=Ragged()))
        wrapper.plan(indptr, indices, M, N, 64, 64, num_qo_heads=32, num_kv_heads=8)   # host int arrays
        out = wrapper.run(q, k, v)          # q [M, 32, 128], k / v [N, 8, 128] -> out [M, 32, 128]

    Block row ``r`` (query rows ``r*R .. min((r+1)*R, M)``) attends the column blocks ``indices[indptr[r]:
    indptr[r+1]]`` (key rows ``c*C .. min((c+1)*C, N)``; each row's sorted and unique). Any ``R, C >= 1``; M and N
    need not be multiples of them. A block row with no kept block gives ``out = 0`` and ``lse = -inf``.

    Masks and positions: query row ``i`` sits at position ``i`` and key row ``j`` at ``j`` (block index x C +
    offset), so ``Causal()`` (key ``j <= i``, aligned at the top left of the M x N matrix), ``SlidingWindow(left)``
    (``i - left <= j <= i``), ``RoPE()`` and ``ALiBi()`` apply inside the kept blocks as over the dense matrix;
    such specs run with explicit positions (``kernel_options["positions"]``) on either backend, as do
    position-free ones (NoMask, no encoding; soft-cap and ``sm_scale`` allowed). ``CustomMask`` raises ``SpecError``. ``spec.kv_layout`` is not read (K and V are dense), except that
    a ``BlockSparse(R, C)`` layout fixes R and C: plan() checks that it is given those.

    Backends (``backend``, as ``BatchPrefillWrapper``'s): the pattern runs as a paged prefill with one request
    per block row and pages of C tokens. ``"auto"`` runs the Hopper kernel (wgmma + TMA) on a compute-capability
    9.0 GPU, else the portable one, with one exception: where N is not a multiple of C and the Hopper kernel
    would load pages of C whole by TMA (C a multiple of 8 that divides its KV tile or is divided by it: 8, 16,
    32, 64, 128, 256 ... at head_dim 128), the last column block is partial and a box would read past K and V,
    so such a plan runs on the portable kernel (gathered page sizes, e.g. C = 1, 24, 48, stay on the Hopper
    kernel). ``"sm90"`` raises ``PlanError`` for such a plan; ``"portable"`` always runs the portable kernel.
    ``wrapper.backend`` says which ran the last plan. One inner wrapper is kept per C (two where some plans' N
    is a multiple of C and some not). Each block row is its own run of q tiles (``R x num_qo_heads /
    num_kv_heads`` packed rows; the Hopper kernel's tile is 128 of them), so blocks of fewer packed rows than a
    tile leave the rest of it idle.

    ``use_cuda_graph=True``: the first plan fixes M, N, R and C (later plans must keep them) and the inner
    wrapper's capacity (``ceil(M / R)`` block rows, M query rows); ``max_num_blocks`` (default: the first plan's
    kept blocks) bounds the kept blocks of every later plan. A graph captured around ``run()`` then replays
    correctly after ``plan()`` of any pattern within them (K and V at the captured addresses).
    ``kernel_options``: the portable kernel's options (``BatchPrefillWrapper``). ``workspace`` is accepted for
    FlashInfer-style call sites; the wrapper owns its buffers.
    """

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor | None = None, backend: str = "auto",
                 use_cuda_graph: bool = False, max_num_blocks: int | None = None,
                 device: torch.device | int | None = None, num_sms: int | None = None,
                 kernel_options: dict | None = None):
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        if spec.variant is not None:  # its inner wrappers would run the hooks without their arguments
            raise SpecError(f"variant: BlockSparseWrapper does not run variants yet (got {spec.variant.uri}); "
                            "BatchPrefillWrapper and BatchDecodeWrapper do")
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")
        kernel_options = positions_options(spec, backend, kernel_options, "BlockSparseWrapper")
        self._positions = not position_free(spec)
        self._q_pos = np.zeros(0, np.int32)  # 0 .. M-1, kept for the next plan of the same M
        check_prefill_spec(spec, backend, kernel_options)
        self.spec, self._backend, self._kernel_options = spec, backend, kernel_options
        self.num_sms = check_count("num_sms", num_sms)
        self.use_cuda_graph = use_cuda_graph
        self.max_num_blocks = check_count("max_num_blocks", max_num_blocks, 0)
        self.device = resolve_device(device)
        self._inner: dict[tuple[int, bool], BatchPrefillWrapper] = {}  # by C and whether C divides N
        self._shape: tuple[int, int, int, int] | None = None  # (M, N, R, C) of the last plan
        self._planned: tuple[BatchPrefillWrapper, int] | None = None  # (inner wrapper, N)
        self.op_handle = handles.assign(self)  # how flashgen.ops names this wrapper

    @property
    def backend(self) -> str | None:
        """``"sm90"`` or ``"portable"``: the kernel of the last plan (None before the first)."""
        return None if self._planned is None else self._planned[0].backend

    def plan(self, indptr, indices, M: int, N: int, R: int, C: int, num_qo_heads: int, num_kv_heads: int, *,
             sm_scale: float | None = None, soft_cap: float | None = None, window_left: int | None = None,
             rope_theta: float | None = None, rope_scale: float | None = None, enable_split: bool = True) -> None:
        """Plan a BSR pattern: ``indptr [ceil(M / R) + 1]`` and ``indices [nnz]`` (host int arrays: numpy, lists
        or CPU tensors; planning never synchronises with the GPU), ``M`` query rows, ``N`` key rows, blocks of
        ``R x C``. ``sm_scale`` (default: the spec's, else 1/sqrt(head_dim)), ``soft_cap`` (specs with a
        soft-cap), ``window_left`` (SlidingWindow), ``rope_theta`` and ``rope_scale`` (RoPE) as
        ``BatchPrefillWrapper.plan``'s; ``enable_split``: the portable kernel may split long block
        rows over several CTAs.

        Raises ``PlanError`` naming the argument: ``M``, ``N`` ints >= 0, ``R``, ``C`` ints >= 1; ``indptr`` of
        ``ceil(M / R) + 1`` entries from 0, non-decreasing; ``indices`` in ``[0, ceil(N / C))``, each block row's
        sorted and unique; head counts ints >= 1, ``num_kv_heads`` dividing ``num_qo_heads``.
        """
        check_heads(num_qo_heads, num_kv_heads)
        for name, value, minimum in (("M", M, 0), ("N", N, 0), ("R", R, 1), ("C", C, 1)):
            check_int(name, value, minimum)
        M, N, R, C = int(M), int(N), int(R), int(C)
        layout = self.spec.kv_layout
        if isinstance(layout, BlockSparse) and (R, C) != (layout.block_q, layout.block_kv):
            raise PlanError(f"R, C: got {R} x {C}, but the spec's layout is {layout!r} (blocks of {layout.block_q} "
                            f"x {layout.block_kv})")
        if self.use_cuda_graph and M == 0:
            raise PlanError("M: got 0, a CUDA-graph wrapper needs M >= 1 (q and out have M rows)")
        if self.use_cuda_graph and self._shape is not None and self._shape != (M, N, R, C):
            raise PlanError(f"M, N, R, C: got {(M, N, R, C)}, but a CUDA-graph wrapper keeps its first plan's "
                            f"{self._shape}")
        qo, kv_indptr, kv_indices, last, _ = bsr_page_table(indptr, indices, block_q=R, block_kv=C, qo_len=M,
                                                            kv_len=N)
        inner = self._inner_wrapper(M, N, R, C, kv_indices.size)
        positions = {}
        if self._positions:  # key rows: block index x C + offset; query rows: their index
            if self._q_pos.size != M:
                self._q_pos = np.arange(M, dtype=np.int32)
            positions = {"kv_page_pos": kv_indices * C, "q_pos": self._q_pos}
        inner.plan(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last,
                   num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, sm_scale=sm_scale, soft_cap=soft_cap,
                   window_left=window_left, rope_theta=rope_theta, rope_scale=rope_scale, num_pages=-(-N // C),
                   enable_split=enable_split, **positions)
        self._shape, self._planned = (M, N, R, C), (inner, N)

    def _inner_wrapper(self, M: int, N: int, R: int, C: int, num_blocks: int) -> BatchPrefillWrapper:
        """The inner wrapper of blocks C wide, by (C, whether the last column block is partial): a dict lookup
        once seen (plan() builds no spec then)."""
        inner = self._inner.get((C, N % C == 0))
        if inner is None:
            spec = self.spec.replace(kv_layout=Paged(C, "NHD"))
            backend = inner_backend(spec, self._backend, N, C)
            graph = {}
            if self.use_cuda_graph:
                most = num_blocks if self.max_num_blocks is None else self.max_num_blocks
                graph = dict(use_cuda_graph=True, max_batch_size=-(-M // R), max_total_q=M,
                             max_num_pages=max(most, 1))
            inner = BatchPrefillWrapper(spec, device=self.device, num_sms=self.num_sms, backend=backend,
                                        kernel_options=self._kernel_options, **graph)
            inner._view = dense_pages(C)
            self._inner[(C, N % C == 0)] = inner
        return inner

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False):
        """Attend ``q [M, num_qo_heads, head_dim]`` over ``k [N, num_kv_heads, head_dim]`` and ``v [N,
        num_kv_heads, head_dim_vo]`` (the spec's dtypes, CUDA, rows contiguous and 16-byte aligned) through the
        planned blocks. Returns ``out [M, num_qo_heads, head_dim_vo]`` (q's dtype), with ``return_lse`` also
        ``lse [M, num_qo_heads]`` fp32 (natural log; -inf in a block row with no kept block). K and V seen
        before (same addresses, shapes, strides) are not checked again."""
        planned = self._planned
        if planned is None:
            raise RuntimeError("run: call plan() first")
        inner, n = planned
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != n:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected [N = {n}, num_kv_heads, dim] (the plan's N), got {shape}")
        return inner.run(q, (k, v), out=out, return_lse=return_lse)
