"""Continuous batching over ``PagedKVCache``: admit, chunked prefill and decode in one step, free, preempt.

One cache manager holds every layer: its pool has ``num_layers * num_kv_heads`` KV heads, layer ``l`` owning
heads ``l * num_kv_heads ... (l + 1) * num_kv_heads - 1``, so one page table serves all layers and the
manager's page copies (copy-on-write, swap) and prefix-cache pages cover every layer at once. Layer ``l``'s
view of the pool (``[pages, page_size, num_kv_heads, head_dim]``, strided) is what the wrappers read.

A step:
1. running requests, oldest admission first, take their next chunk (a decode is a chunk of one token) within
   the step's token budget; ``cache.allocate`` takes their pages, and when the free list runs dry the cache
   preempts the most recently admitted requests (``out_of_pages="recompute"``): they leave the step and go
   back to the front of the queue with their tokens so far (prompt + output), to be recomputed;
2. waiting requests are admitted while the budget, ``max_batch`` and the pages allow: a request's first chunk
   must fit in free plus cached pages with one page of headroom per running request, else admission waits
   (``delayed``); ``cache.add(id, tokens)`` gives the cached prefix, which is not recomputed;
3. one ``plan`` per step (decode rows, prefill chunks), the model's layers each write the new K/V at the
   allocated slots and run the attention; rows that end a request's known tokens are sampled;
4. finished requests free their pages.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kvcache import OutOfPages, PagedKVCache
from .backends import StepPlan
from .model import TinyLlama, sample


@dataclass
class Request:
    """A request: ``prompt`` token ids and ``max_new_tokens``; ``output`` grows as it is served.
    ``computed``: leading tokens whose K/V is in the cache."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    computed: int = 0
    cached_tokens: int = 0  # prefix-cache hits, summed over admissions
    preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds from the run's start to each output token

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass(frozen=True)
class EngineConfig:
    """``num_pages`` of ``page_size`` tokens (all layers); ``max_tokens_per_step``: the step's token budget
    (decode rows count one each; prefill chunks take the rest); ``max_batch``: running requests at most."""

    num_pages: int = 64
    page_size: int = 4
    max_tokens_per_step: int = 32
    max_batch: int = 16
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_tokens_per_step", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: got {self.temperature!r}, expected a number >= 0 (0: greedy)")


@dataclass(frozen=True)
class StepRecord:
    """What one step did: requests and tokens, seconds (whole step, attention calls), pages after it."""

    decode_rows: int
    prefill_tokens: int
    seconds: float
    attention_seconds: float
    pages_in_use: int
    waste_tokens: int
    live_seqs: int


