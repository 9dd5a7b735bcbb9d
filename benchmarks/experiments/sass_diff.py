"""SASS of a representative set of kernel variants, built from two source trees and compared.

A reorganisation of templates/ should leave every kernel's machine code as it was. This script builds the same
~25 variants (decode, portable prefill, Hopper prefill, merge_states, rope_gather) from an old tree and a new
one, each in a cache folder of its own, disassembles every cubin with ``cuobjdump -sass`` and compares the
instruction streams (address comments and file names stripped; the encodings, which carry the scheduling
bits, are compared). For each variant it prints identical / changed; whether its main loop (first to last
tensor-core instruction, branch targets ignored) is the same; the number of differing instruction lines; and
the registers, local-memory (spill) bytes and instruction counts before and after, so that changed kernels can
be A/B-timed on a GPU.

Needs nvcc and cuobjdump (no GPU). Each tree is imported in its own interpreter (``PYTHONPATH=<tree>``), so
the trees may differ in their Python as well. The 2-core build host is shared: ``--jobs`` defaults to 2.

    python3 benchmarks/experiments/sass_diff.py --old /work/main --new . --out /tmp/sass
    python3 benchmarks/experiments/sass_diff.py --old /tmp/old_tree --new . --only decode --json sass.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, op, spec expression): expressions over flashgen's public spec types, evaluated in each tree
VARIANTS = [
    ("decode_bf16_paged16", "decode", "AttentionSpec(128, kv_layout=Paged(16))"),
    ("decode_fp8e4m3_paged16", "decode", "AttentionSpec(128, kv_dtype='float8_e4m3fn', kv_layout=Paged(16))"),
    ("decode_ragged", "decode", "AttentionSpec(128, kv_layout=Ragged())"),
    ("decode_page1", "decode", "AttentionSpec(128, kv_layout=Paged(1))"),
    ("decode_alibi_softcap", "decode", "AttentionSpec(128, kv_layout=Paged(16), pos_encoding=ALiBi(), soft_cap=30.0)"),
    ("decode_rope", "decode", "AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())"),
    ("decode_d64", "decode", "AttentionSpec(64, kv_layout=Paged(16))"),
    ("decode_d256", "decode", "AttentionSpec(256, kv_layout=Paged(16))"),
    ("prefill_ragged_causal_d128", "prefill", "AttentionSpec(128, kv_layout=Ragged(), mask=Causal())"),
    ("prefill_paged16_custom", "prefill", "AttentionSpec(128, kv_layout=Paged(16), mask=CustomMask())"),
    ("prefill_window", "prefill", "AttentionSpec(128, kv_layout=Paged(16), mask=SlidingWindow(256))"),
    ("prefill_rope", "prefill", "AttentionSpec(128, kv_layout=Ragged(), mask=Causal(), pos_encoding=RoPE())"),
    ("prefill_alibi", "prefill", "AttentionSpec(128, kv_layout=Paged(16), mask=Causal(), pos_encoding=ALiBi())"),
    ("prefill_d64", "prefill", "AttentionSpec(64, kv_layout=Ragged(), mask=Causal())"),
    ("prefill_d256", "prefill", "AttentionSpec(256, kv_layout=Paged(16), mask=Causal())"),
    ("sm90_ragged_causal_d128", "prefill_sm90", "AttentionSpec(128, kv_layout=Ragged(), mask=Causal())"),
    ("sm90_paged16", "prefill_sm90", "AttentionSpec(128, kv_layout=Paged(16), mask=Causal())"),
    ("sm90_page1_gather", "prefill_sm90", "AttentionSpec(128, kv_layout=Paged(1))"),
    ("sm90_custom", "prefill_sm90", "AttentionSpec(128, kv_layout=Ragged(), mask=CustomMask())"),
    ("sm90_d64", "prefill_sm90", "AttentionSpec(64, kv_layout=Ragged(), mask=Causal())"),
    ("sm90_d256", "prefill_sm90", "AttentionSpec(256, kv_layout=Ragged(), mask=Causal())"),
    ("sm90_softcap", "prefill_sm90", "AttentionSpec(128, kv_layout=Ragged(), pos_encoding=ALiBi(), soft_cap=30.0)"),
    ("merge_states_bf16", "merge_states", "MergeSpec('bf16')"),
    ("merge_states_f32", "merge_states", "MergeSpec('f32')"),
    ("rope_gather_paged16", "rope_gather", "AttentionSpec(128, kv_layout=Paged(16), pos_encoding=RoPE())"),
]

# builds the variants named on argv[2:] in one tree (run with PYTHONPATH=<tree>); prints {name: cubin path}
BUILDER = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import flashgen
from flashgen import jit
from flashgen.spec import *  # noqa: F403 (the spec expressions)
jobs = json.loads(sys.argv[1])
arch, workers = jobs.pop("_arch"), jobs.pop("_jobs")
def one(item):
    name, (op, expr) = item
    entry = jit.ensure_compiled(eval(expr), op, arch)
    return name, str(entry.path / entry.manifest["cubin"])
with ThreadPoolExecutor(max_workers=workers) as pool:
    print(json.dumps(dict(pool.map(one, jobs.items()))))
"""

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
CUOBJDUMP_DIRS = [Path(sys.prefix) / "lib" / PY / "site-packages" / "triton" / "backends" / "nvidia" / "bin",
                  Path("/usr/local/cuda/bin")]


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for folder in CUOBJDUMP_DIRS:
        if (folder / "cuobjdump").is_file():
            return str(folder / "cuobjdump")
    sys.exit("cuobjdump not found: put it on PATH")


