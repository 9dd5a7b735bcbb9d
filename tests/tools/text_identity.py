"""The machine code of the built-in logits transforms and masks, this tree against another (``main`` by default).

Builds a matrix of built-in kernels (soft-cap, ALiBi, both, the sliding window, the custom mask, causal, fp8 K/V,
RoPE, explicit positions, and a user variant beside a built-in) of decode, the portable prefill and the Hopper
prefill for sm_90a, once per tree, each tree in a subprocess of its own (``PYTHONPATH`` = that tree) into a fresh
cache, then compares each kernel's ``.text.*`` sections byte for byte (``readelf -x``) and says whether its
kernel key stayed. A kernel whose code differs is named, with the size of its SASS diff (``cuobjdump -sass``).

    python3 tests/tools/text_identity.py                   # exports main's tree to /tmp/text_old/<commit> first
    python3 tests/tools/text_identity.py --base HEAD~3 --jobs 1
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"
_TRITON_CUOBJDUMP = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump"
CUOBJDUMP = os.environ.get("CUOBJDUMP", shutil.which("cuobjdump") or _TRITON_CUOBJDUMP)


def matrix() -> list[tuple[str, object, dict | None]]:
    """(op, spec, options) of every built-in kernel the families take (a combination one refuses is left out)."""
    from flashgen.kernels import family
    from flashgen.spec import (ALiBi, AttentionSpec, Causal, CustomMask, NoMask, Paged, RoPE, SlidingWindow,
                               SpecError, Variant)

    doc = Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx];", tensors=[("doc_ids", "int32", 1)])
    bias = Variant(score="return logit + bias;", scalars=[("bias", "float32")])
    tiled = Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx];", mask_tile="""
        if (doc_ids[kv_end - 1] < doc_ids[qo_begin] || doc_ids[kv_begin] > doc_ids[qo_end - 1]) return TILE_EMPTY;
        return TILE_PARTIAL;""", tensors=[("doc_ids", "int32", 1)])
    base = dict(head_dim=128, kv_layout=Paged(16))
    specs = [
        dict(soft_cap=30.0),
        dict(pos_encoding=ALiBi()),
        dict(pos_encoding=ALiBi(), soft_cap=30.0),
        dict(pos_encoding=ALiBi(), soft_cap=30.0, mask=Causal()),
        dict(mask=SlidingWindow(128)),
        dict(mask=SlidingWindow(128), soft_cap=50.0, pos_encoding=RoPE()),
        dict(mask=CustomMask()),
        dict(mask=CustomMask(), pos_encoding=ALiBi()),
        dict(kv_dtype="float8_e4m3fn", soft_cap=30.0),
        dict(kv_dtype="float8_e4m3fn", pos_encoding=ALiBi(), mask=Causal()),
        dict(pos_encoding=RoPE(), mask=Causal()),
        dict(soft_cap=30.0, variant=bias),
        dict(pos_encoding=ALiBi(), mask=Causal(), variant=doc),
        dict(mask=Causal(), variant=tiled),
        dict(mask=NoMask()),
    ]
    jobs = []
    for op in ("decode", "prefill", "prefill_sm90"):
        for fields in specs:
            for options in (None, {"positions": True}):
                if options and "pos_encoding" not in fields and "mask" not in fields:
                    continue
                spec = AttentionSpec(**base, **fields)
                try:
                    fam = family(op, options)
                    fam.check(fam.project(spec))
                except SpecError:
                    continue
                jobs.append((op, spec, options))
    return jobs


def build(cache: str, jobs: int) -> None:
    """Compile the matrix into ``cache``; prints one JSON line per kernel: name, key, cubin path."""
    from concurrent.futures import ThreadPoolExecutor

    from flashgen import jit
    from flashgen.cache import CacheStore

    store = CacheStore(Path(cache))

    def one(job):
        op, spec, options = job
        entry = jit.ensure_compiled(spec, op, ARCH, store, options=options)
        name = f"{op}:{spec.uri}" + (":positions" if options else "")
        return {"name": name, "key": entry.path.name, "cubin": str(entry.path / "kernel.cubin")}

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(one, matrix()):
            print(json.dumps(row), flush=True)


def text_sections(cubin: str) -> dict[str, bytes]:
    """Every ``.text.*`` section of a cubin, by name, as its hex dump (``readelf -x``)."""
    names = re.findall(r"\]\s+(\.text\.\S+)", subprocess.run(["readelf", "-SW", cubin], capture_output=True,
                                                              text=True, check=True).stdout)
    out = {}
    for name in names:
        dump = subprocess.run(["readelf", "-x", name, cubin], capture_output=True, text=True, check=True).stdout
        out[name] = dump.split("\n", 2)[-1].encode()
    return out


def sass_diff(old: str, new: str) -> int | str:
    """The count of SASS lines that differ, or "?" where no cuobjdump is found (CUOBJDUMP names one)."""
    if CUOBJDUMP is None or not Path(CUOBJDUMP).is_file():
        return "?"

    def sass(path):
        text = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True).stdout
        return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in text.splitlines()]
    return sum(1 for line in difflib.unified_diff(sass(old), sass(new), n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def run_tree(tree: Path, cache: Path, jobs: int) -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), FLASHGEN_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build", str(cache), "--jobs", str(jobs)],
                         env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"build in {tree} failed:\n{out.stderr[-4000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="the git revision to compare against")
    ap.add_argument("--old", default="/tmp/text_old", help="where base trees are exported (one folder a commit)")
    ap.add_argument("--work", default="/tmp/text_identity", help="the two fresh caches go here")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=("old", "new"), help="build one tree only")
    ap.add_argument("--keep", action="store_true", help="keep the caches of an earlier run (default: fresh ones)")
    args = ap.parse_args()
    if args.build:
        build(args.build, args.jobs)
        return 0
    # the base tree goes into a folder named by its commit, so a tree exported for another base is never reused
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.base}^{{commit}}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    old_tree, work = Path(args.old) / sha[:12], Path(args.work)
    if not (old_tree / "flashgen").is_dir():
        old_tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive.stdout, check=True)
    trees = {"old": old_tree, "new": ROOT}
    built = {}
    for side, tree in trees.items():
        if args.only and side != args.only:
            continue
        cache = work / side
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
        built[side] = run_tree(tree, cache, args.jobs)
        print(f"{side}: {len(built[side])} kernels built in {cache}", flush=True)
    if args.only:
        return 0
    same = differ = 0
    for name, new in sorted(built["new"].items()):
        old = built["old"].get(name)
        if old is None:
            print(f"  only in the new tree: {name}")
            continue
        identical = text_sections(old["cubin"]) == text_sections(new["cubin"])
        key = "same key" if old["key"] == new["key"] else "new key"
        if identical:
            same += 1
            print(f"  same .text ({key}): {name}")
        else:
            differ += 1
            print(f"  DIFFERENT .text ({key}, {sass_diff(old['cubin'], new['cubin'])} SASS lines differ): {name}")
    print(f"{same} kernels with identical .text, {differ} different")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
