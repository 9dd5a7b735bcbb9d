"""Whole-kernel SASS size of the pair hooks against the built-in paths that do the same arithmetic (no GPU needed).

Builds, for the Hopper prefill (and the portable one with --families), d128 bf16 over pages of 16 at sm_90a: the
built-in causal spec, the built-in ALiBi and soft-cap, the same two written as variant score hooks, and the shipped
examples alibi, document_tiled, t5_bias and sink, each into one fresh cache (``PYTHONPATH`` = the tree under test
decides which tree builds). Prints instructions (``cuobjdump -sass``), registers and spill stores (ptxas -v)
per kernel.

    python3 benchmarks/experiments/hook_sass.py --families prefill_sm90,prefill --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from flashgen import jit, variant_ops as ops  # noqa: E402
from flashgen.cache import CacheStore  # noqa: E402
from flashgen.spec import ALiBi, AttentionSpec, Causal, Paged, Scalar, Tensor, Variant  # noqa: E402
from flashgen.variants.examples import EXAMPLES  # noqa: E402

_TRITON_CUOBJDUMP = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump"
CUOBJDUMP = os.environ.get("CUOBJDUMP", shutil.which("cuobjdump") or _TRITON_CUOBJDUMP)

SOFT_CAP_HOOK = Variant(score=lambda score, cap: cap * ops.tanh(score / cap), scalars=[Scalar("cap", "float32")])
ALIBI_HOOK = Variant(score="return logit + slopes[qo_head] * static_cast<float>(kv_idx - qo_idx);",
                     tensors=[Tensor("slopes", "float32", 1)])


def specs() -> dict[str, AttentionSpec]:
    base = dict(head_dim=128, kv_layout=Paged(16), mask=Causal())
    return {
        "built-in causal": AttentionSpec(**base),
        "built-in alibi": AttentionSpec(**base, pos_encoding=ALiBi()),
        "built-in soft-cap": AttentionSpec(**base, soft_cap=30.0),
        "alibi (example)": AttentionSpec(**base, variant=EXAMPLES["alibi"][0]),
        "alibi (cuda hook)": AttentionSpec(**base, variant=ALIBI_HOOK),
        "soft-cap (hook)": AttentionSpec(**base, variant=SOFT_CAP_HOOK),
        "document_tiled": AttentionSpec(**base, variant=EXAMPLES["document_tiled"][0]),
        "t5_bias": AttentionSpec(**base, variant=EXAMPLES["t5_bias"][0]),
        "sink": AttentionSpec(**base, variant=EXAMPLES["sink"][0]),
    }


def measure(cubin: str) -> dict[str, int]:
    text = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    count = sum(1 for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line))
    log = (Path(cubin).parent / "ptxas.log").read_text()
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", log)), default=-1)
    spill = max((int(r) for r in re.findall(r"(\d+) bytes spill stores", log)), default=-1)
    return {"instructions": count, "regs": regs, "spill": spill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="prefill_sm90")
    ap.add_argument("--only", default="", help="a substring of the kernel names")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    jobs = [(op, name, spec) for op in args.families.split(",") for name, spec in specs().items() if args.only in name]
    with tempfile.TemporaryDirectory() as root:
        store = CacheStore(Path(root))

        def one(job):
            op, name, spec = job
            entry = jit.ensure_compiled(spec, op, "sm_90a", store)
            return {"op": op, "name": name, **measure(str(entry.path / entry.manifest["cubin"]))}

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(one, jobs))
    print(f"{'family':<13} {'kernel':<20} {'instr':>6} {'regs':>4} {'spill':>5}")
    for r in rows:
        print(f"{r['op']:<13} {r['name']:<20} {r['instructions']:>6} {r['regs']:>4} {r['spill']:>5}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
