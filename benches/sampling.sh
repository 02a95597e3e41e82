#!/usr/bin/env bash
# Sampled against greedy decode, and `generate` against `bench`, on every decode engine, in one
# device call: for each engine and batch, `bench` greedy and sampled (temperature 0.8, top-k 40,
# top-p 0.95) and `generate` greedy and sampled with the same prompt length and steps, then the
# ratios the sampling issue is judged by, the prefill and start-up times `generate` reports, and
# the wall time of a whole 20-token `generate` process (kernel cache warm).
#   [BIN=.device/kernelforge] [MODEL=DIR] [DTYPE=bf16] [BATCHES="1 8"] [STEPS=500] [ROUNDS=1] \
#     [ENGINES="launches graph megakernel"] [SAMPLED="--temperature 1 --seed 1"] benches/sampling.sh
# ROUNDS > 1 runs the four processes of each engine and batch that many times, alternating, and
# reports the median of each: the launches engine at batch 1 is bound by the host's launches, and
# one run of it moves by 10-30%.
# MODEL defaults to a random GPT-2 124M written to /tmp/models/gpt2 (needs torch + transformers).
# Logs in $OUT/r, one per run.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
bin=${BIN:-.device/kernelforge}
dir=${MODEL:-/tmp/models/gpt2}
dtype=${DTYPE:-bf16}
steps=${STEPS:-500}
sampled=${SAMPLED:-"--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1"}
prompt=15496,11,616,3290,318  # 5 tokens, as bench --seq 5
[ -d "$dir" ] || python3 - "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
model=$(basename "$dir")
field() { python3 -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for k in sys.argv[2].split("."): d=d[k]
print(f"{d:.1f}" if isinstance(d, float) else d)' "$1" "$2" 2>/dev/null || echo -; }
median() { python3 -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:] if x != "-"]; print(f"{statistics.median(v):.1f}" if v else "-")' "$@"; }
ratio() { python3 -c 'import sys; a,b=sys.argv[1:]; print(f"{float(a)/float(b):.3f}")' "$1" "$2" 2>/dev/null || echo -; }
printf '%-11s %5s %12s %12s %8s %12s %8s %12s %8s %9s %11s %9s\n' engine batch "bench greedy" "bench sampled" "s/g" \
  "gen greedy" "gen/bench" "gen sampled" "gen/bench" "prefill" "prefill GPU" "start-up"
for engine in ${ENGINES:-launches graph megakernel}; do
  for batch in ${BATCHES:-1 8}; do
    common=(--model "$dir" --device cuda --dtype "$dtype" --decode-engine "$engine")
    bgs=() bss=() ggs=() gss=()
    for round in $(seq "${ROUNDS:-1}"); do
      tag=""; [ "${ROUNDS:-1}" -gt 1 ] && tag="-r$round"
      b_g="$out/bench-$model-$dtype-$engine-b$batch-greedy$tag.json"
      b_s="$out/bench-$model-$dtype-$engine-b$batch-sampled$tag.json"
      g_g="$out/generate-$model-$dtype-$engine-b$batch-greedy$tag.json"
      g_s="$out/generate-$model-$dtype-$engine-b$batch-sampled$tag.json"
      timeout 300 "$bin" bench "${common[@]}" --batch "$batch" --seq 5 --generate "$steps" --repeats 1 --greedy --json > "$b_g" 2> "$b_g.err"
      # shellcheck disable=SC2086
      timeout 300 "$bin" bench "${common[@]}" --batch "$batch" --seq 5 --generate "$steps" --repeats 1 $sampled --json > "$b_s" 2> "$b_s.err"
      timeout 300 "$bin" generate "${common[@]}" --ids "$prompt" --batch "$batch" --max-new-tokens "$((steps + 1))" --ignore-eot --greedy --json > "$g_g" 2> "$g_g.err"
      # shellcheck disable=SC2086
      timeout 300 "$bin" generate "${common[@]}" --ids "$prompt" --batch "$batch" --max-new-tokens "$((steps + 1))" --ignore-eot $sampled --json > "$g_s" 2> "$g_s.err"
      bgs+=("$(field "$b_g" decode.tokens_per_s)"); bss+=("$(field "$b_s" decode.tokens_per_s)")
      ggs+=("$(field "$g_g" decode_tokens_per_s)"); gss+=("$(field "$g_s" decode_tokens_per_s)")
    done
    bg=$(median "${bgs[@]}"); bs=$(median "${bss[@]}"); gg=$(median "${ggs[@]}"); gs=$(median "${gss[@]}")
    printf '%-11s %5s %12s %12s %8s %12s %8s %12s %8s %9s %11s %9s\n' "$engine" "$batch" "$bg" "$bs" "$(ratio "$bs" "$bg")" \
      "$gg" "$(ratio "$gg" "$bg")" "$gs" "$(ratio "$gs" "$bs")" "$(field "$g_s" stats.prefill_ms)" \
      "$(field "$g_s" stats.prefill_gpu_ms)" "$(field "$g_s" stats.startup_ms)"
  done
done
# A whole process: 20 new tokens from the 5-token prompt, the kernel cache warm from the runs above.
for engine in ${ENGINES:-launches graph megakernel}; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  "$bin" generate --model "$dir" --device cuda --dtype "$dtype" --decode-engine "$engine" --ids "$prompt" \
    --max-new-tokens 20 --ignore-eot $sampled > "$out/generate20-$engine.txt" 2>&1
  end=$(date +%s.%N)
  echo "generate 20 tokens, $engine engine, whole process: $(python3 -c "print(f'{$end - $start:.2f}')") s wall; $(tail -1 "$out/generate20-$engine.txt")"
done
