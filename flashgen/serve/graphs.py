"""CUDA-graph decode for the serving loop: decode-only steps replay one captured graph of the whole layer stack
per route and batch-size bucket.

A bucket of ``b`` rows owns a graph-mode wrapper (its buffers and grid are fixed, so the graph replays after
``plan()`` of any batch up to ``b``): flat steps a ``BatchDecodeWrapper`` (``use_cuda_graph=True``,
``max_batch_size = b``), cascade steps a ``CascadeWrapper`` of ``CASCADE_LEVELS`` levels (``use_cuda_graph=True``:
every level launches, one with nothing shared runs with no KV; the route derives at most that many levels for a
step that would replay). It also owns one device buffer ``[3, b]`` int64 holding the step's token ids,
positions and slots, and the graph. A step of ``n <= b`` decode rows writes its inputs into the buffer (one
copy; rows past ``n`` get token 0, position 0 and slot -1, which ``append_kv`` skips), plans the bucket's
wrapper (page ids copied into the wrapper's own buffers; a cascade's levels as the route derived them) and
replays: per layer the q/k/v projections, RoPE on q, one ``append_kv`` launch that rotates K and writes K/V at
the slots, the attention over the layer's view of the pool, the MLP; then the logits ``[b, vocab]``, of which
rows ``0..n-1`` are the step's. The first step of a bucket runs the forward once outside the capture (kernels
compiled and loaded, caches validated) on a side stream, captures, and replays.

Steps with prefill chunks, and batches larger than the largest bucket, run eagerly (``engine.Engine._forward``).
The pool, the layer views and the weights keep their addresses for the engine's life, as a replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .backends import cascade_plan_levels
from .route import CASCADE_LEVELS

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The bucket sizes a loop of ``max_batch`` running requests uses: powers of two up to the first that holds
    it (at most 512; a larger batch runs eagerly).

    >>> buckets_for(100)
    (1, 2, 4, 8, 16, 32, 64, 128)
    """
    out = tuple(b for b in BUCKETS if b < max_batch)
    return out + tuple(b for b in BUCKETS if b >= max_batch)[:1]


@dataclass
class _Bucket:
    route: str  # "flat" or "cascade"
    size: int
    wrapper: object
    inputs: torch.Tensor  # [3, size] int64: token ids, positions, slots
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """The captured decode steps of one ``Engine`` (its model, cache and wrapper heads); ``captures`` counts the
    graphs captured, ``replays`` the steps served from them."""

    def __init__(self, engine):
        self.engine = engine
        self.buckets = buckets_for(engine.config.max_batch)
        self._built: dict[tuple[str, int], _Bucket] = {}
        self.captures = self.replays = 0

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def forward(self, tokens: list[int], positions: np.ndarray, slots: torch.Tensor, tables, levels=None
                ) -> torch.Tensor:
        """Logits ``[bucket, vocab]`` fp32 of a decode-only step of ``len(tokens)`` rows (rows past it are padding)
        whose decode page tables are ``tables`` (``PageTables``, page ids on the device); ``levels``: the
        cascade's levels (``LevelTable``, host page ids, at most ``CASCADE_LEVELS``) for a cascade step, None
        for a flat one."""
        n = len(tokens)
        size = next(b for b in self.buckets if b >= n)
        route = "flat" if levels is None else "cascade"
        bucket = self._built.get((route, size)) or self._make(route, size)
        host = np.zeros((3, size), dtype=np.int64)
        host[0, :n] = tokens
        host[1, :n] = positions
        host[2, :n] = slots.numpy()
        host[2, n:] = -1
        bucket.inputs.copy_(torch.from_numpy(host))
        e = self.engine
        c = e.model.config
        heads = {"num_qo_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "num_pages": e.cache.num_pages}
        if levels is None:
            bucket.wrapper.plan(**tables.csr(), **heads)
        else:
            bucket.wrapper.plan(levels=cascade_plan_levels(levels), policy=e.backend.cascade_policy, **heads)
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits

    def _make(self, route: str, size: int) -> _Bucket:
        from ..api import BatchDecodeWrapper, CascadeWrapper

        e = self.engine
        device = e.model.device
        pages = size * e.cache.num_pages  # bounds the page ids of a level as of the whole batch
        if route == "flat":
            wrapper = BatchDecodeWrapper(e.backend.decode_spec, use_cuda_graph=True, max_batch_size=size,
                                         device=device, max_num_pages=pages)
        else:
            wrapper = CascadeWrapper(e.backend.decode_spec, num_levels=CASCADE_LEVELS, use_cuda_graph=True,
                                     max_batch_size=size, device=device, max_num_pages=pages)
        bucket = self._built[route, size] = _Bucket(route, size, wrapper,
                                                    torch.zeros((3, size), dtype=torch.int64, device=device))
        return bucket

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        e = self.engine
        tokens, positions, slots = bucket.inputs

        def attend(layer: int, q, k, v):
            e.write_kv(layer, slots, positions, k, v)
            return bucket.wrapper.run(q, e.layer_kv(layer))

        return e.model.forward(tokens, positions, attend, rotate_k=not e._fused_rope)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up outside the capture (compile, load, validate; the writes are this step's own), then capture."""
        side = torch.cuda.Stream(device=self.engine.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph):
            bucket.logits = self._run(bucket)
        self.captures += 1
