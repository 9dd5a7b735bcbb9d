"""Which backend runs a spec, and which kernels it needs: the one place that knows (the wrappers and the
``flashgen build`` command both ask here).

Prefill has two backends. ``portable`` is the mma.sync kernel (family ``prefill``): every spec the family
accepts, split-KV plans, any GPU flashgen targets. ``sm90`` is the Hopper kernel (family ``prefill_sm90``):
wgmma + TMA, sm_90a only, unsplit plans; RoPE over unrotated K, a variant with a ``k_transform`` or (outside CUDA
graphs) fp8 K/V run as the ``rope_gather`` pre-pass followed by the kernel of its ragged twin (``ragged_twin``),
which is not CUDA-graph safe yet; RoPE over rotated K (``k_rotated=True``) turns q in the kernel, graphs included.
Decode has one kernel.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from ..kernels import family
from ..kernels import prepass, prepass_variant, ragged_twin, rotates
from ..spec import AttentionSpec, SpecError

BACKENDS = ("auto", "portable", "sm90")
SM90_CAPABILITY = (9, 0)  # the sm90 kernel is built for sm_90a (H100, H200, H20)
SM90_OPS = frozenset({"prefill_sm90", "rope_gather"})  # ops built for sm_90a only


class Backend(Protocol):
    """What a wrapper asks of its backend: plan a batch (upload included; returns the rows of q and out),
    the kernel arguments of a validated KV cache (memoised by the wrapper), and the launch."""

    def plan(self, qo: np.ndarray, table, num_qo_heads: int, num_kv_heads: int, runtime, custom_mask,
             enable_split: bool, split_policy) -> int: ...

    def kv_args(self, kv) -> tuple: ...

    def launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, lse: torch.Tensor | None) -> None: ...


def kernels_for(spec: AttentionSpec, backend: str, graph: bool = False) -> tuple[tuple[str, AttentionSpec], ...]:
    """The (op, spec) kernels ``backend`` (``"decode"``, ``"portable"``, ``"sm90"``) runs for ``spec``. For
    ``sm90``: ``prefill_sm90`` of the spec itself, or for RoPE over unrotated K, a variant with a k_transform or (outside
    CUDA-graph mode, ``graph``) fp8 K/V (``prepass``) the ``rope_gather`` pre-pass and ``prefill_sm90`` of its
    16-bit ragged twin; an AOT build of such a spec needs both (and, for fp8 K/V used in CUDA graphs, the kernel
    of ``graph=True``).

    >>> [op for op, _ in kernels_for(AttentionSpec(128, kv_layout=Ragged(), pos_encoding=RoPE()), "sm90")]
    ['rope_gather', 'prefill_sm90']
    """
    if backend == "decode":
        return (("decode", spec),)
    if backend == "portable":
        return (("prefill", spec),)
    if prepass(spec, graph):
        # the pre-pass runs the k_transform (when it turns, the q_transform too) and turns; the other hooks run in
        # the attention kernel
        pre = spec.replace(variant=prepass_variant(spec.variant, rotates(spec)))
        return (("rope_gather", pre), ("prefill_sm90", ragged_twin(spec)))
    return (("prefill_sm90", spec),)


def check_sm90(spec: AttentionSpec, graph: bool = False, options: dict | None = None) -> None:
    """Raise ``SpecError`` unless the sm90 backend runs ``spec`` (every kernel of ``kernels_for``, with kernel
    ``options``, e.g. ``{"positions": True}``; ``graph``: in CUDA-graph mode, where the K pre-pass is
    refused: its grid and totals depend on the plan)."""
    if graph and rotates(spec):
        raise SpecError("pos_encoding: RoPE over unrotated K on the sm90 backend turns K in a pre-pass that is not "
                        "CUDA-graph safe yet (use_cuda_graph=True); RoPE(k_rotated=True) (a cache of rotated K, as "
                        "append_kv(rope=...) writes) runs in a graph there, backend='portable' runs either")
    if graph and prepass(spec, graph):
        raise SpecError("variant.k_transform: the sm90 backend runs it in its K pre-pass, not CUDA-graph safe yet "
                        "(use_cuda_graph=True); backend='portable' runs it in a graph")
    for op, kernel_spec in kernels_for(spec, "sm90", graph):
        fam = family(op, options)
        fam.check(fam.project(kernel_spec))


def select(spec: AttentionSpec, backend: str, capability: tuple[int, int] | Callable[[], tuple[int, int]],
           graph: bool = False, options: dict | None = None) -> str:
    """The prefill backend that runs ``spec``: ``"portable"`` or ``"sm90"``. ``capability``: the device's
    compute capability ``(major, minor)``, or a function returning it (called only when the answer depends
    on it).

    ``"auto"`` picks sm90 on a compute-capability 9.0 device when ``check_sm90`` accepts the spec (``graph``:
    in CUDA-graph mode; ``options``: the sm90 kernels' options), else portable. ``"sm90"`` on a spec it cannot run raises ``SpecError``, on another
    device ``ValueError``; both messages name ``backend`` and say why.

    >>> select(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), "auto", (9, 0))
    'sm90'
    >>> select(AttentionSpec(128, kv_layout=Ragged(), mask=Causal()), "auto", (8, 0))
    'portable'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {', '.join(map(repr, BACKENDS))}")
    if backend == "portable":
        return backend
    try:
        check_sm90(spec, graph, options)
    except SpecError as exc:
        if backend == "auto":
            return "portable"
        raise SpecError(f"backend: 'sm90' cannot run this spec ({exc})") from exc
    major, minor = capability() if callable(capability) else capability
    if (major, minor) != SM90_CAPABILITY:
        if backend == "auto":
            return "portable"
        raise ValueError(f"backend: 'sm90' needs a GPU of compute capability 9.0 (sm_90a: H100, H200), this one "
                         f"has {major}.{minor}")
    return "sm90"

