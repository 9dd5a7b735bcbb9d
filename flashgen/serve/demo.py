"""``flashgen demo``: the serving loop on a random-weight Llama-style model, checked against the dense reference
loop, with a closing summary, and the studies of what paging is for (``studies.py``) on request. Without a GPU it
runs at a tiny size through the fp64 reference."""

from __future__ import annotations

import argparse
import random
import time

import torch

from .dense import check_against_dense
from .engine import CHILD_STRIDE, Engine, EngineConfig, Request
from .flags import DEFAULTS
from .model import ModelConfig, TinyLlama
from .report import Progress, first_token_line, format_summary, process_age, summarize


def workload(num_requests: int, vocab: int, system_tokens: int, seed: int, long: bool,
             samples: int = 1) -> list[Request]:
    """Mixed prompt and output lengths; every third request starts with one shared system prompt of
    ``system_tokens`` (its full pages come from the prefix cache after the first); every fourth asks for
    ``samples`` completions (parallel sampling through ``fork``)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_tokens)]
    prompt_range, output_range = ((16, 512), (16, 256)) if long else ((2, 14), (2, 10))
    out = []
    for rid in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        if rid % 3 == 0:
            prompt = system + prompt
        out.append(Request(rid, prompt, rng.randint(*output_range), n=samples if rid % 4 == 1 else 1))
    return out


def _size(args: argparse.Namespace, name: str, gpu: bool) -> int:
    value = getattr(args, name)
    if value is None:
        return DEFAULTS[name][0 if gpu else 1]
    if value < (0 if name == "system_prompt" else 1):
        raise ValueError(f"--{name.replace('_', '-')}: got {value}, expected an int >= "
                         f"{0 if name == 'system_prompt' else 1}")
    return value


class Setup:
    """The model, the loop's configuration, the backend factory and the workload of one demo run."""

    def __init__(self, args: argparse.Namespace):
        self.gpu = gpu = torch.cuda.is_available() and not args.cpu
        size = {name: _size(args, name, gpu) for name in DEFAULTS}
        if not 1 <= args.samples <= 64:
            raise ValueError(f"--samples: got {args.samples}, expected an int in 1..64")
        self.check_requests = size["check_requests"]
        self.config = ModelConfig(num_layers=size["layers"], num_heads=size["heads"], num_kv_heads=size["kv_heads"],
                                  head_dim=size["head_dim"], hidden=size["hidden"], intermediate=2 * size["hidden"],
                                  vocab=size["vocab"], rope_theta=args.rope_theta, seed=args.seed)
        self.device, self.dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
        self.model = TinyLlama(self.config, self.device, self.dtype)
        self.engine_config = EngineConfig(num_pages=size["pages"], page_size=size["page_size"],
                                          max_tokens_per_step=size["max_tokens_per_step"], max_batch=size["max_batch"],
                                          temperature=args.temperature, seed=args.seed,
                                          out_of_pages=args.out_of_pages, cuda_graphs=not args.eager)
        self.requests = workload(size["requests"], self.config.vocab, size["system_prompt"], args.seed, long=gpu,
                                 samples=args.samples)
        self.tol = 1e-3 if self.dtype == torch.float32 else 0.25

    def backend(self, page_size: int):
        from .backends import ReferenceAttention, WrapperAttention

        c = self.config
        if not self.gpu:
            return ReferenceAttention(c.head_dim, page_size, c.num_heads, c.num_kv_heads)
        return WrapperAttention(c.head_dim, page_size, c.num_heads, c.num_kv_heads, dtype="bfloat16")


