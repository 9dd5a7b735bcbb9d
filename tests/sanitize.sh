#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over each kernel family's GPU tests (small shapes), on a GPU:
#
#   bash tests/sanitize.sh                       # every tool over every family
#   TOOLS="memcheck" FAMILIES="sm90" bash tests/sanitize.sh
#   COLLECT_ONLY=1 bash tests/sanitize.sh        # no GPU needed: check that every selection collects tests
#
# Families and their selections (pytest -k over the files named; override one with K_<FAMILY>, e.g.
# K_DECODE or K_VARIANTS): decode (every page size and order, RoPE / ALiBi / soft-cap / window, head dims 64 / 256, fp8 K/V, ragged,
# split-KV merges, CUDA-graph replay), portable prefill (layouts and masks, options, head dims, split plans, host and
# device custom masks), sm90 prefill (ragged TMA, paged TMA and gathered page sizes, head dims, logits transforms,
# custom masks, the rope_gather pre-pass), merge (every merge kernel), append (append_kv and the fused append +
# decode), fp8prefill (the portable prefill over fp8 K/V) and positions (explicit positions: sparse decode,
# block-sparse on the portable and the sm90 kernels) and variants (every shipped variant in decode, the portable
# and the sm90 prefill, paged and ragged, with CUDA-graph replay) and sm90fp8 (the Hopper prefill over fp8 K/V).
#
# The selections first run once without a sanitizer (kernels compile into $FLASHGEN_CACHE_DIR, the tests must pass;
# PLAIN=0 skips this when the same tests just ran and their kernels are in the cache); then each tool runs over each
# family, JOBS (default 4) families at a time. Logs go to $LOGDIR (default /tmp/sanitize-logs); $OUT (default
# /tmp/out) gets sanitize-summary.txt and sanitize-logs.tgz. One line per tool and
# family gives the errors ("ERROR SUMMARY") and, for racecheck, the hazards ("RACECHECK SUMMARY"); the exit status
# is 1 when any run reports an error or a hazard, fails a test, or ends without a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LOGDIR=${LOGDIR:-/tmp/sanitize-logs}
TOOLS=${TOOLS:-memcheck racecheck synccheck}
FAMILIES=${FAMILIES:-decode portable sm90 merge append fp8prefill positions variants sm90fp8}
JOBS=${JOBS:-4}
RACECHECK_REPORT=${RACECHECK_REPORT:-hazard}  # every hazard on its own (compute-sanitizer: all, hazard or analysis)
mkdir -p "$OUT" "$LOGDIR"

FILES_decode="tests/decode/test_decode.py"
K_decode=${K_DECODE:-"test_paged_csr or test_paged_block_table or test_options or test_head_dims_and_large_groups \
or test_fp8_kv_with_scales or test_ragged or test_split_and_unsplit_agree or test_cuda_graph_replay_after_replanning"}
FILES_portable="tests/prefill/test_prefill.py tests/prefill/test_prefill_mask_tiles.py"
K_portable=${K_PORTABLE:-"(portable and (test_layouts_and_masks or test_head_dims_and_groups)) or test_options \
or (test_split_and_unsplit_agree and not host and not device) or (test_last_wave_tiles_split and 3-qo_lens0) \
or test_block_table or (test_prefill.py and test_cuda_graph_replay_after_replanning) or test_mask_forms"}
FILES_sm90="tests/sm90/test_prefill_sm90.py tests/sm90/test_prefill_sm90_paged.py tests/sm90/test_prefill_sm90_mask.py \
tests/sm90/test_prefill_sm90_rope.py"
K_sm90=${K_SM90:-"(test_lengths_and_masks and bf16) or (test_gqa_groups and True-7) \
or (test_page_sizes and (True-16 or False-128)) or test_head_dims or (test_gathered_head_dims and (64-3 or 256-5)) \
or (test_gathered_page_sizes and (causal-1 \
or window-5 or none-100)) or test_logits_transforms or (test_sliding_window and 100-paged16) or test_mask_forms \
or (test_layouts_and_head_dims and doc) or test_prefill_sm90_rope.py or (test_prefill_sm90_paged.py \
and test_gathered_cuda_graph_replay_after_replanning and 5)"}
FILES_merge="tests/merge/test_merge.py"
K_merge=${K_MERGE:-"not test_bad_arguments"}
FILES_append="tests/append/test_append_gpu.py tests/decode/test_fused_append_gpu.py"
K_append=${K_APPEND:-"not refused"}
FILES_fp8prefill="tests/prefill/test_prefill_fp8.py"
K_fp8prefill=${K_FP8PREFILL:-"(test_fp8_layouts_and_masks and bfloat16) or test_fp8_split_plans \
or test_fp8_head_dims_and_options"}
FILES_positions="tests/sparse/test_positions_gpu.py"
K_positions=${K_POSITIONS:-"test_sparse_decode or test_variable_blocks or graph_replay or (test_block_sparse_with_positions \
and not sm90 and (16-16 or 32-1)) or (test_block_sparse_with_positions_on_sm90 and causal_rope)"}

