#!/usr/bin/env bash
# The pipeline for older GPUs, proven on the GPU here by standing in for them (`--target`): for
# each target and dtype, `tune --model gpt2 --batch 1,8`, `verify --sample 1`, `generate` on the
# launches, graph and megakernel engines, and the report of the target's database; per target,
# tests/parity_hf.py (logits and greedy ids against transformers). One summary line a step.
#   [TARGETS="sm_75:f16,f32 sm_80:f32,bf16"] [BUDGET=40] [LIMIT=300] [BIN=.device/kernelforge] \
#     benches/stand_in.sh
# Logs in $OUT/r/stand-in-<target>-<dtype>-<step>.log; every target tunes into a database of its
# own under $OUT/r/cache (KERNELFORGE_CACHE), next to none of the user's.
set -uo pipefail
bin=${BIN:-.device/kernelforge}
out=${OUT:-/tmp}/r
mkdir -p "$out"
export KERNELFORGE_CACHE=${KERNELFORGE_CACHE:-$out/cache}
targets=${TARGETS:-"sm_75:f16,f32 sm_80:f32,bf16 sm_86:f32,bf16 sm_89:f32,bf16"}
model=${MODEL:-/tmp/models/gpt2}
if [[ ! -d $model ]]; then
  python3 - "$model" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
fi
status=0
step() {  # step TARGET DTYPE NAME COMMAND...: runs it, prints one line
  local target=$1 dtype=$2 name=$3; shift 3
  local log="$out/stand-in-$target-$dtype-$name.log" start=$(date +%s)
  timeout "${LIMIT:-300}" "$@" > "$log" 2>&1
  local rc=$?
  ((rc == 0)) || status=1
  printf '%-6s %-5s %-22s rc=%-3s %4ss  %s\n' "$target" "$dtype" "$name" "$rc" "$(( $(date +%s) - start ))" \
    "$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-150)"
}
printf '%-6s %-5s %-22s %-6s %5s  %s\n' target dtype step exit time "last line"
for entry in $targets; do
  target=${entry%%:*} dtypes=${entry#*:}
  for dtype in ${dtypes//,/ }; do
    step "$target" "$dtype" tune "$bin" tune --target "$target" --model gpt2 --batch 1,8 --dtype "$dtype" \
      --budget "${BUDGET:-40}"
    step "$target" "$dtype" verify "$bin" verify --target "$target" --sample 1 --dtype "$dtype"
    for engine in launches graph megakernel; do
      step "$target" "$dtype" "generate-$engine" "$bin" generate --target "$target" --model "$model" --device cuda \
        --dtype "$dtype" --decode-engine "$engine" --prompt "The GPU in this notebook" --max-new-tokens 20 \
        --temperature 0.8 --top-k 40 --seed 1
    done
  done
  db=$(ls "$KERNELFORGE_CACHE"/tuning/*"-sm${target#sm_}.json" 2>/dev/null | head -1)
  step "$target" all report "$bin" report --target "$target" --db "$db" --out "$out/site-$target"
  step "$target" "$dtypes" parity env KERNELFORGE_TARGET="$target" python3 tests/parity_hf.py "$bin" \
    --dtypes "$dtypes"
done
exit $status