def run_demo(args: argparse.Namespace) -> int:
    """The demo (``flashgen demo``); 0 when every check passed. On the CPU torch runs one thread: the tiny
    model's products are too small to share, and a shared 2-core machine makes spinning threads wait."""
    threads = torch.get_num_threads()
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu:
        torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        if cpu:
            torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    s = Setup(args)
    if not s.gpu:
        print("no GPU visible (or --cpu): the serving loop runs at a tiny size, attention through the fp64 "
              "reference on the CPU; on a GPU the same loop runs the flashgen kernels (append_kv, decode with "
              "CUDA graphs, cascade, prefill)")
    compiles_before, loaded_before = _kernel_counts(s.gpu)
    engine = Engine(s.model, s.engine_config, s.backend(s.engine_config.page_size))
    engine.submit(s.requests)
    c, ec = s.config, s.engine_config
    print(f"model   {c.num_layers} layers, {c.num_heads} heads / {c.num_kv_heads} KV heads x {c.head_dim}, hidden "
          f"{c.hidden}, vocab {c.vocab}, {s.dtype} on {s.device}")
    print(f"serving {len(s.requests)} requests ({sum(r.n for r in s.requests)} completions) over {ec.num_pages} pages "
          f"of {ec.page_size} tokens, attention: {engine.backend.name}"
          + (", decode steps from CUDA graphs" if engine.graphs is not None else ""))
    progress = Progress(len(s.requests) + sum(r.n - 1 for r in s.requests))
    age, start = process_age(), time.perf_counter()
    engine.run(args.max_steps, progress)
    progress.close()
    print(f"served in {time.perf_counter() - start:.2f} s")
    line = first_token_line(engine, age)
    if line is not None:
        print(line)
    print(format_summary(summarize(engine), _kernels(s.gpu, compiles_before, loaded_before)))
    ok = _check(s, engine, args)
    if args.plot:
        from .plot import write_plot

        print(write_plot(engine, args.plot))
    outputs = {r.rid: r.output for r in engine.finished}
    if engine.idle:
        ok &= _studies(s, args, outputs)
    return 0 if ok else 1


def _check(s: Setup, engine: Engine, args: argparse.Namespace) -> bool:
    done = sorted(engine.finished, key=lambda r: r.rid)[: s.check_requests]
    result = check_against_dense(s.model, done, tol=s.tol, temperature=args.temperature, seed=args.seed)
    print(f"check   {result.tokens} tokens of {result.requests} requests against the dense reference loop: "
          + ("equal" if result.ok and not result.near_ties else
             f"equal but {result.near_ties} near-tie(s) within {s.tol:g}" if result.ok else "FAILED"))
    for line in result.failures:
        print(f"        {line}")
    return result.ok


def _studies(s: Setup, args: argparse.Namespace, outputs: dict) -> bool:
    from . import studies

    ok = True
    if args.compare_contiguous:
        paged, contiguous = studies.compare_contiguous(s.model, s.engine_config, s.backend, s.requests,
                                                       max_steps=args.max_steps)
        print("\n" + studies.format_contiguous(paged, contiguous))
        ok &= _same(s, args, outputs, [paged, contiguous])
    if args.policies:
        config = studies.pressure_config(s.engine_config, s.requests)
        runs = studies.compare_policies(s.model, config, s.backend, s.requests, max_steps=args.max_steps)
        print("\n" + studies.format_policies(runs))
        ok &= _same(s, args, outputs, runs)
    if args.sweep_page_size:
        runs = studies.sweep_page_size(s.model, s.engine_config, s.backend, s.requests, max_steps=args.max_steps)
        print("\n" + studies.format_sweep(runs))
        ok &= _same(s, args, outputs, runs)
    return ok


def _same(s: Setup, args: argparse.Namespace, outputs: dict, runs) -> bool:
    """Each run served every request, with the main run's tokens; in bf16 a request whose tokens differ passes
    if its tokens equal the dense loop's up to a near-tie."""
    ok = True
    for run in runs:
        differ = [rid for rid, out in outputs.items() if run.outputs.get(rid) != out]
        if not differ:
            continue
        if len(run.outputs) != len(outputs) or s.dtype == torch.float32:
            print(f"  {run.label}: {len(differ)} request(s) differ from the main run (e.g. {differ[0]}): FAILED")
            ok = False
            continue
        again = [Request(rid, [], 0) for rid in differ[: s.check_requests]]
        by_id = {r.rid: r for r in s.requests}
        for r in again:
            src = by_id[r.rid % CHILD_STRIDE]
            r.prompt, r.output, r.max_new_tokens = src.prompt, run.outputs[r.rid], len(run.outputs[r.rid])
        result = check_against_dense(s.model, again, tol=s.tol, temperature=args.temperature, seed=args.seed)
        print(f"  {run.label}: {len(differ)} request(s) differ from the main run in bf16; against the dense loop: "
              + ("equal up to near-ties" if result.ok else "FAILED"))
        ok &= result.ok
    return ok


def _kernel_counts(gpu: bool) -> tuple[int, int]:
    if not gpu:
        return 0, 0
    from .. import jit

    return jit.stats["compiles"], len(jit._loaded)


def _kernels(gpu: bool, compiles_before: int, loaded_before: int) -> str:
    if not gpu:
        return "none (CPU reference attention)"
    from .. import jit

    compiled = jit.stats["compiles"] - compiles_before
    loaded = len(jit._loaded) - loaded_before
    return f"{loaded} loaded, {compiled} of them compiled in this run ({loaded - compiled} from the cache)"
