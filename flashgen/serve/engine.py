"""Continuous batching over ``PagedKVCache``: admit, chunked prefill and decode in one step, fork, free, preempt.

One cache manager holds every layer: its pool has ``num_layers * num_kv_heads`` KV heads, layer ``l`` owning
heads ``l * num_kv_heads ... (l + 1) * num_kv_heads - 1``, so one page table serves all layers and the
manager's page copies (copy-on-write, swap) and prefix-cache pages cover every layer at once. Layer ``l``'s
view of the pool (``[pages, page_size, num_kv_heads, head_dim]``, strided) is what the wrappers read.

A step:
1. running requests, oldest admission first, take their next chunk (a decode is a chunk of one token) within
   the step's token budget; ``cache.allocate`` takes their pages. When the free list runs dry the cache's
   out-of-pages policy (``EngineConfig.out_of_pages``) decides: ``recompute`` preempts the most recently
   admitted requests (freed: they go back to the front of the queue with their tokens so far, to be
   recomputed); ``swap`` copies theirs to host memory (re-admission resumes them, nothing recomputed);
   ``raise`` and ``evict`` (cached prefix pages reclaimed first) preempt nobody: the request that cannot
   grow stalls this step, and a step in which every running request stalls frees the newest one
   (recomputed later) so the rest go on;
2. waiting requests are admitted while the budget, ``max_batch`` and the pages allow: a request's first chunk
   must fit in the pages it may take with ``headroom`` pages per running request to spare, else admission
   waits (``delayed``); ``cache.add(id, tokens)`` gives the cached prefix, which is not recomputed;
3. one ``plan`` per step (decode rows, ordered so that requests sharing leading pages sit together, then
   the prefill chunks), the model's layers each write the new K/V at the allocated slots (on the GPU one
   ``append_kv`` launch that rotates K too) and run the attention; rows that end a request's known tokens
   are sampled. A request with ``n > 1`` is forked (``cache.fork``) into ``n - 1`` more completions once
   its prompt is computed: they share its pages and sample their own tokens. On the GPU, decode-only steps
   replay a CUDA graph of the whole layer stack per route and batch-size bucket (``graphs.DecodeGraphs``);
4. finished requests free their pages.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kvcache import POLICIES, OutOfPages, PagedKVCache
from .backends import StepPlan
from .model import TinyLlama, sample

CHILD_STRIDE = 1 << 20  # completion j of request rid (n > 1) is served as request rid + j * CHILD_STRIDE
MAX_SAMPLES = 64


@dataclass
class Request:
    """A request: ``prompt`` token ids and ``max_new_tokens``; ``output`` grows as it is served.
    ``computed``: leading tokens whose K/V is in the cache. ``n``: completions (parallel sampling): the
    request and ``n - 1`` forks of it, ids ``rid + j * CHILD_STRIDE``, that share its prompt's pages;
    ``parent``: the request a fork came from."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    computed: int = 0
    cached_tokens: int = 0  # prefix-cache hits, summed over admissions
    preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # seconds from the run's start to each output token
    n: int = 1
    parent: int | None = None
    forked: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass(frozen=True)
