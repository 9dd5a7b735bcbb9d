"""Plans of this tree byte for byte against another tree's (``main`` by default): random batches and options.

Each tree's planner runs in a subprocess of its own (``PYTHONPATH`` = that tree) over the same cases: decode
(``plan_decode``), prefill (``plan_prefill``) and the general ``plan_split_kv``; batches of 0-4096 requests,
KV lengths 0-32768 (log-uniform, short, equal, with empty requests), query lengths 0-512, int32 / int64 numpy,
CPU torch tensors and lists, granularities 1/16/64/128 (page sizes and KV tiles), the options the wrappers
pass (``tile_rows``, ``num_sms``, ``enable_split``, ``balance_tail``, CUDA-graph ``max_batch_size`` /
``max_total_q`` / ``capacity``, a reused host buffer full of stale values) and a few invalid inputs, whose
error type and message must match too. Compares every plan's kind, schema, ``numel``, ``info`` and the bytes of
every field (the alignment gaps between fields are never written).

    python3 tests/tools/plan_identity.py                  # exports main's flashgen to /tmp/plan_old first
    python3 tests/tools/plan_identity.py --cases 1000 --old /tmp/plan_old
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HEADS = ((32, 8), (32, 32), (8, 1), (64, 8), (28, 4), (16, 2), (4, 4), (128, 8))


def _lengths(rng: np.random.Generator, n: int, high: int) -> np.ndarray:
    style = rng.integers(6)
    if style == 0:  # log-uniform
        a = np.exp(rng.uniform(0, np.log(high), n)).astype(np.int64)
    elif style == 1:  # uniform
        a = rng.integers(0, high + 1, n)
    elif style == 2:  # all equal (ties: stable orders)
        a = np.full(n, rng.integers(0, high + 1))
    elif style == 3:  # short
        a = rng.integers(0, min(high, 80) + 1, n)
    elif style == 4:  # a few values (many ties)
        a = rng.choice(rng.integers(0, high + 1, 3), n)
    else:  # mostly short, a few long
        a = np.where(rng.random(n) < 0.1, rng.integers(0, high + 1, n), rng.integers(0, 65, n))
    if rng.random() < 0.3:  # some empty requests
        a[rng.random(n) < 0.2] = 0
    return a


def _batch(rng: np.random.Generator) -> int:
    r = rng.random()
    if r < 0.03:
        return 0
    if r < 0.15:
        return int(rng.integers(1, 5))
    if r < 0.35:  # the small-batch paths
        return int(rng.integers(1, 33))
    return int(np.exp(rng.uniform(0, np.log(4096))))


def make_cases(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        kind = ("decode", "prefill", "split_kv")[i % 3] if i % 10 else ("decode", "prefill")[i // 10 % 2]
        batch = _batch(rng)
        kv = _lengths(rng, batch, 32768)
        hq, hkv = HEADS[rng.integers(len(HEADS))]
        opts = dict(num_qo_heads=hq, num_kv_heads=hkv, num_sms=int(rng.choice([132, 264, 114, 16, 4])),
                    kv_granularity=int(rng.choice([1, 16, 64, 128])), enable_split=bool(rng.random() < 0.8))
        case = dict(kind=kind, dtype=str(rng.choice(["int32", "int64"])), box=str(rng.choice(["torch", "numpy", "numpy",
                    "list"] if batch < 300 else ["torch", "numpy"])), buffer=bool(rng.random() < 0.6))
        if kind == "decode":
            opts["tile_rows"] = None if rng.random() < 0.3 else int(rng.choice([16, 16, 64, 4]))
            total = batch
        else:
            q = _lengths(rng, batch, max(1, min(512, 200_000 // max(batch, 1))))  # up to ~200k tokens
            if rng.random() < 0.5:
                q = np.minimum(q, kv)
            if rng.random() < 0.1:
                q = np.ones(batch, np.int64)
            case["qo_indptr"] = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
            total = int(case["qo_indptr"][-1])
            opts["tile_rows"] = None if rng.random() < 0.25 else int(rng.choice([64, 128, 16]))
            opts["balance_tail"] = bool(rng.random() < 0.5)
            if kind == "split_kv":
                opts["split_min_waves"] = [None, 1.0, 2.0, 0.5][rng.integers(4)]
        if rng.random() < 0.3:  # CUDA-graph mode
            opts["max_batch_size"] = batch + int(rng.integers(0, 50))
            if kind != "decode" or rng.random() < 0.3:
                opts["max_total_q"] = max(total, opts["max_batch_size"]) + int(rng.integers(0, 300))
            if rng.random() < 0.3:
                opts["capacity"] = int(rng.integers(0, 2 * batch + 40))
        case["kv_lens"] = kv
        case["opts"] = opts
        cases.append(case)
    return cases


def invalid_cases() -> list[dict]:
    base = dict(num_qo_heads=32, num_kv_heads=8)
    d = lambda kv, **o: dict(kind="decode", kv_lens=np.array(kv), dtype="int64", box="numpy", buffer=False,
                             opts={**base, **o})
    p = lambda qo, kv, **o: dict(kind="prefill", qo_indptr=np.array(qo), kv_lens=np.array(kv), dtype="int64",
                                 box="numpy", buffer=False, opts={**base, **o})
    return [d([5, -1, 3]), d([5, 2**30]), d([[1, 2]]), d([1, 2], num_qo_heads=12), d([100] * 50, capacity=3),
            d([100] * 5, max_batch_size=3), p([0, 3, 2], [10, 10]), p([1, 3, 5], [10, 10]), p([0, 3, 5], [10]),
            p([0, 3, 5], [10, -4]), p([0, 3, 5], [10, 10], max_batch_size=1),
            p([0, 300, 500], [10, 10], max_batch_size=4, max_total_q=100), p([0, 3, 5], [9000, 9000], capacity=1),
            p([], []), p([0, 3, 5], [10, 10], num_kv_heads=0),
            p([1, 3, 5], [1.5, 2.0]), p([0, 3, 2], [1.5, 2.0]), p([0, 3, 5], [[1, 2]]), p([[0, 3]], [-1])]


def _convert(a: np.ndarray, dtype: str, box: str):
    import torch
    a = np.asarray(a).astype(dtype)
    return torch.from_numpy(a) if box == "torch" else a.tolist() if box == "list" else a


def child(root: str, cases_path: str, out_path: str) -> None:
    sys.path.insert(0, root)
    import torch
    import flashgen
    assert Path(flashgen.__file__).resolve().is_relative_to(Path(root).resolve()), flashgen.__file__
    from flashgen.plan import plan_decode, plan_prefill, plan_split_kv
    planners = {"decode": plan_decode, "prefill": plan_prefill, "split_kv": plan_split_kv}
    cases = pickle.loads(Path(cases_path).read_bytes())
    buffer = torch.empty(1 << 23, dtype=torch.int32)
    results = []
    for case in cases:
        args = [_convert(case["kv_lens"], case["dtype"], case["box"])]
        if case["kind"] != "decode":
            args.insert(0, _convert(case["qo_indptr"], case["dtype"], case["box"]))
        opts = dict(case["opts"])
        if case["buffer"]:
            buffer.fill_(-7)  # stale contents must not show through
            opts["host_buffer"] = buffer
        try:
            plan = planners[case["kind"]](*args, **opts)
        except Exception as error:  # noqa: BLE001 - errors are compared too
            results.append(("error", type(error).__name__, str(error)))
            continue
        schema = tuple((n, f.offset, f.length) for n, f in plan.schema.items())
        host = plan.host.numpy()
        # every field's bytes (the alignment gaps between fields are never written: not compared)
        fields = tuple(host[f.offset: f.offset + f.length].tobytes() for f in plan.schema.values())
        results.append(("plan", plan.kind, schema, plan.numel, fields, type(plan.info).__name__, tuple(plan.info),
                        plan.info.grid))
    Path(out_path).write_bytes(pickle.dumps(results))


def run_tree(root: Path, cases_path: str) -> list:
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        out = f.name
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, __file__, "--child", str(root), cases_path, out], check=True, env=env)
    results = pickle.loads(Path(out).read_bytes())
    os.unlink(out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/plan_old"), help="the reference tree (holds flashgen/)")
    parser.add_argument("--new", type=Path, default=ROOT, help="the tree under test")
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if not (args.old / "flashgen").is_dir():
        args.old.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "main", "flashgen"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(args.old)], input=archive, check=True)
    cases = make_cases(args.cases, args.seed) + invalid_cases()
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        f.write(pickle.dumps(cases))
        cases_path = f.name
    old, new = run_tree(args.old, cases_path), run_tree(args.new, cases_path)
    os.unlink(cases_path)
    diffs = [i for i, (a, b) in enumerate(zip(old, new)) if a != b] + list(range(min(len(old), len(new)),
                                                                                  max(len(old), len(new))))
    kinds = {}
    for case, result in zip(cases, old):
        key = (case["kind"], result[0])
        kinds[key] = kinds.get(key, 0) + 1
    for i in diffs[:10]:
        c = cases[i]
        print(f"case {i}: {c['kind']} batch {len(c['kv_lens'])} {c['opts']} {c['dtype']} {c['box']} "
              f"buffer={c['buffer']}")
        print("   old:", str(old[i])[:300])
        print("   new:", str(new[i])[:300])
    print(f"{len(cases)} cases ({', '.join(f'{k[0]} {k[1]}: {v}' for k, v in sorted(kinds.items()))}); "
          f"old {args.old}, new {args.new}: {len(diffs)} differences")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