class Engine:
    """The serving loop. ``backend``: ``ReferenceAttention`` or ``WrapperAttention`` (same heads and page size
    as the model and ``config``); ``dtype``/``device``: the cache's (the model's).

    >>> engine = Engine(model, EngineConfig(), ReferenceAttention(16, 4, 4, 2))  # doctest: +SKIP
    >>> engine.submit(requests); engine.run(); engine.finished[0].output  # doctest: +SKIP
    """

    def __init__(self, model: TinyLlama, config: EngineConfig, backend):
        c = model.config
        self.model, self.config, self.backend = model, config, backend
        self.cache = PagedKVCache(config.num_pages, config.page_size, c.num_layers * c.num_kv_heads, c.head_dim,
                                  model.dtype, device=model.device, kv_form="pair", out_of_pages="recompute")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.records: list[StepRecord] = []
        self.preemptions = self.delayed = self.prefix_hit_tokens = 0
        self._by_id: dict[int, Request] = {}
        self._sync = model.device.type == "cuda"
        self._start = None
        self._attention_seconds = 0.0

    # ------------------------------------------------------------------------------------------ queue

    def submit(self, requests: list[Request]) -> None:
        """Queue requests (ids unique). One whose prompt and output cannot fit in the whole pool is refused."""
        ps = self.config.page_size
        for i, r in enumerate(requests):
            if r.rid in self._by_id:
                raise ValueError(f"requests[{i}]: id {r.rid} is already queued")
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}]: expected a non-empty prompt and max_new_tokens >= 1, got "
                                 f"{len(r.prompt)} prompt tokens, max_new_tokens={r.max_new_tokens}")
            need = -(-(len(r.prompt) + r.max_new_tokens - 1) // ps)
            if need > self.config.num_pages:
                raise ValueError(f"requests[{i}]: needs {need} pages for {len(r.prompt)} prompt + "
                                 f"{r.max_new_tokens} output tokens, the pool has num_pages = {self.config.num_pages}")
            self._by_id[r.rid] = r
            self.waiting.append(r)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def run(self, max_steps: int | None = None, progress=None) -> None:
        """Step until every request is done (or ``max_steps``); ``progress(engine)`` after each step."""
        steps = 0
        while not self.idle and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
            if progress is not None:
                progress(self)

    # ------------------------------------------------------------------------------------------ a step

    def step(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()
        t0 = time.perf_counter()
        batch: dict[int, tuple[Request, int, torch.Tensor]] = {}
        budget = self._schedule_running(batch, self.config.max_tokens_per_step)
        self._admit(batch, budget)
        if not batch:
            if self.running or self.waiting:
                raise RuntimeError("the scheduler made no progress: no request fits the pool")
            return
        self._attention_seconds = 0.0
        self._forward(list(batch.values()))
        if self._sync:
            torch.cuda.synchronize()
        s = self.cache.stats()
        entries = list(batch.values())
        decode_rows = sum(1 for _, n, _ in entries if n == 1)
        self.records.append(StepRecord(decode_rows, sum(n for _, n, _ in entries if n > 1),
                                       time.perf_counter() - t0, self._attention_seconds, s.pages_in_use,
                                       s.waste_tokens, s.live_seqs))

    def _schedule_running(self, batch: dict, budget: int) -> int:
        for r in list(self.running):
            if budget == 0:
                break
            if r not in self.running:  # preempted earlier in this step
                continue
            n = min(len(r.tokens) - r.computed, budget)
            if self._grow(r, n, batch):
                budget -= n
        return budget

    def _admit(self, batch: dict, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            r = self.waiting[0]
            cached = self.cache.add(r.rid, tokens=r.tokens)
            n = min(len(r.tokens) - cached, budget)
            need = self.cache.pages_needed(r.rid, n)
            s = self.cache.stats()
            if need + len(self.running) > s.pages_free + s.pages_cached:
                self.cache.free(r.rid)
                self.delayed += 1
                return
            self.waiting.popleft()
            r.computed = cached
            r.cached_tokens += cached
            self.prefix_hit_tokens += cached
            self.running.append(r)
            if self._grow(r, n, batch):
                budget -= n

    def _grow(self, r: Request, n: int, batch: dict) -> bool:
        """Allocate ``n`` slots for ``r``'s next tokens; handle the preemptions this causes. False if ``r``
        itself could not be placed (it is re-queued)."""
        try:
            slots = self.cache.allocate(r.rid, n, tokens=r.tokens[r.computed: r.computed + n])
        except OutOfPages:
            self._requeue(r)
            return False
        for p in self.cache.take_preempted():
            victim = self._by_id[p.seq_id]
            batch.pop(victim.rid, None)
            self._requeue(victim, freed=True)
        batch[r.rid] = (r, n, slots)
        return True

    def _requeue(self, r: Request, freed: bool = False) -> None:
        if not freed and r.rid in self.cache:
            self.cache.free(r.rid)
        self.running.remove(r)
        r.computed = 0
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------------------------------ forward

    def _forward(self, entries: list[tuple[Request, int, torch.Tensor]]) -> None:
        entries.sort(key=lambda e: e[1] > 1)  # decode rows first, then the prefill chunks
        decodes = [e for e in entries if e[1] == 1]
        prefills = [e for e in entries if e[1] > 1]
        device = self.model.device
        tokens = [t for r, n, _ in entries for t in r.tokens[r.computed: r.computed + n]]
        positions = np.concatenate([np.arange(r.computed, r.computed + n) for r, n, _ in entries])
        slots = torch.cat([s for _, _, s in entries]).to(device, torch.int64)
        ends = np.cumsum([n for _, n, _ in entries]) - 1
        sampled = [i for i, (r, n, _) in enumerate(entries) if r.computed + n == len(r.tokens)]
        decode_tables = self.cache.page_tables([r.rid for r, _, _ in decodes], device) if decodes else None
        prefill = None
        if prefills:
            qo = np.zeros(len(prefills) + 1, dtype=np.int32)
            np.cumsum([n for _, n, _ in prefills], out=qo[1:])
            prefill = (qo, self.cache.page_tables([r.rid for r, _, _ in prefills], device))
        self.backend.plan(StepPlan(decode_tables, prefill), self.cache.num_pages)
        logits = self.model.forward(torch.tensor(tokens), torch.from_numpy(positions),
                                    lambda layer, q, k, v: self._attend(layer, slots, q, k, v),
                                    torch.from_numpy(ends[sampled]))
        keys = [(entries[i][0].rid, len(entries[i][0].output)) for i in sampled]
        next_tokens = sample(logits, keys, self.config.temperature, self.config.seed)
        now = time.perf_counter() - self._start
        for r, n, _ in entries:
            r.computed += n
        for i, token in zip(sampled, next_tokens):
            r = entries[i][0]
            r.output.append(token)
            r.token_times.append(now)
            if r.done:
                self.cache.free(r.rid)
                self.running.remove(r)
                self.finished.append(r)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V: views ``[num_pages, page_size, num_kv_heads, head_dim]`` of the pool."""
        h = self.model.config.num_kv_heads
        k, v = self.cache.kv
        return k[:, :, layer * h: (layer + 1) * h], v[:, :, layer * h: (layer + 1) * h]

    def _attend(self, layer: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        h = self.model.config.num_kv_heads
        pool_k, pool_v = self.cache.kv
        heads = slice(layer * h, (layer + 1) * h)
        pool_k.view(-1, *pool_k.shape[2:])[slots, heads] = k.to(pool_k.dtype)
        pool_v.view(-1, *pool_v.shape[2:])[slots, heads] = v.to(pool_v.dtype)
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.backend.run(q, self.layer_kv(layer))
        if self._sync:
            torch.cuda.synchronize()
        self._attention_seconds += time.perf_counter() - t0
        return out
