#!/usr/bin/env bash
# A/B of two (or more) versions of the decode step in one device call: the same `bench` workloads
# with binary and project folder A, then B (then C, ...), alternating for ROUNDS rounds so that
# clock drift hits all alike; prints GPU and wall ms per step and tokens/s per workload and side. Use it before
# merging a change to the megakernel's template or the decode path: a template change needs
# only the folders (the binary renders the templates it finds there), a Rust change a second
# binary. A change that adds a spec value: A/B it against the previous commit too (that
# commit's binary and folder as side A), at the workloads it is not meant to touch, since code
# added for one point can slow every other (the fused MLP's runtime flags cost batch 8 10%).
#   A_ROOT=.device/before B_ROOT=. [A_BIN=...] [B_BIN=...] [ROUNDS=2] [WORKLOADS="..."] \
#     [ENGINE=megakernel] [MODEL=DIR] [FLAGS="..."] [TIMELINE=1] benches/decode_ab.sh
# or, for more than two sides, SIDES="name:binary:folder ..." instead of A_* and B_* (names
# without spaces or colons; e.g. "before:.device/kf-old:.device/before aligned:.device/kernelforge:."
# for a binary and a template variant against the previous commit's). FLAGS are added to every
# `bench` (e.g. "--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1" for sampled steps).
# A workload is dtype:batch:prompt:steps (default: bf16 and f32 at batch 1 after 16 and 1,000
# tokens, bf16 at batch 8); its batch may be a list (bf16:1,8,64,256:16:128, one `bench` process
# and a row per batch, GPU ms and tokens/s). ENGINE is the decode engine (megakernel, graph or
# launches); MODEL is a checkpoint folder (default: a random GPT-2 124M written to
# /tmp/models/gpt2). A tuning database in the usual place is used by both sides alike.
# TIMELINE=1 (megakernel) then runs the first workload once more per side with
# `bench --timeline` and prints every side's per-op tables (signal, inputs, work a stage: what a
# change moved, not only by how much). Prepare A's folder here with
#   mkdir -p .device/before && git archive REV specs templates | tar -x -C .device/before
# Results in $OUT/r, one text file per run, named by side, model folder, workload and round.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
if [ -n "${SIDES:-}" ]; then
  sides=$SIDES
else
  sides="A:${A_BIN:-.device/kernelforge}:${A_ROOT:?A_ROOT: the project folder (specs/, templates/) of side A, or SIDES}"
  sides+=" B:${B_BIN:-.device/kernelforge}:${B_ROOT:-.}"
fi
read -r -a flags <<< "${FLAGS:-}"
rounds=${ROUNDS:-2}
engine=${ENGINE:-megakernel}
workloads=${WORKLOADS:-bf16:1:16:256 bf16:1:1000:48 f32:1:1000:48 bf16:8:16:128}
dir=${MODEL:-/tmp/models/gpt2}
[ -z "${MODEL:-}" ] || [ -d "$dir" ] || { echo "MODEL=$dir: no such folder" >&2; exit 2; }
model=$(basename "$dir")  # in the log names, so that runs of two models into one $OUT/r both stay
[ -d "$dir" ] || python3 - "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
# "batch GPU-ms tokens/s" for each "bench: batch N (i of n): T tokens/s, G ms GPU a step, ..." line.
batch_rows() {
  sed -nE 's/^bench: batch ([0-9]+) .*: ([0-9,]+) tokens\/s, ([0-9.]+) ms GPU a step.*/\1 \3 \2/p' "$1" | tr -d ,
}
printf '%-10s %-22s %5s %10s %10s %10s\n' side workload round "gpu ms" "wall ms" "tokens/s"
for round in $(seq "$rounds"); do
  for w in $workloads; do
    IFS=: read -r dtype batch prompt steps <<< "$w"
    for s in $sides; do
      IFS=: read -r side bin root <<< "$s"
      log="$out/$side-$model-$dtype-b${batch//,/_}-p$prompt-r$round.txt"
      timeout 150 "$bin" bench --root "$root" --model "$dir" --device cuda --decode-engine "$engine" --repeats 1 \
        --dtype "$dtype" --batch "$batch" --seq "$prompt" --generate "$steps" "${flags[@]}" > "$log" 2>&1
      if [[ $batch == *,* ]]; then  # a list: one "bench: batch N (i of n): ..." line per batch
        rows=$(batch_rows "$log")
        [ -n "$rows" ] || rows="$batch failed (see $log) -"
        while read -r b gpu tps; do
          printf '%-10s %-22s %5s %10s %10s %10s\n' "$side" "$dtype:$b:$prompt:$steps" "$round" "$gpu" - "$tps"
        done <<< "$rows"
        continue
      fi
      line=$(grep -E '^decode:' "$log")
      wall=$(sed -E 's/.*\(([0-9.]+) ms\/step.*/\1/' <<< "$line")
      gpu=$(sed -E 's/.*of which ([0-9.]+) ms on the GPU.*/\1/' <<< "$line")
      tps=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<< "$line")
      [ -n "$line" ] || { gpu=failed wall="(see $log)" tps=-; }
      printf '%-10s %-22s %5s %10s %10s %10s\n' "$side" "$w" "$round" "$gpu" "$wall" "$tps"
    done
  done
done
if [ "${TIMELINE:-0}" = 1 ]; then
  IFS=: read -r dtype batch prompt steps <<< "${workloads%% *}"
  for s in $sides; do
    IFS=: read -r side bin root <<< "$s"
    log="$out/$side-$model-timeline.txt"
    timeout 150 "$bin" bench --root "$root" --model "$dir" --device cuda --decode-engine megakernel --repeats 1 \
      --dtype "$dtype" --batch "$batch" --seq "$prompt" --generate 32 --timeline "$out/$side-$model-timeline.svg" "${flags[@]}" > "$log" 2>&1
    echo "== $side: per-op timeline of ${workloads%% *} ($log)"
    grep -A8 '^op ' "$log" || echo "(no timeline: see $log)"
  done
fi
