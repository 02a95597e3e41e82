#!/usr/bin/env bash
# Where the decode megakernel's warps wait, from Nsight Compute: one decode step of a random
# GPT-2 124M (bf16, batch 1) profiled with the warp-state, scheduler and source sections, for
# each project folder given (A/B of template versions with one binary). The warp-state table
# answers what the timeline cannot: whether a task's time goes to instruction fetch ("No
# Instruction": the kernel's code runs cold), to memory ("Long Scoreboard"), to barriers or to
# the handoff's fences ("Membar"). Run on the GPU machine after ../shared/tools/device-pack:
#   [BIN=.device/kernelforge] [PROMPT=16] [BATCH=1] [MODEL=DIR] benches/megakernel_stalls.sh [ROOT...]
# (default ROOT: .; default MODEL: a random GPT-2 124M written to /tmp/models/gpt2). Results in $OUT/r: per root, the ncu report (open it with ncu-ui or
# `ncu --import FILE --page source`) and the printed sections.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
bin=$(realpath "${BIN:-.device/kernelforge}")   # ncu wants a path it can find
prompt=${PROMPT:-16}
dir=${MODEL:-/tmp/models/gpt2}
batch=${BATCH:-1}
[ -z "${MODEL:-}" ] || [ -d "$dir" ] || { echo "MODEL=$dir: no such folder" >&2; exit 2; }
[ -d "$dir" ] || python3 - "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
[ $# -gt 0 ] || set -- .
for root in "$@"; do
  name=$(basename "$(realpath "$root")")
  # --launch-skip: past the warm-up steps, so the step profiled is a steady one; kernel replay
  # restores memory between passes, so the counters and the KV cache see the same step each time.
  timeout 300 ncu --kernel-name regex:decode_megakernel --launch-skip 8 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    --import-source yes --export "$out/stalls-$name" --force-overwrite \
    "$bin" bench --root "$root" --model "$dir" --device cuda --decode-engine megakernel \
    --dtype bf16 --batch "$batch" --seq "$prompt" --generate 16 --repeats 1 > "$out/stalls-$name.txt" 2>&1
  echo "== $root (exit $?): warps stalled per issued instruction, by reason (largest first)"
  # With --export ncu prints no sections: read them back from the report.
  ncu --import "$out/stalls-$name.ncu-rep" --page details --print-details all > "$out/details-$name.txt" 2>&1
  grep -E 'issue_stalled_.*_per_issue_active' "$out/details-$name.txt" | awk '{print $NF, $1}' | sort -g -r | head -12
  grep -E 'Warp Cycles Per Issued Instruction' "$out/details-$name.txt" | head -1
  # Per SASS instruction (stall samples by reason): where in the code the warps wait.
  ncu --import "$out/stalls-$name.ncu-rep" --page source --csv --print-source sass > "$out/sass-$name.csv" 2>&1
done
