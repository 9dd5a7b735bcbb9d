"""``flashgen demo --serve``: the serving loop on a random-weight Llama-style model, checked against the dense
reference loop, with a closing summary. Without a GPU it runs at a tiny size through the fp64 reference."""

from __future__ import annotations

import argparse
import random
import time

import torch

from .dense import check_against_dense
from .engine import Engine, EngineConfig, Request
from .model import ModelConfig, TinyLlama
from .flags import DEFAULTS
from .report import Progress, format_summary, summarize

def workload(num_requests: int, vocab: int, page_size: int, seed: int, long: bool) -> list[Request]:
    """Mixed prompt and output lengths; every third request starts with one shared system prompt (two pages
    and a bit: its full pages come from the prefix cache after the first)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(2 * page_size + 1)]
    prompt_range, output_range = ((16, 512), (16, 256)) if long else ((2, 14), (2, 10))
    out = []
    for rid in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        if rid % 3 == 0:
            prompt = system + prompt
        out.append(Request(rid, prompt, rng.randint(*output_range)))
    return out


def _size(args: argparse.Namespace, name: str, gpu: bool) -> int:
    value = getattr(args, name)
    if value is None:
        return DEFAULTS[name][0 if gpu else 1]
    if value < 1:
        raise ValueError(f"--{name.replace('_', '-')}: got {value}, expected an int >= 1")
    return value


def run_demo(args: argparse.Namespace) -> int:
    gpu = torch.cuda.is_available() and not args.cpu
    size = {name: _size(args, name, gpu) for name in DEFAULTS}
    if not gpu:
        print("no GPU visible (or --cpu): the serving loop runs at a tiny size, attention through the fp64 "
              "reference on the CPU; on a GPU the same loop runs the flashgen wrappers")
    config = ModelConfig(num_layers=size["layers"], num_heads=size["heads"], num_kv_heads=size["kv_heads"],
                         head_dim=size["head_dim"], hidden=size["hidden"], intermediate=2 * size["hidden"],
                         vocab=size["vocab"], rope_theta=args.rope_theta, seed=args.seed)
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    model = TinyLlama(config, device, dtype)
    engine_config = EngineConfig(num_pages=size["pages"], page_size=size["page_size"],
                                 max_tokens_per_step=size["max_tokens_per_step"], max_batch=size["max_batch"],
                                 temperature=args.temperature, seed=args.seed)
    backend, compiles_before, loaded_before = _backend(config, engine_config, gpu)
    engine = Engine(model, engine_config, backend)
    requests = workload(size["requests"], config.vocab, engine_config.page_size, args.seed, long=gpu)
    engine.submit(requests)
    print(f"model   {config.num_layers} layers, {config.num_heads} heads / {config.num_kv_heads} KV heads x "
          f"{config.head_dim}, hidden {config.hidden}, vocab {config.vocab}, {dtype} on {device}")
    print(f"serving {len(requests)} requests over {engine_config.num_pages} pages of {engine_config.page_size} "
          f"tokens, attention: {backend.name}")
    progress = Progress(len(requests))
    start = time.perf_counter()
    engine.run(args.max_steps, progress)
    progress.close()
    print(f"served in {time.perf_counter() - start:.2f} s")
    print(format_summary(summarize(engine), _kernels(gpu, compiles_before, loaded_before)))
    done = sorted(engine.finished, key=lambda r: r.rid)[: size["check_requests"]]
    tol = 1e-3 if dtype == torch.float32 else 0.25
    result = check_against_dense(model, done, tol=tol, temperature=args.temperature, seed=args.seed)
    print(f"check   {result.tokens} tokens of {result.requests} requests against the dense reference loop: "
          + ("equal" if result.ok and not result.near_ties else
             f"equal but {result.near_ties} near-tie(s) within {tol:g}" if result.ok else "FAILED"))
    for line in result.failures:
        print(f"        {line}")
    return 0 if result.ok else 1


def _backend(config: ModelConfig, engine_config: EngineConfig, gpu: bool):
    from .backends import ReferenceAttention, WrapperAttention

    args = (config.head_dim, engine_config.page_size, config.num_heads, config.num_kv_heads)
    if not gpu:
        return ReferenceAttention(*args), 0, 0
    from .. import jit

    before = jit.stats["compiles"], len(jit._loaded)
    return WrapperAttention(*args, dtype="bfloat16"), *before


def _kernels(gpu: bool, compiles_before: int, loaded_before: int) -> str:
    if not gpu:
        return "none (CPU reference attention)"
    from .. import jit

    compiled = jit.stats["compiles"] - compiles_before
    loaded = len(jit._loaded) - loaded_before
    return f"{loaded} loaded, {compiled} of them compiled in this run ({loaded - compiled} from the cache)"