FILES_variants="tests/variants/test_variants_gpu.py tests/variants/test_variants_sm90_tiles.py tests/variants/test_load_transforms_gpu.py \
tests/variants/test_distance_gpu.py"
K_variants=${K_VARIANTS:-"test_"}
FILES_sm90fp8="tests/sm90/test_prefill_sm90_fp8.py"
K_sm90fp8=${K_SM90FP8:-"test_"}

pytest_args() {  # the pytest arguments of family $1
  local files="FILES_$1" k="K_$1"
  # shellcheck disable=SC2086
  ARGS=(-m pytest -q -p no:cacheprovider ${!files} -k "${!k}")
}

for family in $FAMILIES; do
  if ! declare -p "FILES_$family" >/dev/null 2>&1; then
    echo "sanitize: unknown family '$family' (expected decode, portable, sm90, merge, append, fp8prefill, positions, variants, sm90fp8)"; exit 2
  fi
done

if [ "${COLLECT_ONLY:-0}" = 1 ]; then
  status=0
  for family in $FAMILIES; do
    pytest_args "$family"
    n=$(python3 "${ARGS[@]}" --collect-only 2>&1 | grep -c "::")
    printf '%-9s %4d tests selected\n' "$family" "$n"
    [ "$n" -gt 0 ] || status=1
  done
  exit $status
fi

# 1. the selections without a sanitizer: compile the kernels, and the tests must pass
start=$(date +%s)
if [ "${PLAIN:-1}" != 0 ]; then
  for family in $FAMILIES; do
    pytest_args "$family"
    python3 "${ARGS[@]}" > "$LOGDIR/plain-$family.log" 2>&1 &
  done
  wait
  for family in $FAMILIES; do
    printf 'plain      %-9s %s\n' "$family" "$(tail -1 "$LOGDIR/plain-$family.log")"
  done
  echo "sanitize: selections ran plain in $(( $(date +%s) - start )) s"
fi

# 2. each tool over each family, JOBS at a time
tool_options() {
  case "$1" in
    racecheck) echo "--tool racecheck --racecheck-report $RACECHECK_REPORT" ;;
    *) echo "--tool $1" ;;
  esac
}
for tool in $TOOLS; do
  running=0
  for family in $FAMILIES; do
    pytest_args "$family"
    # shellcheck disable=SC2046
    ( t0=$(date +%s)
      compute-sanitizer $(tool_options "$tool") --target-processes application-only --report-api-errors no \
        --print-limit 100 \
        python3 "${ARGS[@]}" > "$LOGDIR/$tool-$family.log" 2>&1
      echo "sanitize: exit $? after $(( $(date +%s) - t0 )) s" >> "$LOGDIR/$tool-$family.log" ) &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
done

# 3. one line per tool and family
status=0
summary=$OUT/sanitize-summary.txt
: > "$summary"
for tool in $TOOLS; do
  for family in $FAMILIES; do
    log=$LOGDIR/$tool-$family.log
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$log" | awk '{s += $3} END {print s + 0}')
    hazards=$(grep -oE 'RACECHECK SUMMARY: [0-9]+ hazard' "$log" | awk '{s += $3} END {print s + 0}')
    summaries=$(grep -cE '(ERROR|RACECHECK) SUMMARY' "$log")
    tests=$(grep -E '[0-9]+ (passed|failed)|[0-9]+ errors? in' "$log" | tail -1)
    took=$(grep -oE 'after [0-9]+ s' "$log" | tail -1)
    why=""
    [ "$summaries" -gt 0 ] || why="$why, no sanitizer summary"
    [ "$errors" -eq 0 ] && [ "$hazards" -eq 0 ] || why="$why, errors or hazards"
    if [ -z "$tests" ] || echo "$tests" | grep -qE 'failed|error'; then why="$why, tests failed or did not run"; fi
    verdict=ok
    if [ -n "$why" ]; then verdict="FAIL (${why#, })"; status=1; fi
    printf '%-9s %-9s errors %-4s hazards %-4s %-28s %s %s\n' "$tool" "$family" "$errors" \
      "$([ "$tool" = racecheck ] && echo "$hazards" || echo -)" "${tests:-no pytest summary}" "${took:-}" "$verdict" \
      | tee -a "$summary"
  done
done
tar czf "$OUT/sanitize-logs.tgz" -C "$LOGDIR" . 2>/dev/null
echo "sanitize: $(( $(date +%s) - start )) s in all; logs in $LOGDIR and $OUT/sanitize-logs.tgz"
exit $status
