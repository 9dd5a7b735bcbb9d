"""`flashgen bench decode|prefill|all`: the maintained decode and prefill benchmarks (flashgen/bench/decode.py,
prefill.py, the code benchmarks/bench_*.py run) over a grid sized to finish in minutes, with the peers that are
importable in the same process, then the tables on stdout, the run's JSON and markdown in --out, and with
--plot the flashgen/peer bars (flashgen/bench/report.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

OPS = ("decode", "prefill")
PEERS = ("sdpa", "flex", "flashinfer", "flashinfer-fa3")
DEFAULT_PEERS = "sdpa,flex,flashinfer"

# The grids, in the scripts' option vocabulary (their --help says what each means). The default: bf16, 32 q /
# 8 kv heads, d128 (Llama-3-8B's attention); decode over batch 1-256 x 4k-16k tokens at page sizes 1 and 16,
# prefill over 16k tokens as 1 x 16k, 4 x 4k, 16 x 1k, no mask and causal, ragged and page 16. --quick: one
# or two shapes of each.
GRIDS = {
    "decode": {
        "default": {"reps": 20, "max_kv_gb": 18.0, "page_sizes": "1,16", "batches": "1,16,64,256",
                    "kv_lens": "4096,16384", "flush": "write"},
        "quick": {"reps": 10, "max_kv_gb": 18.0, "page_sizes": "16", "batches": "16,64", "kv_lens": "4096",
                  "flush": "write"},
    },
    "prefill": {
        "default": {"reps": 10, "head_dims": "128", "shapes": "1x16384,4x4096,16x1024", "layouts": "ragged,paged16",
                    "masks": "none,causal", "backends": None},
        "quick": {"reps": 5, "head_dims": "128", "shapes": "4x4096", "layouts": "ragged", "masks": "causal",
                  "backends": None},
    },
}


def _peer_list(text: str) -> list[str]:
    """--peers: a comma list of PEERS (empty: none)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; expected a comma list of {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def add_parser(sub) -> None:
    """The ``bench`` subcommand on ``flashgen``'s subparsers."""
    bench = sub.add_parser("bench", help="time flashgen's decode and prefill against the peers importable here "
                           "(needs a CUDA GPU)", description=__doc__)
    bench.add_argument("op", choices=(*OPS, "all"), help="which benchmark: decode, prefill, or all (both)")
    bench.add_argument("--peers", type=_peer_list, default=_peer_list(DEFAULT_PEERS),
                       help=f"comma list of peers to run where importable, some of {', '.join(PEERS)} "
                            f"(default {DEFAULT_PEERS}; flashinfer-fa3: Hopper prefill, minutes to JIT-build; "
                            "'' for none)")
    bench.add_argument("--plot", metavar="FILE", help="write bars of flashgen/peer by shape, a panel per op, to FILE "
                       "(.png, .svg, .pdf; needs matplotlib: the plot extra)")
    bench.add_argument("--out", metavar="DIR", default=".", help="folder for the run's JSON and markdown (default: "
                       "the current one; made if missing)")
    bench.add_argument("--quick", action="store_true", help="one or two shapes per op: a smoke run of a minute or so")
    bench.add_argument("--commit", default="", help="the commit measured, where the tree has no .git "
                       "(default: HEAD of the checkout, else flashgen's version)")
    bench.set_defaults(func=cmd_bench)


def find_peers(requested: list[str]) -> tuple[dict, dict]:
    """({peer: version} of those importable here, {peer: why not} of the rest) for ``requested``."""
    import torch

    found, missing = {}, {}
    for name in requested:
        try:
            if name == "sdpa":
                from torch.nn.functional import scaled_dot_product_attention  # noqa: F401
                version = f"torch {torch.__version__}"
            elif name == "flex":
                from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
                version = f"torch {torch.__version__}"
            else:
                import flashinfer

                version = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
                if name == "flashinfer-fa3" and torch.cuda.get_device_capability() != (9, 0):
                    raise ImportError("FA3 needs a Hopper GPU (compute capability 9.0)")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not importable here"
            missing[name] = f"{type(exc).__name__}: {exc}"[:200]
        else:
            found[name] = version
    return found, missing


def _output_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --plot or --out, found before minutes of measuring rather than after: --plot needs
    matplotlib and an existing folder, --out a folder or nothing."""
    if args.plot:
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():
            return f"--plot {args.plot}: folder {folder} does not exist"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot: matplotlib is not installed (pip install 'flashgen[plot]')"
    if Path(args.out).exists() and not Path(args.out).is_dir():
        return f"--out {args.out}: exists and is not a folder"
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("flashgen bench: error: no CUDA GPU visible (torch.cuda.is_available() is False); the benchmarks "
              "time kernels on a GPU: run it on a machine with one", file=sys.stderr)
        return 1
    problem = _output_problem(args)
    if problem:
        print(f"flashgen bench: error: {problem}", file=sys.stderr)
        return 2
    from ..progress import Progress
    from . import decode, prefill, report
    from .timing import commit, copy_rate, matmul_rate

    modules = {"decode": decode, "prefill": prefill}
    ops = OPS if args.op == "all" else (args.op,)
    start = time.perf_counter()
    found, missing = find_peers(args.peers)
    print(f"peers found: {', '.join(f'{n} ({v})' for n, v in found.items()) or 'none'}", flush=True)
    for name, why in missing.items():
        print(f"peer not found: {name} ({why})", flush=True)
    copy_gbps, mm = copy_rate(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy rate {copy_gbps:.0f} GB/s, bf16 matmul 8192^3 {mm:.0f} TFLOP/s",
          flush=True)
    commit_id = commit(args.commit)
    grid = "quick" if args.quick else "default"
    results = {}
    for op in ops:
        module = modules[op]
        options = argparse.Namespace(**GRIDS[op][grid], peers=",".join(p for p in found if p in module.PEERS))
        cfg = module.config(options)
        if op == "decode":
            decode.build(cfg, Progress)
            with Progress(len(list(decode.configs(cfg.max_kv_gb, cfg.batches, cfg.kv_lens))), "shape") as bar:
                rows = decode.measure(cfg, copy_gbps, bar)
            results[op] = decode.result(rows, copy_gbps, commit_id, cfg.flush)
        else:
            prefill.build(cfg, Progress)
            with Progress(len(list(prefill.grid(cfg))), "shape") as bar:
                rows = prefill.measure(cfg, mm, bar)
            results[op] = prefill.result(rows, mm, commit_id)
    run = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit_id,
           "copy_GBps": copy_gbps, "matmul_TFLOPs": mm, "grid": grid, "peers": {"found": found, "missing": missing},
           "seconds": time.perf_counter() - start, "ops": results,
           "ratios": {op: [list(r) for r in modules[op].ratios(results[op])] for op in ops}}
    tables = {op: modules[op].markdown for op in ops}
    print("\n" + report.markdown(run, tables))
    json_path, md_path = report.write_run(run, Path(args.out), tables)
    print(f"wrote {json_path} and {md_path}")
    if args.plot:
        try:
            report.plot_ratios(run, Path(args.plot))
        except ValueError as exc:
            print(f"flashgen bench: no plot: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0
