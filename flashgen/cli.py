"""The ``flashgen`` command: info, build (AOT), plan-from-config, cache list/verify/clean, demo, bench.

``flashgen demo`` is the end-to-end run that works on any fresh machine: a continuous-batching inference loop
(a small random-weight Llama-style decoder over ``PagedKVCache``) on the flashgen kernels, checked against a dense
fp64 reference loop, with a summary; without a GPU the same loop runs at a tiny size through the fp64 reference.
``flashgen demo --check`` is the toolchain check: it shows the toolchain and compiles the default kernels for
the target arch into the cache; with a GPU it also runs the merge kernels against the fp64 reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import knobs
from ._version import __version__
from .cache import CacheStore
from .progress import Progress
from .spec import AttentionSpec, Causal, MergeSpec, Paged, Ragged, spec_from_dict

# the kernels `flashgen build` compiles when given no plan: the merges, and a Llama-style (bf16, head_dim
# 128) paged decode and causal ragged prefill
DEFAULT_BUILDS = tuple(("merge_states", MergeSpec(d)) for d in ("float16", "bfloat16", "float32")) + (
    ("decode", AttentionSpec(128, kv_layout=Paged(16))),
    ("prefill", AttentionSpec(128, kv_layout=Ragged(), mask=Causal())),
    ("prefill_sm90", AttentionSpec(128, kv_layout=Ragged(), mask=Causal())),  # what BatchPrefillWrapper runs on Hopper
)


def _store():
    from .jit import default_store

    return default_store()


def cmd_info(args: argparse.Namespace) -> int:
    from .compile import ToolchainError, device_arch, find_nvcc

    print(f"flashgen {__version__}")
    try:
        nvcc = find_nvcc()
        print(f"nvcc        {nvcc.version} at {nvcc.path}")
    except ToolchainError as exc:
        print(f"nvcc        not found ({exc})")
    arch = device_arch()
    if arch is None:
        print("gpu         none visible (builds need an explicit arch: --arch sm_90a or FLASHGEN_CUDA_ARCH)")
    else:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        print(f"gpu         {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    print(f"arch        {knobs.cuda_arch() or arch or '(none)'}")
    store = _store()
    print(f"cache       {store.root} ({len(store.entry_dirs())} kernels, {store.size_bytes() / 2**20:.1f} MiB)")
    for root in store.extra_roots:
        print(f"extra cache {root} (read-only, {len(store.entry_dirs(root))} kernels)")
    return 0


class UsageError(Exception):
    """A mistake on the command line or in a file it names: one line on stderr, exit code 2 (as argparse's)."""


def _plan_builds(path: Path) -> list[tuple[str, object]]:
    """The builds of a plan file (``flashgen.deploy.read_plan``: TOML, or the older JSON list). A
    ``prefill_sm90`` item stands for the kernels the sm90 backend runs for its spec (``sm90_builds``; for RoPE: the
    rope_gather pre-pass and the ragged twin's kernel), so a plan names the spec a model serves, not the backend's
    internals. Every mistake in the file is a ``UsageError`` naming it, and the item."""
    from .api.backends import kernels_for
    from .deploy import PlanError, read_plan

    try:
        _, items = read_plan(path)
    except PlanError as exc:
        raise UsageError(str(exc)) from exc
    builds = []
    for op, spec in items:
        builds += sm90_builds(spec) if op == "prefill_sm90" else [(op, spec)]
    return list(dict.fromkeys(builds))


def sm90_builds(spec) -> list[tuple[str, object]]:
    """The kernels the sm90 backend runs for ``spec``: outside CUDA graphs (``kernels_for``) and, where the backend
    takes the spec in a graph (``check_sm90``; fp8 K/V under TMA-loaded pages: the kernel converts them itself),
    the graph's too."""
    from .api.backends import check_sm90, kernels_for
    from .spec import SpecError

    builds = list(kernels_for(spec, "sm90"))
    try:
        check_sm90(spec, graph=True)
    except SpecError:
        return builds
    return builds + [job for job in kernels_for(spec, "sm90", graph=True) if job not in builds]


GIB_PER_JOB = 0.5  # a compile's peak resident memory, 0.24 GiB measured (sm90 prefill), with a margin


def _memory_jobs(requested: int) -> int:
    """``-j`` bounded by the memory available now (/proc/meminfo's MemAvailable, else the free pages) at
    ``GIB_PER_JOB`` a compile; at least 1."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return requested
    return max(1, min(requested, int(available / (GIB_PER_JOB * 2**30))))


def _jobs(text: str) -> int:
    """``-j``: parallel compiles, an int >= 1 (argparse reports the error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected an int >= 1")
    return value


def cmd_build(args: argparse.Namespace) -> int:
    from .api.backends import SM90_OPS
    from .compile import choose_arch
    from .jit import ensure_compiled

    builds = [b for plan in args.plan for b in _plan_builds(Path(plan))] if args.plan else list(DEFAULT_BUILDS)
    if not builds:
        print("nothing to build: the plans list no kernels")
        return 0
    arch = choose_arch(args.arch)
    if arch != "sm_90a":
        skipped = [op for op, _ in builds if op in SM90_OPS]
        if skipped:
            print(f"{arch}  skipping {len(skipped)} sm_90a-only build(s): {', '.join(sorted(set(skipped)))}")
        builds = [b for b in builds if b[0] not in SM90_OPS]
    if not builds:
        print(f"{arch}  nothing to build for this arch")
        return 0
    store = _store() if not getattr(args, "out", None) else CacheStore(Path(args.out))
    jobs = _memory_jobs(args.jobs)
    if jobs < args.jobs:
        print(f"-j {args.jobs} bounded to {jobs} by free memory ({GIB_PER_JOB} GiB a compile)")

    def one(item):
        op, spec = item
        start = time.perf_counter()
        entry = ensure_compiled(spec, op, arch, store)
        return entry, time.perf_counter() - start

    start = time.perf_counter()
    progress = Progress(len(builds))
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for entry, seconds in pool.map(one, builds):
                progress.write(f"{arch}  {entry.uri:<48} {seconds:7.2f} s  {entry.path}")
    finally:
        progress.close()
    # on stderr, with the progress bar: stdout keeps one line per built item
    print(f"{len(builds)} kernels in {time.perf_counter() - start:.1f} s (-j {jobs}) into {store.root}", file=sys.stderr)
    _build_planner(store)
    return 0


def cmd_plan_from_config(args: argparse.Namespace) -> int:
    from .deploy import PlanError, plan_toml, specs_from_config

    try:
        config = json.loads(Path(args.config).read_text())
    except OSError as exc:
        raise UsageError(f"{args.config}: cannot read it ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{args.config}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise UsageError(f"{args.config}: expected a JSON object (a Hugging Face config.json)")
    try:
        facts, builds = specs_from_config(config, tuple(args.page_size or (16,)), args.dtype)
    except PlanError as exc:
        raise UsageError(f"{args.config}: {exc}") from exc
    model = args.model or config.get("_name_or_path") or Path(args.config).parent.name or "model"
    text = plan_toml(model, facts, builds, note=f"derived by `flashgen plan-from-config` from {Path(args.config).name}")
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {len(builds)} kernels for {model}")
    else:
        sys.stdout.write(text)
    return 0


def _build_planner(store) -> None:
    """The native planner into the cache too (a deployment of this cache then needs no C++ compiler); where it
    cannot be built, a line says why and plans there use the Python list paths (the build still succeeds)."""
    from .jit_native import ARCH, URI, NativeBuildError, ensure_built

    start = time.perf_counter()
    try:
        entry, _ = ensure_built(store)
    except NativeBuildError as exc:
        reason = " ".join(str(exc).split())
        print(f"{ARCH}  {URI:<48} not built ({reason[:300]}); plans use the Python list paths")
        return
    print(f"{ARCH}  {entry.uri:<48} {time.perf_counter() - start:7.2f} s  {entry.path}")


def cmd_cache(args: argparse.Namespace) -> int:
    from .cache import read_entry

    store = _store()
    if args.action == "list":
        for path in store.entry_dirs():
            entry, problem = read_entry(path, deep=True)
            status = "ok" if entry else f"BAD: {problem}"
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            print(f"{path.parent.name}  {path.name:<60} {size / 1024:8.0f} KiB  {status}")
        return 0
    if args.action == "verify":
        bad = store.verify()
        for path, problem in bad:
            print(f"BAD {path}: {problem}")
        print(f"{len(store.entry_dirs())} entries, {len(bad)} bad")
        return 1 if bad else 0
    removed = store.clean(only_corrupt=args.corrupt)
    print(f"removed {len(removed)} entries from {store.root}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .compile import device_arch

    if not args.check:
        from .serve.demo import run_demo

        try:
            return run_demo(args)
        except ValueError as exc:  # a bad flag value: one line naming it
            raise UsageError(str(exc)) from None
    cmd_info(argparse.Namespace())
    target = args.arch or knobs.cuda_arch() or device_arch() or "sm_90a"
    print(f"\n== building the default kernels for {target}")
    cmd_build(argparse.Namespace(arch=target, plan=[], jobs=2, out=None))
    if device_arch() is None:
        print("\nno GPU visible: kernels compiled and cached; on a GPU machine `flashgen demo --check` also runs the merge "
              "kernels against the fp64 reference (and `pytest -m cuda` checks every kernel)")
        return 0
    print("\n== running them on the GPU against the fp64 reference")
    return 0 if _check_merge() else 1


def _check_merge() -> bool:
    import torch

    from .api import merge_state, merge_states
    from .testing.reference import merge_state_ref, merge_states_ref

    ok = True
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    for dtype, _ in ((torch.float16, 0), (torch.bfloat16, 0), (torch.float32, 0)):
        tokens, states, heads, dim = 1000, 5, 32, 128
        v = torch.randn(tokens, states, heads, dim, device="cuda", generator=gen).to(dtype)
        s = torch.randn(tokens, states, heads, device="cuda", generator=gen) * 4
        s[::7, 1] = float("-inf")  # empty partials
        s[::11] = float("-inf")  # fully empty rows
        out, lse = merge_states(v, s)
        ref_v, ref_s = merge_states_ref(v.double(), s.double())
        err_v = (out.double() - ref_v).abs().max().item()
        err_s = (lse.double() - ref_s).nan_to_num(posinf=0, neginf=0).abs().max().item()
        pair_v, pair_s = merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 1].contiguous())
        ref_pv, ref_ps = merge_state_ref(v[:, 0].double(), s[:, 0].double(), v[:, 1].double(), s[:, 1].double())
        err_p = (pair_v.double() - ref_pv).abs().max().item()
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype] * 4
        good = max(err_v, err_p) < tol and err_s < 1e-4 and torch.equal(lse.isinf(), ref_s.isinf())
        ok &= good
        print(f"merge_states/merge_state {str(dtype):15} max|err| v {err_v:.2e} pair {err_p:.2e} lse {err_s:.2e}  "
              f"{'ok' if good else 'FAILED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="toolchain, GPU, arch and cache").set_defaults(func=cmd_info)
    build = sub.add_parser("build", help="compile kernels into the cache (needs nvcc, not a GPU)")
    build.add_argument("--arch", help="target arch, e.g. sm_90a (default: FLASHGEN_CUDA_ARCH, else the GPU's)")
    build.add_argument("--plan", action="append", default=[],
                       help="a build plan, TOML or JSON (repeatable; see plans/); default: the built-in kernels")
    build.add_argument("-j", "--jobs", type=_jobs, default=2, help="parallel compiles (>= 1; bounded by free memory)")
    build.add_argument("--out", help="build into this folder (a relocatable cache for FLASHGEN_EXTRA_CACHE_DIRS) "
                                     "instead of the writable cache")
    build.set_defaults(func=cmd_build)
    derive = sub.add_parser("plan-from-config", help="a build plan for a Hugging Face config.json")
    derive.add_argument("config", help="the model's config.json")
    derive.add_argument("--page-size", type=_jobs, action="append", help="KV page size (repeatable; default 16)")
    derive.add_argument("--dtype", choices=("bfloat16", "float16"), help="override the config's torch_dtype")
    derive.add_argument("--model", help="the model's name in the plan (default: the config's _name_or_path)")
    derive.add_argument("--out", help="write the plan here (default: stdout)")
    derive.set_defaults(func=cmd_plan_from_config)
    cache = sub.add_parser("cache", help="list, verify or clean the kernel cache")
    cache.add_argument("action", choices=("list", "verify", "clean"))
    cache.add_argument("--corrupt", action="store_true", help="clean: remove only entries that fail verification")
    cache.set_defaults(func=cmd_cache)
    demo = sub.add_parser("demo", help="the main job: a continuous-batching inference loop on the flashgen kernels "
                          "(tiny and on the CPU without a GPU), checked against a dense reference loop")
    demo.add_argument("--check", action="store_true", help="the toolchain check instead: info, build the default "
                      "kernels (for --arch without a GPU), and on a GPU run the merge kernels against the reference")
    demo.add_argument("--arch", help="--check: target arch when no GPU is visible (default sm_90a)")
    demo.add_argument("--serve", action="store_true", help="the serving loop (the default; kept for old scripts)")
    from .serve.flags import add_arguments

    add_arguments(demo.add_argument_group("serving loop options"))
    demo.set_defaults(func=cmd_demo)
    from .bench.command import add_parser as add_bench

    add_bench(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # the command line shows the error, not a traceback
        from .cache import CacheError
        from .compile import CompileError, ToolchainError
        from .jit import MissingKernelError
        from .spec import SpecError

        if isinstance(exc, CacheError):  # an unusable cache folder: one line naming it and the fix
            print(f"flashgen {args.command}: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, CompileError):  # nvcc's log, as it wrote it
            print(f"flashgen {args.command}: error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, (UsageError, ToolchainError, MissingKernelError, SpecError, FileNotFoundError)):
            message = " ".join(str(exc).split())  # one line
            print(f"flashgen {args.command}: error: {message}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
