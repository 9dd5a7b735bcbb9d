#!/usr/bin/env bash
# One call on the H200 GPU machine that runs the steps named, writing logs and results under $OUT:
#   bash benchmarks/gpu_session.sh [tests|sanitize|fuzz|decode|prefill|bench|sm90|variants|profile-sm90|foundation|host ...]
#   (default: tests)
# Carry .whl (FlashInfer and its small deps, see the device README) to measure FlashInfer as a peer, and
# .whl/plot (matplotlib, tqdm and their deps, numpy left out) for the plots and progress bars.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/benchmarks FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
wheels=$(ls .whl/*.whl .whl/plot/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one word a wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site
fi
COMMIT=${COMMIT:-unknown}
for step in "${@:-tests}"; do
  case "$step" in
    tests)  # TEST_JOBS pytest-xdist workers (default 8; 0: one process): the suite is bound by its compiles
      jobs=${TEST_JOBS:-8}
      workers=()
      if [ "$jobs" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then workers=(-n "$jobs"); fi
      python3 -m pytest -m cuda tests -q -p no:cacheprovider --durations=20 "${workers[@]}" 2>&1 | tee "$OUT/gpu-tests.log" \
        | grep -v Warning | tail -40 ;;
    sanitize)  # memcheck, racecheck and synccheck over every kernel family's tests (tests/sanitize.sh)
      OUT=$OUT bash tests/sanitize.sh 2>&1 | tail -20 ;;
    fuzz)  # the differential fuzz: 20,000 seeded cases against the fp64 reference, graph replays with fresh ids
      python3 -m tests.fuzz --cases "${FUZZ_CASES:-20000}" --seed "${FUZZ_SEED:-0}" --fresh-graph-ids --no-record \
        --out /tmp/fuzz > "$OUT/fuzz.log" 2>&1; tail -4 "$OUT/fuzz.log"; cp /tmp/fuzz/summary.json "$OUT/fuzz-summary.json" ;;
    decode)
      python3 benchmarks/bench_decode.py --out "$OUT/decode.json" --reps 20 --commit "$COMMIT" 2>&1 | tail -22 ;;
    prefill)
      python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" --reps 6 --head-dims 128 \
        --shapes 1x16384,4x4096 --layouts ragged,paged16 --peers sdpa,flex,flashinfer --commit "$COMMIT" 2>&1 \
        | tee "$OUT/prefill.log" | tail -14 ;;
    bench)  # `flashgen bench all`: decode and prefill against the peers, tables, JSON and the ratio plot
      python3 -m flashgen.cli bench all --out "$OUT" --plot "$OUT/bench.png" --commit "$COMMIT" 2>&1 \
        | tee "$OUT/bench.log" | tail -40 ;;
    sm90)  # the Hopper kernel against FlashInfer's FA3 backend and cuDNN
      python3 benchmarks/bench_prefill_sm90.py --out "$OUT/prefill_sm90.json" --reps 10 --commit "$COMMIT" 2>&1 \
        | grep -v Warn | tail -16 ;;
    profile-sm90)  # ncu of one 4x4096 causal call, flashgen sm90 and FlashInfer FA3
      ncu --set full --clock-control none -k regex:'prefill_sm90|Prefill' -c 2 -o "$OUT/sm90" \
        python3 benchmarks/experiments/profile_prefill_sm90.py --batch 4 --seqlen 4096 --mask causal > "$OUT/ncu.log" 2>&1
      ncu --import "$OUT/sm90.ncu-rep" --page details --csv > "$OUT/sm90-ncu.csv" 2>&1; tail -3 "$OUT/ncu.log" ;;
    variants)  # every shipped variant on the Hopper prefill against FlexAttention (docs/performance.md, Variants)
      python3 benchmarks/bench_variants.py --shapes 4x4096,1x16384 --reps 10 --backends sm90 --commit "$COMMIT" \
        --out "$OUT/variants.json" 2>&1 | grep -v -i warn | tee "$OUT/variants.log" | tail -20 ;;
    host)  # plan() and run() host time beside FlashInfer's, pinned to one core (PIN, default 3)
      python3 benchmarks/bench_host.py --out "$OUT/host.json" --pin "${PIN:-3}" --commit "$COMMIT" 2>&1 \
        | tee "$OUT/host.log" | tail -14 ;;
    foundation)
      python3 benchmarks/bench_foundation.py --out "$OUT/foundation.json" --commit "$COMMIT" 2>&1 | tail -14 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
