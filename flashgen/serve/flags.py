"""The flags of ``flashgen demo`` (argparse only: the command line builds its parser without importing torch or
the serving loop)."""

from __future__ import annotations

import argparse

# sizes when a flag is not given: (GPU, CPU)
DEFAULTS = {
    "layers": (8, 2), "heads": (32, 4), "kv_heads": (8, 2), "head_dim": (128, 64), "hidden": (1024, 64),
    "vocab": (32000, 256), "page_size": (16, 4), "pages": (2048, 48), "requests": (256, 12),
    "max_tokens_per_step": (2048, 32), "max_batch": (128, 8), "check_requests": (4, 12),
    "system_prompt": (512, 9),
}
POLICY_NAMES = ("raise", "evict", "swap", "recompute")  # flashgen.kvcache.POLICIES, without importing it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving loop's flags (None: the size for this machine, see ``DEFAULTS``) and its studies."""
    for flag, help_ in (("layers", "decoder layers"), ("heads", "query heads"), ("kv-heads", "KV heads (GQA)"),
                        ("head-dim", "head dim"), ("hidden", "hidden size"), ("vocab", "vocabulary size"),
                        ("page-size", "KV page size (tokens)"), ("pages", "KV pool size (pages, all layers)"),
                        ("requests", "requests served"), ("max-tokens-per-step", "token budget of a step"),
                        ("max-batch", "running requests at most"),
                        ("check-requests", "requests checked against the dense loop"),
                        ("system-prompt", "tokens of the system prompt every third request starts with")):
        parser.add_argument(f"--{flag}", type=int, default=None, help=help_)
    parser.add_argument("--samples", type=int, default=1,
                        help="completions of every fourth request (n > 1: forked from its prompt's pages)")
    parser.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE theta")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--seed", type=int, default=0, help="weights, workload and sampling seed")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    parser.add_argument("--out-of-pages", choices=POLICY_NAMES, default="recompute",
                        help="what the cache does when pages run out (default recompute)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs: every decode step runs eagerly")
    parser.add_argument("--cpu", action="store_true", help="run the CPU path even where a GPU is visible")
    parser.add_argument("--compare-contiguous", action="store_true",
                        help="also serve the workload with a contiguous per-request reservation of the maximum "
                             "length at the same memory budget, and compare")
    parser.add_argument("--policies", action="store_true",
                        help="also serve the workload under memory pressure once per out-of-pages policy")
    parser.add_argument("--sweep-page-size", action="store_true",
                        help="also serve the workload at page sizes 1..256 (one token budget): tail waste and "
                             "decode step time")
    parser.add_argument("--plot", metavar="FILE", help="write step time and batch size over the run (matplotlib)")