class EngineConfig:
    """``num_pages`` of ``page_size`` tokens (all layers); ``max_tokens_per_step``: the step's token budget
    (decode rows count one each; prefill chunks take the rest); ``max_batch``: running requests at most
    (forks of a request join it past this); ``out_of_pages``: the cache's policy (module docstring);
    ``headroom``: free pages kept per running request when admitting; ``prefix_cache``: share full prompt
    pages; ``cuda_graphs``: replay decode-only steps from CUDA graphs (GPU wrappers only)."""

    num_pages: int = 64
    page_size: int = 4
    max_tokens_per_step: int = 32
    max_batch: int = 16
    temperature: float = 0.0
    seed: int = 0
    out_of_pages: str = "recompute"
    headroom: int = 1
    prefix_cache: bool = True
    cuda_graphs: bool = True

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_tokens_per_step", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected an int >= 1")
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, int) or self.headroom < 0:
            raise ValueError(f"headroom: got {self.headroom!r}, expected an int >= 0")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: got {self.temperature!r}, expected a number >= 0 (0: greedy)")
        if self.out_of_pages not in POLICIES:
            raise ValueError(f"out_of_pages: got {self.out_of_pages!r}, expected one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class StepRecord:
    """What one step did: requests and tokens, seconds (whole step, attention calls: 0 for a replayed graph),
    pages after it, and how the decode rows' attention ran (``route``: "flat", "cascade", "graph" (flat, replayed),
    "cascade graph" or "")."""

    decode_rows: int
    prefill_tokens: int
    seconds: float
    attention_seconds: float
    pages_in_use: int
    waste_tokens: int
    live_seqs: int
    route: str = ""


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
                                  model.dtype, device=model.device, kv_form="pair", out_of_pages=config.out_of_pages,
                                  prefix_cache=config.prefix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.records: list[StepRecord] = []
        self.preemptions = self.delayed = self.prefix_hit_tokens = self.stalls = self.swaps = self.forks = 0
        self._by_id: dict[int, Request] = {}
        self._sync = model.device.type == "cuda"
        # on the GPU the cache write rotates K (append_kv's RoPE, one launch): the model leaves K unrotated
        self._fused_rope = self._sync and model.dtype in (torch.float16, torch.bfloat16)
        if self._fused_rope:
            from ..spec import RoPE

            self._rope = RoPE(c.rope_theta)
        else:
            self._rope = None
        self.graphs = None
        if self._fused_rope and config.cuda_graphs and getattr(backend, "graphs_ok", False):
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        self._start = None
        self._attention_seconds = 0.0
        self._events: list = []  # (start, end) CUDA event pairs around attention calls, reused step to step
        self._timed = 0
        self._layer_kv = None

    # ------------------------------------------------------------------------------------------ queue

    def submit(self, requests: list[Request]) -> None:
        """Queue requests (ids unique; with ``n > 1`` an id below ``CHILD_STRIDE``, the forks taking the ids
        above). One whose prompt and output cannot fit in the whole pool is refused."""
        ps = self.config.page_size
        for i, r in enumerate(requests):
            ids = [r.rid + j * CHILD_STRIDE for j in range(r.n)] if isinstance(r.n, int) else [r.rid]
            if any(x in self._by_id for x in ids):
                raise ValueError(f"requests[{i}]: id {r.rid} (or one of its forks' ids) is already queued")
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}]: expected a non-empty prompt and max_new_tokens >= 1, got "
                                 f"{len(r.prompt)} prompt tokens, max_new_tokens={r.max_new_tokens}")
            if isinstance(r.n, bool) or not isinstance(r.n, int) or not 1 <= r.n <= MAX_SAMPLES:
                raise ValueError(f"requests[{i}]: n = {r.n!r}, expected an int in 1..{MAX_SAMPLES} (completions)")
            if r.n > 1 and not 0 <= r.rid < CHILD_STRIDE:
                raise ValueError(f"requests[{i}]: id {r.rid} with n = {r.n}: expected an id in 0..{CHILD_STRIDE - 1} "
                                 f"(its forks take ids rid + j * {CHILD_STRIDE})")
            need = -(-(len(r.prompt) + r.max_new_tokens - 1) // ps)
            if need > self.config.num_pages:
                raise ValueError(f"requests[{i}]: needs {need} pages for {len(r.prompt)} prompt + "
                                 f"{r.max_new_tokens} output tokens, the pool has num_pages = {self.config.num_pages}")
            for x in ids:
                self._by_id[x] = r
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
        for rid in batch:  # scheduled requests were kept from preemption while pages were taken
            self.cache.protect(rid, False)
        if not batch:
            if self.running or self.waiting:
                self._unstick()
            return
        self._attention_seconds = 0.0
        self._timed = 0
        route = self._forward(list(batch.values()))
        if self._sync:
            torch.cuda.synchronize()
            self._attention_seconds = sum(start.elapsed_time(end) for start, end in self._events[:self._timed]) / 1e3
        s = self.cache.stats()
        entries = list(batch.values())
        decode_rows = sum(1 for _, n, _ in entries if n == 1)
        self.records.append(StepRecord(decode_rows, sum(n for _, n, _ in entries if n > 1),
                                       time.perf_counter() - t0, self._attention_seconds, s.pages_in_use,
                                       s.waste_tokens, s.live_seqs, route))

    def _unstick(self) -> None:
        """Nothing could run this step: reclaim cached prefix pages, else free the newest running request (it is
        recomputed later), so that the others can grow."""
        if self.cache.evict():
            return
        if not self.running:
            raise RuntimeError("the scheduler made no progress: no request fits the pool")
        self._requeue(self.running[-1])  # the newest

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

    def _available(self) -> int:
        """Pages an admission may count on: free ones, and cached prefix pages where the policy reclaims them."""
        s = self.cache.stats()
        return s.pages_free + (s.pages_cached if self.config.out_of_pages != "raise" else 0)

    def _admit(self, batch: dict, budget: int) -> None:
        ps = self.config.page_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch:
            r = self.waiting[0]
            headroom = self.config.headroom * len(self.running)
            if r.rid in self.cache:  # swapped out: bring its pages back (truncate: keep what was computed)
                n = min(len(r.tokens) - r.computed, budget)
                need = max(-(-self.cache.seq_len(r.rid) // ps), -(-(r.computed + n) // ps))
                if need + headroom > self._available():
                    self.delayed += 1
                    return
                try:
                    self.cache.resume(r.rid)
                except OutOfPages:
                    self.delayed += 1
                    return
                self.cache.truncate(r.rid, r.computed)
                self.waiting.popleft()
                self.running.append(r)
                self._take_preempted(batch)
            else:
                cached = self.cache.add(r.rid, tokens=r.tokens)
                n = min(len(r.tokens) - cached, budget)
                if self.cache.pages_needed(r.rid, n) + headroom > self._available():
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
        itself could not be placed: it stalls (``raise``, ``evict``: it keeps its pages) or is re-queued."""
        try:
            slots = self.cache.allocate(r.rid, n, tokens=r.tokens[r.computed: r.computed + n])
        except OutOfPages:  # every unscheduled request was preempted and it is still short: r is the victim
            if self.config.out_of_pages in ("raise", "evict"):
                self.stalls += 1
            elif self.config.out_of_pages == "swap" and r.rid in self.cache:
                self.cache.preempt(r.rid)
                self._take_preempted(batch)
            else:
                self._requeue(r)
            return False
        self._take_preempted(batch)
        # a victim must not be one of this step's requests: their new slots are not written yet, and a page they
        # fill is already keyed in the prefix cache (a later match would read it)
        self.cache.protect(r.rid)
        batch[r.rid] = (r, n, slots)
        return True

    def _take_preempted(self, batch: dict) -> None:
        for p in self.cache.take_preempted():
            victim = self._by_id[p.seq_id]
            batch.pop(victim.rid, None)
            if p.kind == "swap":  # its K/V waits in host memory: it keeps ``computed``
                self.running.remove(victim)
                victim.preemptions += 1
                self.preemptions += 1
                self.swaps += 1
                self.waiting.appendleft(victim)
            else:
                self._requeue(victim, freed=True)

    def _requeue(self, r: Request, freed: bool = False) -> None:
        if not freed and r.rid in self.cache:
            self.cache.free(r.rid)
        self.running.remove(r)
        r.computed = 0
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------------------------------ forward

    def _forward(self, entries: list[tuple[Request, int, torch.Tensor]]) -> str:
        # decode rows first, those sharing leading pages next to each other (the cascade's derived levels group
        # consecutive requests), then the prefill chunks
        first = {r.rid: self.cache.first_page(r.rid) for r, n, _ in entries if n == 1}
        entries.sort(key=lambda e: (e[1] > 1, first.get(e[0].rid, 0)))
        decodes = [e for e in entries if e[1] == 1]
        prefills = [e for e in entries if e[1] > 1]
        device = self.model.device
        tokens = [t for r, n, _ in entries for t in r.tokens[r.computed: r.computed + n]]
        positions = np.concatenate([np.arange(r.computed, r.computed + n) for r, n, _ in entries])
        slots = torch.cat([s for _, _, s in entries])
        ends = np.cumsum([n for _, n, _ in entries]) - 1
        sampled = [i for i, (r, n, _) in enumerate(entries) if r.computed + n == len(r.tokens)]
        decode_tables = self.cache.page_tables([r.rid for r, _, _ in decodes], device) if decodes else None
        prefill = None
        if prefills:
            qo = np.zeros(len(prefills) + 1, dtype=np.int32)
            np.cumsum([n for _, n, _ in prefills], out=qo[1:])
            prefill = (qo, self.cache.page_tables([r.rid for r, _, _ in prefills], device))
        replayable = prefill is None and self.graphs is not None and self.graphs.fits(len(decodes))
        step = StepPlan(decode_tables, prefill, self.model.config.num_layers, replayable)
        route = self.backend.route(step)
        if replayable:  # flat or through the cascade, one graph of the whole layer stack
            levels = self.backend.levels if route == "cascade" else None
            logits = self.graphs.forward(tokens, positions, slots, decode_tables, levels)
            logits = logits[torch.from_numpy(ends[sampled]).to(logits.device)]
            route = "graph" if levels is None else "cascade graph"
        else:
            self.backend.plan(step, self.cache.num_pages)
            pos = torch.from_numpy(positions)
            slots_dev = slots.to(device, torch.int64 if device.type == "cpu" else torch.int32)
            pos_dev = pos.to(device, torch.int32) if self._fused_rope else None
            logits = self.model.forward(torch.tensor(tokens), pos,
                                        lambda layer, q, k, v: self._attend(layer, slots_dev, pos_dev, q, k, v),
                                        torch.from_numpy(ends[sampled]), rotate_k=not self._fused_rope)
        self._sample(entries, sampled, logits)
        return route

    def _sample(self, entries: list, sampled: list[int], logits: torch.Tensor) -> None:
        keys = [(entries[i][0].rid, len(entries[i][0].output)) for i in sampled]
        next_tokens = sample(logits, keys, self.config.temperature, self.config.seed)
        now = time.perf_counter() - self._start
        for r, n, _ in entries:
            r.computed += n
        for row, (i, token) in enumerate(zip(sampled, next_tokens)):
            r = entries[i][0]
            if r.n > 1 and not r.forked:
                self._fork(r, logits[row: row + 1], now)
            self._emit(r, token, now)

    def _fork(self, r: Request, logits: torch.Tensor, now: float) -> None:
        """Start ``r``'s ``n - 1`` other completions: each shares its pages (``cache.fork``) and samples its first
        token from the same logits with its own key."""
        r.forked = True
        children = [Request(r.rid + j * CHILD_STRIDE, list(r.prompt), r.max_new_tokens, computed=r.computed,
                            parent=r.rid) for j in range(1, r.n)]
        tokens = sample(logits.expand(len(children), -1), [(c.rid, 0) for c in children], self.config.temperature,
                        self.config.seed)
        for child, token in zip(children, tokens):
            self.cache.fork(r.rid, child.rid)
            self._by_id[child.rid] = child
            self.running.append(child)
            self.forks += 1
            self._emit(child, token, now)

    def _emit(self, r: Request, token: int, now: float) -> None:
        r.output.append(token)
        r.token_times.append(now)
        if r.done:
            self.cache.free(r.rid)
            self.running.remove(r)
            self.finished.append(r)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V: views ``[num_pages, page_size, num_kv_heads, head_dim]`` of the pool (made
        once: the wrappers remember a validated cache by its address and shape)."""
        if self._layer_kv is None:
            h = self.model.config.num_kv_heads
            k, v = self.cache.kv
            self._layer_kv = [(k[:, :, i * h: (i + 1) * h], v[:, :, i * h: (i + 1) * h])
                              for i in range(self.model.config.num_layers)]
        return self._layer_kv[layer]

    def write_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor | None, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Write layer ``layer``'s new K/V at ``slots`` (on the GPU one append_kv launch, rotating K)."""
        h = self.model.config.num_kv_heads
        self.cache.write(slots, k, v, heads=slice(layer * h, (layer + 1) * h), positions=positions, rope=self._rope)

    def _attend(self, layer: int, slots: torch.Tensor, positions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The cache write, then attention; on a GPU the attention's GPU time is taken between two CUDA events
        (read once the step has synchronised: no wait inside the step)."""
        self.write_kv(layer, slots, positions, k, v)
        if not self._sync:
            t0 = time.perf_counter()
            out = self.backend.run(q, self.layer_kv(layer))
            self._attention_seconds += time.perf_counter() - t0
            return out
        if self._timed == len(self._events):
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        start, end = self._events[self._timed]
        self._timed += 1
        start.record()
        out = self.backend.run(q, self.layer_kv(layer))
        end.record()
        return out
