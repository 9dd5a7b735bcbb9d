"""What paging is for, measured by the loop: one workload served several ways, each run a fresh ``Engine``.

- ``compare_contiguous``: at one memory budget (``num_pages * page_size`` token slots), the paged cache against a
  contiguous per-request reservation for the maximum length. The reservation is served by the same loop and
  kernels as a paged cache whose page holds the maximum length (one page a request, no prefix sharing, nothing
  to grow into): what a server without paging reserves. It reports how many requests ran together and the
  tokens/s of each (vLLM's paper reports 2-4x more throughput from the first).
- ``compare_policies``: the workload under memory pressure once per out-of-pages policy: admissions delayed,
  preemptions, stalls, and what each does to per-token latency (p50 / p99).
- ``sweep_page_size``: one workload at page sizes 1..256 with the same token budget: tail waste (at most one
  partial page a request) beside the decode step time.

Every run is checked the same way by the caller (outputs against the dense loop, or equal across runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..kvcache import POLICIES
from .engine import Engine, EngineConfig, Request
from .model import TinyLlama
from .report import Summary, summarize

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# make_backend(page_size) -> a backend for the model's heads at that page size
BackendFactory = Callable[[int], object]


@dataclass(frozen=True)
class Run:
    """One served run: ``label``, its ``config``, its ``summary``, and the finished requests by id."""

    label: str
    config: EngineConfig
    summary: Summary
    outputs: dict

    @property
    def requests_together(self) -> tuple[float, int]:
        return self.summary.mean_batch, self.summary.peak_batch


def fresh(requests: list[Request]) -> list[Request]:
    """Unserved copies of ``requests`` (a Request records its serving)."""
    return [Request(r.rid, list(r.prompt), r.max_new_tokens, n=r.n) for r in requests]


WARM_REQUESTS = 4  # requests a warm-up serves before a measured run of another configuration


def serve(model: TinyLlama, config: EngineConfig, make_backend: BackendFactory, requests: list[Request],
          label: str, max_steps: int | None = None, warm: bool = False) -> tuple[Run, Engine]:
    """Serve fresh copies of ``requests`` under ``config``; the run and its engine. ``warm``: first serve the
    first ``WARM_REQUESTS`` requests under the same configuration and drop that run, so that kernels this
    configuration compiles or loads (another page size compiles its own) stay out of the measured steps."""
    if warm:
        warm_up = Engine(model, config, make_backend(config.page_size))
        warm_up.submit(fresh(requests[:WARM_REQUESTS]))
        warm_up.run(max_steps)
    engine = Engine(model, config, make_backend(config.page_size))
    engine.submit(fresh(requests))
    engine.run(max_steps)
    outputs = {r.rid: list(r.output) for r in engine.finished}
    return Run(label, config, summarize(engine), outputs), engine


def max_length(requests: list[Request]) -> int:
    """The longest request: prompt plus output tokens (the K/V it holds at its end, plus one)."""
    return max(len(r.prompt) + r.max_new_tokens for r in requests)


def pages_for(requests: list[Request], page_size: int) -> int:
    """Pages the longest request holds at its end."""
    return max(-(-(len(r.prompt) + r.max_new_tokens - 1) // page_size) for r in requests)


def contiguous_config(config: EngineConfig, max_len: int) -> EngineConfig:
    """``config``'s token budget as contiguous reservations of ``max_len`` tokens: one page of ``max_len`` a
    request, no prefix sharing, no headroom (a reservation never grows)."""
    budget = config.num_pages * config.page_size
    slots = budget // max_len
    if slots < 1:
        raise ValueError(f"pages: a budget of {config.num_pages} x {config.page_size} = {budget} token slots holds no "
                         f"reservation of the maximum length {max_len}; expected at least {max_len} slots")
    return replace(config, num_pages=slots, page_size=max_len, prefix_cache=False, headroom=0)


def compare_contiguous(model: TinyLlama, config: EngineConfig, make_backend: BackendFactory,
                       requests: list[Request], max_len: int | None = None,
                       max_steps: int | None = None) -> tuple[Run, Run]:
    """(paged, contiguous) runs of one workload at one memory budget (module docstring). ``max_len``: the
    reservation (default: the workload's longest request)."""
    max_len = max_len or max_length(requests)
    if max_len < max_length(requests):
        raise ValueError(f"max_len: got {max_len}, shorter than the longest request ({max_length(requests)} tokens)")
    paged, _ = serve(model, config, make_backend, requests, f"paged, page size {config.page_size}", max_steps,
                     warm=True)
    contiguous, _ = serve(model, contiguous_config(config, max_len), make_backend, requests,
                          f"contiguous, {max_len} tokens a request", max_steps, warm=True)
    return paged, contiguous


def format_contiguous(paged: Run, contiguous: Run) -> str:
    budget = paged.config.num_pages * paged.config.page_size
    c = contiguous.config
    ratio = lambda a, b: a / b if b else 0.0  # noqa: E731
    lines = [f"paged vs contiguous reservation at one budget of {budget} token slots (per layer and KV head); "
             f"the contiguous cache fits {c.num_pages} reservation(s) of {c.page_size} tokens:",
             f"  {'cache':<36} {'mean batch':>10} {'peak batch':>10} {'tokens/s':>10} {'steps':>6} {'delayed':>7}"]
    for run in (paged, contiguous):
        s = run.summary
        lines.append(f"  {run.label:<36} {s.mean_batch:>10.1f} {s.peak_batch:>10d} {s.tokens_per_s:>10.1f} "
                     f"{s.steps:>6d} {s.delayed_admissions:>7d}")
    lines.append(f"  paged: {ratio(paged.summary.mean_batch, contiguous.summary.mean_batch):.2f}x the requests running "
                 f"together, {ratio(paged.summary.tokens_per_s, contiguous.summary.tokens_per_s):.2f}x the tokens/s")
    return "\n".join(lines)


def pressure_config(config: EngineConfig, requests: list[Request]) -> EngineConfig:
    """``config`` with a pool under memory pressure: a quarter of the pages the whole workload holds at its
    end, at most half of ``config``'s pool, and at least the longest request's pages plus one."""
    ps = config.page_size
    total = sum(-(-(len(r.prompt) + r.max_new_tokens - 1) // ps) * r.n for r in requests)
    return replace(config, num_pages=max(pages_for(requests, ps) + 1, min(total // 4, config.num_pages // 2)))


def compare_policies(model: TinyLlama, config: EngineConfig, make_backend: BackendFactory, requests: list[Request],
                     policies: tuple[str, ...] = POLICIES, max_steps: int | None = None) -> list[Run]:
    """One run a policy of the workload under ``config`` (pass ``pressure_config(...)`` for pressure)."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policies: got {p!r}, expected names from {', '.join(POLICIES)}")
    return [serve(model, replace(config, out_of_pages=p), make_backend, requests, p, max_steps)[0]
            for p in policies]


def format_policies(runs: list[Run]) -> str:
    c = runs[0].config
    lines = [f"out-of-pages policies under memory pressure ({c.num_pages} pages of {c.page_size}):",
             f"  {'policy':<10} {'p50 token':>10} {'p99 token':>10} {'preempted':>9} {'swapped':>7} {'stalls':>6} "
             f"{'delayed':>7} {'steps':>6} {'tokens/s':>9}"]
    for run in runs:
        s = run.summary
        lines.append(f"  {run.label:<10} {s.p50_token_latency * 1e3:>8.2f}ms {s.p99_token_latency * 1e3:>8.2f}ms "
                     f"{s.preemptions:>9d} {s.swaps:>7d} {s.stalls:>6d} {s.delayed_admissions:>7d} {s.steps:>6d} "
                     f"{s.tokens_per_s:>9.1f}")
    return "\n".join(lines)


def sweep_page_size(model: TinyLlama, config: EngineConfig, make_backend: BackendFactory, requests: list[Request],
                    sizes: tuple[int, ...] = PAGE_SIZES, max_steps: int | None = None) -> list[Run]:
    """One run a page size, each with ``config``'s token budget (at least the longest request's pages), each
    after a warm-up at its page size (``serve(warm=True)``)."""
    budget = config.num_pages * config.page_size
    runs = []
    for ps in sizes:
        pages = max(budget // ps, pages_for(requests, ps))
        runs.append(serve(model, replace(config, num_pages=pages, page_size=ps), make_backend, requests,
                          f"{ps}", max_steps, warm=True)[0])
    return runs


def format_sweep(runs: list[Run]) -> str:
    lines = ["page-size sweep (one workload, one token budget): tail waste beside decode step time",
             f"  {'page':>5} {'pages':>6} {'tail waste':>10} {'waste/req':>9} {'peak batch':>10} {'decode step':>11} "
             f"{'tokens/s':>9}"]
    for run in runs:
        s = run.summary
        step = "n/a" if s.mean_decode_step is None else f"{s.mean_decode_step * 1e3:.2f}ms"
        lines.append(f"  {run.config.page_size:>5} {run.config.num_pages:>6} {s.waste_fraction:>10.1%} "
                     f"{s.max_waste_per_seq:>9.1f} {s.peak_batch:>10d} {step:>11} {s.tokens_per_s:>9.1f}")
    return "\n".join(lines)