def cubin_of(path: str) -> Path:
    """The cubin of a cache entry (its folder, or the file itself)."""
    p = Path(path)
    if p.is_file():
        return p
    cubins = sorted(p.glob("*.cubin"))
    if not cubins:
        sys.exit(f"no cubin in {p}")
    return cubins[0]


def build(tree: Path, cache: Path, variants: list[tuple[str, str, str]], arch: str, jobs: int) -> dict[str, Path]:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), FLASHGEN_CACHE_DIR=str(cache), FLASHGEN_CUDA_ARCH=arch)
    for knob in ("FLASHGEN_PREFILL_TILES", "FLASHGEN_SM90_PINGPONG", "FLASHGEN_DISABLE_JIT"):
        env.pop(knob, None)  # every variant at its defaults
    payload = {name: (op, expr) for name, op, expr in variants} | {"_arch": arch, "_jobs": jobs}
    out = subprocess.run([sys.executable, "-c", BUILDER, json.dumps(payload)], env=env, cwd=tree,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"building in {tree} failed:\n{out.stderr[-4000:]}")
    return {name: cubin_of(path) for name, path in json.loads(out.stdout.strip().splitlines()[-1]).items()}


ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


def sass(cuobjdump: str, cubin: Path) -> list[str]:
    """The instruction lines of the cubin's SASS, address comments removed."""
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in text.splitlines():
        line = line.strip()
        header = line.startswith(("Fatbin", "code for", "Function :", ".headerflags", "====="))
        if not line or header or "/" not in line:
            continue
        if str(cubin.parent) in line or ".cubin" in line:
            continue
        lines.append(" ".join(ADDRESS.sub("", line).split()))
    return lines


def resources(cuobjdump: str, cubin: Path) -> dict[str, int]:
    text = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return {"regs": found.get("REG", -1), "stack": found.get("STACK", -1), "local": found.get("LOCAL", -1)}


def instructions(lines: list[str]) -> int:
    return sum(1 for line in lines if ";" in line and not line.startswith("/*"))


BRANCH_TARGET = re.compile(r"0x[0-9a-f]{3,}")


def mma_region(lines: list[str]) -> list[str]:
    """The instructions from the first tensor-core instruction (HMMA, HGMMA) to the last, encodings and branch
    targets dropped: the main loop, whose code is compared on its own when code after it (an epilogue) moved."""
    ops = [BRANCH_TARGET.sub("ADDR", line.split("/*")[0]).strip() for line in lines if ";" in line.split("/*")[0]]
    hits = [i for i, op in enumerate(ops) if "HMMA" in op or "HGMMA" in op]
    return ops[hits[0]:hits[-1] + 1] if hits else []


def differing(a: list[str], b: list[str]) -> int:
    """Lines of a unified diff of the instruction streams (changed, added, removed)."""
    return sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the reference tree (e.g. main checked out)")
    parser.add_argument("--new", type=Path, default=Path("."), help="the tree under test")
    parser.add_argument("--out", type=Path, default=None, help="folder for both caches and the SASS listings")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="a substring of the variant names to build")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-variant records here")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="sass_diff_"))
    variants = [v for v in VARIANTS if args.only in v[0]]
    cuobjdump = find_cuobjdump()
    built = {label: build(tree, out / f"cache_{label}", variants, args.arch, args.jobs)
             for label, tree in (("old", args.old), ("new", args.new))}
    records = []
    for name, op, _ in variants:
        rec = {"variant": name, "op": op}
        listings = {}
        for label in ("old", "new"):
            cubin = built[label][name]
            listings[label] = sass(cuobjdump, cubin)
            (out / f"{name}.{label}.sass").write_text("\n".join(listings[label]) + "\n")
            rec[label] = resources(cuobjdump, cubin) | {"instructions": instructions(listings[label])}
        rec["identical"] = listings["old"] == listings["new"]
        loops = [mma_region(listings[label]) for label in ("old", "new")]
        rec["mma_region_identical"] = loops[0] == loops[1]
        rec["has_mma"] = bool(loops[0])
        rec["differing_lines"] = 0 if rec["identical"] else differing(*[
            [op for op in (line.split("/*")[0].strip() for line in listings[label]) if op] for label in ("old", "new")])
        records.append(rec)
    print(f"{'variant':30s} {'result':10s} {'main loop':10s} {'diff':>5s} {'regs':>9s} {'local':>9s} "
          f"{'instructions':>13s}")
    for rec in records:
        o, n = rec["old"], rec["new"]
        print(f"{rec['variant']:30s} {'identical' if rec['identical'] else 'CHANGED':10s} "
              f"{('same' if rec['mma_region_identical'] else 'CHANGED') if rec['has_mma'] else '-':10s} "
              f"{rec['differing_lines']:>5d} "
              f"{o['regs']:>4d}>{n['regs']:<4d} {o['local']:>4d}>{n['local']:<4d} "
              f"{o['instructions']:>6d}>{n['instructions']:<6d}")
    changed = [r["variant"] for r in records if not r["identical"]]
    print(f"{len(records) - len(changed)} identical, {len(changed)} changed; listings in {out}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
