"""The numbers of a run (``summarize``), its closing table (``format_summary``) and the progress line."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    """A run's numbers. Times in seconds; ``attention_share``: attention calls' time over step time;
    ``mean_decode_step``: mean time of steps that ran only decode rows (None if there were none);
    ``page_utilisation``: mean over steps of pages in use / pool; ``peak_pages``: most pages in use after a
    step; ``waste_fraction``: mean over steps of waste tokens / (pages in use x page size);
    ``max_waste_per_seq``: most waste tokens per live request after a step (below page_size by construction);
    ``p50/p99_token_latency``: time between a request's consecutive output tokens (time to first token apart);
    ``attention_share`` is measured over the steps that ran eagerly (a replayed graph is not timed inside), on a
    GPU as the attention calls' GPU time between CUDA events (no synchronisation inside a step);
    ``routes``: steps by how their decode rows ran ("flat", "cascade", "graph", "cascade graph"); ``policy``: the
    out-of-pages policy, ``stalls``/``swaps``: its stalled growths and swap-outs; ``forks``: completions forked
    (n > 1)."""

    steps: int
    seconds: float
    output_tokens: int
    processed_tokens: int
    tokens_per_s: float
    mean_step: float
    mean_decode_step: float | None
    attention_share: float
    mean_batch: float
    peak_batch: int
    num_pages: int
    page_size: int
    peak_pages: int
    page_utilisation: float
    waste_fraction: float
    max_waste_per_seq: float
    preemptions: int
    delayed_admissions: int
    prefix_hit_tokens: int
    p50_token_latency: float
    p99_token_latency: float
    routes: dict = None
    policy: str = "recompute"
    stalls: int = 0
    swaps: int = 0
    forks: int = 0


def summarize(engine) -> Summary:
    rec = engine.records
    ps, pool = engine.config.page_size, engine.config.num_pages
    seconds = sum(r.seconds for r in rec)
    out = sum(len(r.output) for r in engine.finished) + sum(len(r.output) for r in engine.running)
    processed = sum(r.decode_rows + r.prefill_tokens for r in rec)
    decode_only = [r.seconds for r in rec if r.prefill_tokens == 0 and r.decode_rows]
    batch = [r.decode_rows + (r.prefill_tokens > 0) for r in rec]
    in_use = np.array([r.pages_in_use for r in rec] or [0])
    waste = np.array([r.waste_tokens for r in rec] or [0])
    live = np.array([r.live_seqs for r in rec] or [0])
    gaps = [b - a for r in engine.finished for a, b in zip(r.token_times, r.token_times[1:])]  # after the first
    eager = [r for r in rec if r.route not in ("graph", "cascade graph")]
    eager_seconds = sum(r.seconds for r in eager)
    routes = {}
    for r in rec:
        if r.route:
            routes[r.route] = routes.get(r.route, 0) + 1
    return Summary(
        steps=len(rec), seconds=seconds, output_tokens=out, processed_tokens=processed,
        tokens_per_s=out / seconds if seconds else 0.0, mean_step=seconds / len(rec) if rec else 0.0,
        mean_decode_step=float(np.mean(decode_only)) if decode_only else None,
        attention_share=sum(r.attention_seconds for r in eager) / eager_seconds if eager_seconds else 0.0,
        mean_batch=float(np.mean([r.live_seqs for r in rec])) if rec else 0.0,
        peak_batch=int(live.max()), num_pages=pool, page_size=ps, peak_pages=int(in_use.max()),
        page_utilisation=float(np.mean(in_use) / pool),
        waste_fraction=float(np.mean(np.where(in_use > 0, waste / np.maximum(in_use * ps, 1), 0.0))),
        max_waste_per_seq=float(np.max(np.where(live > 0, waste / np.maximum(live, 1), 0.0))),
        preemptions=engine.preemptions, delayed_admissions=engine.delayed,
        prefix_hit_tokens=engine.prefix_hit_tokens,
        p50_token_latency=float(np.percentile(gaps, 50)) if gaps else 0.0,
        p99_token_latency=float(np.percentile(gaps, 99)) if gaps else 0.0, routes=routes,
        policy=engine.config.out_of_pages, stalls=engine.stalls, swaps=engine.swaps, forks=engine.forks)


_ROUTES = {"flat": "flat decode", "cascade": "through the cascade (shared pages read once a group)",
           "graph": "replayed from CUDA graphs", "cascade graph": "through the cascade replayed from CUDA graphs"}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def format_summary(s: Summary, kernels: str) -> str:
    """The closing table, one fact a line."""
    lines = [
        f"steps               {s.steps} in {s.seconds:.2f} s",
        f"tokens              {s.output_tokens} generated, {s.processed_tokens} through the model "
        f"({s.tokens_per_s:.1f} generated tokens/s)",
        f"step time           mean {_ms(s.mean_step)}; decode-only steps {_ms(s.mean_decode_step)}",
        f"attention share     {s.attention_share:.0%} of step time (GPU time of the attention calls of eager steps)",
        f"decode attention    " + (", ".join(f"{n} step(s) {_ROUTES[k]}" for k, n in sorted((s.routes or {}).items()))
                                   or "no decode rows"),
        f"batch               mean {s.mean_batch:.1f} requests, peak {s.peak_batch}",
        f"pages               peak {s.peak_pages} of {s.num_pages} (page size {s.page_size}), mean utilisation "
        f"{s.page_utilisation:.0%}, tail waste {s.waste_fraction:.1%} of held slots "
        f"(at most {s.max_waste_per_seq:.1f} tokens a request)",
        f"scheduler           out_of_pages={s.policy}: {s.preemptions} preemption(s) ({s.swaps} swapped out), "
        f"{s.stalls} stalled growth(s), {s.delayed_admissions} delayed admission(s), {s.prefix_hit_tokens} prompt "
        f"tokens from the prefix cache, {s.forks} completion(s) forked",
        f"per-token latency   p50 {_ms(s.p50_token_latency)}, p99 {_ms(s.p99_token_latency)}",
        f"kernels             {kernels}",
    ]
    return "\n".join(lines)


class Progress:
    """A progress bar (tqdm, when importable and stderr is a terminal) or a line every ``every`` steps, on stderr:
    off a terminal a redrawn bar would only fill the log."""

    def __init__(self, total_requests: int, every: int = 10):
        self.every, self.total = every, total_requests
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total_requests, unit="req", file=sys.stderr)

    def __call__(self, engine) -> None:
        rec = engine.records[-1] if engine.records else None
        if self._bar is not None:
            self._bar.n = len(engine.finished)
            self._bar.set_postfix(batch=len(engine.running), pages=rec.pages_in_use if rec else 0, refresh=False)
            self._bar.refresh()
            return
        if rec is not None and len(engine.records) % self.every == 0:
            print(f"step {len(engine.records):5d}  done {len(engine.finished)}/{self.total}  batch "
                  f"{len(engine.running):3d}  waiting {len(engine.waiting):3d}  pages {rec.pages_in_use}/"
                  f"{engine.config.num_pages}  step {rec.seconds * 1e3:.1f} ms", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, to the clock tick), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def first_token_line(engine, loop_started_at: float | None) -> str | None:
    """``first token`` line: when the run's first output token came, counted from the process's start
    (``loop_started_at``: the process's age when the loop began); None without a token or a process age."""
    firsts = [r.token_times[0] for r in engine.finished if r.token_times]
    if not firsts or loop_started_at is None:
        return None
    first = min(firsts)
    return (f"first token         {loop_started_at + first:.2f} s after the process started ({loop_started_at:.2f} s "
            f"to the loop: imports, CUDA, model; {first:.2f} s in it: plans, kernel loads or compiles, first step)")
