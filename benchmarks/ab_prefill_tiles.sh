#!/usr/bin/env bash
# A/B of the portable prefill's tile configurations on one GPU: bench_prefill.py once per FLASHGEN_PREFILL_TILES
# value (a preset, or warps=W,rows=R,kv=K[,stages=S][,ctas=C]), d=128, each run with SDPA as its same-run peer.
#   OUT=/tmp/out bash benchmarks/ab_prefill_tiles.sh [tiles ...]     (default: kv32 kv64)
#   TESTS=1 ...   first runs tests/test_prefill.py (GPU) under each value, logged to $OUT/tests-<tiles>.log
# Writes $OUT/prefill-<tiles>.{json,md,png}. The tiles are in the kernel uri, so the runs never share a kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(kv32 kv64)
for tiles in "${configs[@]}"; do
  name=${tiles//[=,]/_}
  echo "== FLASHGEN_PREFILL_TILES=$tiles"
  if [ "${TESTS:-0}" = 1 ]; then
    FLASHGEN_PREFILL_TILES=$tiles python3 -m pytest -m cuda tests/test_prefill.py -q -p no:cacheprovider \
      > "$OUT/tests-$name.log" 2>&1
    tail -3 "$OUT/tests-$name.log"
  fi
  FLASHGEN_PREFILL_TILES=$tiles python3 benchmarks/bench_prefill.py --out "$OUT/prefill-$name.json" --reps 8 \
    --head-dims 128 --shapes 1x16384,4x4096 --layouts ragged,paged16 --peers sdpa --backends portable \
    --commit "$COMMIT $tiles" 2>&1 | tail -12
done
