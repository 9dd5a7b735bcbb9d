#!/usr/bin/env bash
# A/B of one flashgen backend between source trees on one GPU (e.g. main against a wip branch), in one run:
# bench_prefill.py for each tree, the trees alternated ROUNDS times, so drift and noise show between rounds.
#   OUT=/tmp/out bash benchmarks/experiments/ab_trees.sh TREE_A TREE_B [...]
#   BACKEND=sm90 (default) | portable; ROUNDS=2; LAYOUTS=ragged (e.g. ragged,paged16,paged1);
#   SHAPES=1x16384,4x4096 (default; e.g. 32x512 for short sequences)
# Each TREE is a directory holding a flashgen checkout (git archive <rev> | tar -x -C <dir>: the device copy has
# no .git). Their kernels never share a cache entry (the hash covers every header). Prints one line a row,
# prefixed by the tree's name; writes $OUT/ab-<backend>-<tree>-<round>.{json,md,png}.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: ab_trees.sh TREE_A TREE_B [...]" >&2; exit 2; }
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "$@"; do
    name=$(basename "$tree")
    (cd "$tree" && PYTHONPATH=$PWD python3 benchmarks/bench_prefill.py --reps 6 --head-dims 128 \
      --shapes "${SHAPES:-1x16384,4x4096}" --layouts "${LAYOUTS:-ragged}" --peers "" --backends "${BACKEND:-sm90}" \
      --out "$OUT/ab-${BACKEND:-sm90}-$name-$round.json" --commit "$name" 2>&1 | grep '^| 128' | sed "s/^/$name $round /")
  done
done
