"""The GPU differential fuzz: ``python -m tests.fuzz --cases 20000 --seed 0 --out DIR [--time-limit S]``.

Draws ``--cases`` seeds from ``--seed`` (``tests/fuzz/cases.py``), compiles every kernel they need in parallel,
then runs them in ``--workers`` processes on the GPU (each with its own wrappers, graph groups and pools),
comparing every output with the fp64 reference. Prints progress and each failure (seed, case, error); writes
``DIR/summary.json`` (counts per variant, backend and option, failures, timings), ``DIR/results.jsonl`` (one line
a case) and records failing seeds in ``tests/fuzz/regressions.json`` (and ``DIR/regressions.json``), which
``tests/fuzz/test_fuzz_gpu.py`` replays. A worker that hits a CUDA error that ends its context is replaced; its
case is reported as "fatal". Exit status 1 when any case failed.

Other uses: ``--list-variants``; ``--build-plan FILE`` writes the kernels as a ``flashgen build --plan`` file
(``--capability 9.0``: the device they are for; no GPU needed); ``--replay`` runs the recorded regression seeds;
``--fresh-graph-ids``: graph groups also take page ids in a new device tensor each plan.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from .cases import GENERATOR_VERSION, VARIANTS, case, summary

REGRESSIONS = Path(__file__).with_name("regressions.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=20000, help="number of seeds to run (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--seeds", help="comma-separated seeds to run instead of --cases/--seed")
    p.add_argument("--replay", action="store_true", help="run the seeds recorded in tests/fuzz/regressions.json")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fuzz"), help="output folder (default $OUT or /tmp/fuzz)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds after which no new case starts")
    p.add_argument("--workers", type=int, default=4, help="GPU worker processes (default 4)")
    p.add_argument("--compile-jobs", type=int, default=16, help="parallel kernel compiles (default 16)")
    p.add_argument("--fresh-graph-ids", action="store_true",
                   help="graph groups also take page ids in a new device tensor each plan")
    p.add_argument("--no-record", action="store_true", help="do not add failing seeds to tests/fuzz/regressions.json")
    p.add_argument("--list-variants", action="store_true", help="print the variants and exit")
    p.add_argument("--build-plan", help="write the kernels of the cases as a flashgen build plan and exit")
    p.add_argument("--capability", default=None, help="with --build-plan: compute capability, e.g. 9.0")
    return p.parse_args(argv)


def load_regressions(path: Path = REGRESSIONS) -> list[dict]:
    return json.loads(path.read_text())["cases"] if path.exists() else []


def record_regressions(failed: list[dict], fresh: bool, paths: list[Path]) -> list[dict]:
    """Add the failing seeds to the regression list (one entry a seed and fresh flag) and write it to ``paths``."""
    entries = load_regressions()
    known = {(e["seed"], e.get("fresh_graph_ids", False)) for e in entries}
    for r in failed:
        if (r["seed"], fresh) not in known:
            known.add((r["seed"], fresh))
            entries.append({"seed": r["seed"], "fresh_graph_ids": fresh, "generator_version": GENERATOR_VERSION,
                            "status": r["status"], "summary": r["summary"],
                            "error": (r["error"] or "").splitlines()[0][:400]})
    text = json.dumps({"cases": entries}, indent=1) + "\n"
    for path in paths:
        path.write_text(text)
    return entries


# ---------------------------------------------------------------------------------------------- workers


def run_workers(seeds: list[int], workers: int, fresh: bool, deadline: float | None, on_result,
                target=None) -> None:
    """Run ``seeds`` in ``workers`` processes (each ``target(index, tasks, results, fresh, deadline)``, which
    posts ``("start", index, seed)`` and ``("done", index, result)``); ``on_result(result)`` once for each case
    run, a worker that died inside a case included (status "fatal"). A worker that ends with a non-zero exit
    status is replaced while seeds are left (a bounded number of times). ``results`` is a SimpleQueue, written
    synchronously: what a worker posted before it died is never lost."""
    if target is None:  # the GPU worker, from a module a spawned process can import (not __main__)
        from .worker import worker as target
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.SimpleQueue()
    tasks.cancel_join_thread()  # seeds left unrun at a time limit must not hold up the exit
    for seed in seeds:
        tasks.put(seed)
    pending, current, procs, started = set(seeds), {}, {}, 0
    restarts = 4 * max(1, workers) + 16  # replacements for workers that died (a runaway crash loop stops)

    def start():
        nonlocal started
        proc = ctx.Process(target=target, args=(started, tasks, results, fresh, deadline), daemon=True)
        proc.start()
        procs[started] = proc
        started += 1

    for _ in range(max(1, min(workers, len(seeds)))):
        start()
    while procs:
        if results.empty():
            time.sleep(0.02)
            dead = [index for index, proc in procs.items() if not proc.is_alive()]
            if not results.empty():  # read what the dead posted before accounting for them
                continue
            for index in dead:
                proc = procs.pop(index)
                seed = current.pop(index, None)
                if seed is not None and seed in pending:  # died inside a case without reporting it
                    pending.discard(seed)
                    c = case(seed, fresh)
                    on_result({"seed": seed, "variant": VARIANTS[c.variant].name, "backend": VARIANTS[c.variant].backend,
                               "graph": c.ids if c.graph else None, "status": "fatal", "summary": summary(c),
                               "error": f"worker process died (exit code {proc.exitcode})", "seconds": None})
                if proc.exitcode != 0 and pending and restarts > 0 and (deadline is None or time.time() < deadline):
                    restarts -= 1
                    start()
            continue
        kind, index, payload = results.get()
        if kind == "start":
            current[index] = payload
        else:
            current.pop(index, None)
            pending.discard(payload["seed"])
            on_result(payload)
    for proc in procs.values():
        proc.join(timeout=10)


# ---------------------------------------------------------------------------------------------- main


def _bucket(n: int) -> str:
    for top in (0, 128, 2048, 16384):
        if n <= top:
            return f"<={top}"
    return "<=65536"


def _tally(results: list[dict]) -> dict:
    per_variant: dict[str, Counter] = defaultdict(Counter)
    per_backend: Counter = Counter()
    per_option: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        per_variant[r["variant"]]["cases"] += 1
        per_variant[r["variant"]][r["status"]] += 1
        per_variant[r["variant"]][f"backend={r['backend']}"] += 1
        per_backend[r["backend"]] += 1
        c = case(r["seed"], r.get("fresh", False))
        per_option["form"][c.form] += 1
        per_option["ids"][f"{'graph-' if c.graph else ''}{c.ids}"] += 1
        per_option["combined"][str(c.combined)] += 1
        per_option["group"][str(c.group)] += 1
        per_option["num_kv_heads"][str(c.num_kv_heads)] += 1
        per_option["enable_split"][str(c.enable_split)] += 1
        per_option["num_sms"][str(c.num_sms)] += 1
        per_option["max_kv"][_bucket(max(c.kv_lens))] += 1
        for name, _ in c.runtime:
            per_option["runtime"][name] += 1
        if c.mask_kind:
            per_option["mask_kind"][c.mask_kind] += 1
            per_option["mask_form"][c.mask_form] += 1
    return {"per_variant": {k: dict(v) for k, v in sorted(per_variant.items())}, "per_backend": dict(per_backend),
            "per_option": {k: dict(v) for k, v in per_option.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_variants:
        for v in VARIANTS:
            print(f"{v.index:3d}  {v.name}")
        return 0
    if args.replay:
        entries = load_regressions()
        seeds = [e["seed"] for e in entries]
        args.fresh_graph_ids = args.fresh_graph_ids or any(e.get("fresh_graph_ids") for e in entries)
    elif args.seeds:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    else:
        seeds = list(range(args.seed, args.seed + args.cases))
    if not seeds:
        print("fuzz: no seeds to run")
        return 0
    cases = [case(s, args.fresh_graph_ids) for s in seeds]
    from .runner import compile_kernels, needed_kernels

    if args.build_plan:
        from flashgen.spec import spec_to_dict

        capability = tuple(int(x) for x in (args.capability or "9.0").split("."))
        plan = [{"op": op, "spec": spec_to_dict(spec)} for op, spec in needed_kernels(cases, capability)]
        Path(args.build_plan).write_text(json.dumps(plan, indent=1) + "\n")
        print(f"{len(plan)} kernels -> {args.build_plan}")
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.time_limit if args.time_limit else None
    capability = torch.cuda.get_device_capability()
    jobs = needed_kernels(cases, capability)
    print(f"fuzz: {len(seeds)} cases over {len(VARIANTS)} variants, {len(jobs)} kernels, on "
          f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]}), {args.workers} workers", flush=True)
    compile_seconds = compile_kernels(jobs, args.compile_jobs)
    print(f"fuzz: kernels ready in {compile_seconds:.1f} s", flush=True)
    results: list[dict] = []
    failed: list[dict] = []
    log = (out / "results.jsonl").open("w")
    last = [time.time()]

    def on_result(r: dict) -> None:
        r["fresh"] = args.fresh_graph_ids
        results.append(r)
        log.write(json.dumps(r) + "\n")
        if r["status"] != "ok":
            failed.append(r)
            print(f"{r['status'].upper()} {r['summary']}\n    {(r['error'] or '').splitlines()[0][:300]}", flush=True)
        if time.time() - last[0] > 10 or len(results) == len(seeds):
            last[0] = time.time()
            rate = len(results) / max(time.time() - start - compile_seconds, 1e-9)
            print(f"[{len(results):6d}/{len(seeds)}] {time.time() - start:7.1f} s  {len(failed)} failed  "
                  f"{rate:.1f} cases/s", flush=True)

    run_workers(seeds, args.workers, args.fresh_graph_ids, deadline, on_result)
    log.close()
    tally = _tally(results)
    counts = Counter(r["status"] for r in results)
    report = {"generator_version": GENERATOR_VERSION, "seeds": [seeds[0], seeds[-1]] if seeds else [],
              "cases_planned": len(seeds), "cases_run": len(results), "counts": dict(counts),
              "fresh_graph_ids": args.fresh_graph_ids, "device": torch.cuda.get_device_name(),
              "capability": list(capability), "workers": args.workers, "kernels": len(jobs),
              "compile_seconds": round(compile_seconds, 1), "seconds": round(time.time() - start, 1),
              "failures": [{k: r[k] for k in ("seed", "status", "summary", "error")} for r in failed], **tally}
    (out / "summary.json").write_text(json.dumps(report, indent=1) + "\n")
    if failed:
        paths = [out / "regressions.json"] + ([] if args.no_record or args.replay else [REGRESSIONS])
        record_regressions(failed, args.fresh_graph_ids, paths)
    print("\ncases per variant (backend as run):")
    for name, row in tally["per_variant"].items():
        backends = ",".join(k.split("=")[1] for k in row if k.startswith("backend="))
        print(f"  {name:<62} {row['cases']:6d}  {backends:<8} {row['cases'] - row.get('ok', 0)} failed")
    print(f"per backend: {tally['per_backend']}")
    print(f"fuzz: {len(results)}/{len(seeds)} cases run, {counts.get('ok', 0)} ok, {counts.get('mismatch', 0)} "
          f"mismatches, {counts.get('error', 0)} errors, {counts.get('fatal', 0)} fatal, in {report['seconds']} s "
          f"({out / 'summary.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
