#!/usr/bin/env bash
# compute-sanitizer over the sanitizer cases, default settings, one summary line per tool and
# case: memcheck ("ERROR SUMMARY: 0 errors"), racecheck ("RACECHECK SUMMARY: 0 hazards") and
# synccheck. A case is one GPU test (small shapes, every family of an op or one family's points).
#   [TOOLS="memcheck racecheck synccheck"] [CASES="gpu_kernels:gpu_attention_decode ..."] \
#     [LIMIT=600] [JOBS=1] benches/sanitize.sh
# JOBS runs that many cases at once on the one GPU (each sanitizer is mostly host-bound); the lines
# then come in the order the cases finish.
# Needs the packed test binaries (.device/test-*, ../shared/tools/device-pack). Full logs in
# $OUT/r/sanitize-<tool>-<test>.log.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
tools=${TOOLS:-memcheck racecheck synccheck}
cases=${CASES:-"gpu_kernels:gpu_encoder gpu_kernels:gpu_layernorm gpu_kernels:gpu_attention \
gpu_kernels:gpu_softmax gpu_kernels:gpu_gelu gpu_kernels:gpu_residual gpu_kernels:gpu_attention_decode \
gpu_kernels:gpu_kv_append gpu_kernels:gpu_argmax gpu_kernels:gpu_sample gpu_matmul:gpu_matmul_mma_small \
gpu_matmul:gpu_matmul_wgmma_tma_3xtf32_small gpu_megakernel:megakernel_small_for_the_sanitizer"}
printf '%-10s %-48s %8s  %s\n' tool case seconds summary
run_case() {  # run_case TOOL CASE: one sanitizer over one test; prints its line, returns 1 on a finding
  local tool=$1 case=$2
  local bin=.device/test-${case%%:*} test=${case#*:}
  local log="$out/sanitize-$tool-$test.log" start=$(date +%s)
  timeout "${LIMIT:-600}" compute-sanitizer --tool "$tool" "$bin" --include-ignored --exact "$test" --test-threads=1 > "$log" 2>&1
  local rc=$? summary
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
  [[ -z $summary ]] && summary="no summary (exit $rc)"
  grep -q "test result: ok" "$log" || summary="$summary; the test did not pass (exit $rc)"
  printf '%-10s %-48s %8s  %s\n' "$tool" "$case" "$(( $(date +%s) - start ))" "$summary"
  [[ $summary == *" 0 errors"* || $summary == *" 0 hazards"* ]] && [[ $summary != *"did not pass"* ]]
}
status=0 running=0
for tool in $tools; do
  for case in $cases; do
    if (( running >= ${JOBS:-1} )); then wait -n || status=1; running=$((running - 1)); fi
    run_case "$tool" "$case" &
    running=$((running + 1))
  done
done
while (( running > 0 )); do wait -n || status=1; running=$((running - 1)); done
exit $status
