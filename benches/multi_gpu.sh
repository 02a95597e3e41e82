#!/usr/bin/env bash
# One device call (kind nvidia-h200-x2) for the several-GPU figures: the replica tests, then
# `bench` forward (batch 16 x 1024) and greedy decode (DECODE_BATCHES, default 16, 128 and 256,
# after a 16-token prompt; and LONG_BATCHES, default 16, after 768, where the cache read grows
# with the batch) on one GPU and on all, greedy ids (at
# IDS_BATCHES, default 8 and 256) and forward logits of one GPU against all, and (with TUNE=1) a
# cold `tune` on one GPU against all (ONLY_TESTS=1: the tests alone; TESTS=0: the figures
# alone). DB=FILE: the tuning database every run reads (copied into the cache). Results in
# $OUT/r; the summary is printed.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
export PYTHONUNBUFFERED=1
kf=.device/kernelforge
nvidia-smi -L | tee "$out/gpus.txt"
dir=/tmp/models/gpt2
python3 - "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
if [[ ${TESTS:-1} == 1 ]]; then
  for t in ${TEST_BINS:-gpu_multi}; do
    timeout 400 .device/test-$t --include-ignored --test-threads=1 > "$out/test-$t.log" 2>&1
    echo "$t: $(grep -E '^test result' "$out/test-$t.log" | tail -1)"
    grep -E "skipped|sliced|panicked|FAILED" "$out/test-$t.log" | head -20
  done
  # ONLY_TESTS=1: a call of its own for the tests, the figures in another.
  if [[ ${ONLY_TESTS:-0} == 1 ]]; then tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r; exit 0; fi
fi
if [[ -n ${DB:-} ]]; then
  # saved under the name the backend looks for, from the database's own header (tune::db's file_name)
  name=$(python3 -c 'import json, re, sys; h = json.load(open(sys.argv[1]))["header"]
print(re.sub("[^a-z0-9]", "-", h["gpu"].lower()).strip("-") + "-sm%d%d.json" % tuple(h["compute_capability"]))' "$DB") || exit 2
  mkdir -p /tmp/kc-db/tuning && cp "$DB" "/tmp/kc-db/tuning/$name" && export KERNELFORGE_CACHE=/tmp/kc-db
fi
if [[ ${TUNE:-0} == 1 ]]; then
  # Cold: an empty compile cache and database each (KERNELFORGE_CACHE holds both). `threads`:
  # one GPU with NVRTC on threads of one process (KERNELFORGE_COMPILE_WORKERS=0) instead of
  # worker processes.
  for run in threads 0 all; do
    devices=${run/threads/0}
    workers=$([[ $run == threads ]] && echo 0 || echo "")
    rm -rf "/tmp/kc-$run"
    KERNELFORGE_COMPILE_WORKERS=$workers KERNELFORGE_CACHE=/tmp/kc-$run /usr/bin/time -f "%e" -o "$out/tune-$run.time" timeout 400 \
      $kf tune --model gpt2 --batch 1,8 --dtype bf16 --devices $devices --json > "$out/tune-$run.json" 2> "$out/tune-$run.err"
    echo "tune --devices $devices${workers:+ (compiling on threads)} (cold, bf16, batch 1,8): $(cat "$out/tune-$run.time") s; $(grep -E 'workloads' "$out/tune-$run.err" | tail -1)"
    grep -E '^  cuda' "$out/tune-$run.err"
  done
  # The benches below run with the kernels tuned on all GPUs.
  export KERNELFORGE_CACHE=/tmp/kc-all
fi
bench() {  # name, args...
  local name=$1; shift
  timeout 300 $kf bench --model "$dir" --device cuda --json "$@" > "$out/$name.json" 2> "$out/$name.err" \
    || echo "$name failed: $(tail -c 400 "$out/$name.err")"
}
# One GPU's own half of the batch, for what a replica could at best reach.
bench "forward_half-0" --dtype bf16 --batch 8 --seq 1024 --generate 0 --repeats 30 --devices 0
bench "decode_half-0" --dtype bf16 --batch 8 --seq 16 --generate 256 --repeats 1 --devices 0
decode_batches=${DECODE_BATCHES:-16 128 256}
long_batches=${LONG_BATCHES:-16}
for devices in 0 all; do
  bench "forward-$devices" --dtype bf16 --batch 16 --seq 1024 --generate 0 --repeats 30 --devices $devices
  for b in $decode_batches; do
    bench "decode$b-$devices" --dtype bf16 --batch $b --seq 16 --generate 256 --repeats 1 --devices $devices
  done
  for b in $long_batches; do
    bench "decode_long$b-$devices" --dtype bf16 --batch $b --seq 768 --generate 256 --repeats 1 --devices $devices
  done
done
python3 - "$out" "$decode_batches" "$long_batches" <<'PY'
import json, sys
out, decode_batches, long_batches = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def load(n):
    try: return json.load(open(f"{out}/{n}.json"))
    except Exception as e: return None
runs = [("forward", "forward")] + [(f"decode{b}", "decode") for b in decode_batches] + [(f"decode_long{b}", "decode") for b in long_batches]
for kind, key in runs:
    one, two = load(f"{kind}-0"), load(f"{kind}-all")
    if not one or not two:
        print(kind, "missing"); continue
    a, b = one[key]["tokens_per_s"], two[key]["tokens_per_s"]
    extra = ""
    if key == "decode":
        g1, g2 = one[key].get("gpu_ms_per_step") or 0, two[key].get("gpu_ms_per_step") or 0
        extra = f"; after a {one[key]['prefill_tokens']}-token prefill; GPU ms/step {g1:.3f} vs {g2:.3f}; floor {one[key].get('floor_ms', 0):.3f} vs {two[key].get('floor_ms', 0):.3f} ms"
    half = load({"forward": "forward_half-0", "decode16": "decode_half-0"}.get(kind, ""))
    if half:
        h = half[key]
        extra += f"; one GPU at batch 8: {h['tokens_per_s']:,.0f} tok/s" + (f", GPU ms/step {h.get('gpu_ms_per_step') or 0:.3f}" if key == "decode" else f", {h['median_ms']:.3f} ms vs {one[key]['median_ms']:.3f} at 16 and {two[key]['median_ms']:.3f} on all")
    tuned = one.get("tuned_kernels") or {}
    extra += f"; kernels tuned {tuned.get('tuned', '?')}/{tuned.get('total', '?')}"
    batch = one.get("batch", "?")
    print(f"{kind} bf16 batch {batch}: 1 GPU {a:,.0f} tok/s, {two['devices']} slices {two.get('batch_slices')} {b:,.0f} tok/s -> {b/a:.2f}x ({two['device_name']}){extra}")
PY
# Greedy ids and forward logits: one GPU against all.
for dtype in f32 bf16; do
  for devices in 0 all; do
    for b in ${IDS_BATCHES:-8 256}; do
      timeout 200 $kf generate --model "$dir" --device cuda --dtype $dtype --ids 464,2068,7586 --batch $b --greedy \
        --ignore-eot --max-new-tokens 256 --print-ids --devices $devices > "$out/ids$b-$dtype-$devices.txt" 2> "$out/ids$b-$dtype-$devices.err"
    done
    timeout 200 $kf forward --model "$dir" --device cuda --dtype $dtype --ids 464,2068,7586,11 --ids 50256,1,2,3 --ids 9,8,7,6 \
      --logits-out "$out/logits-$dtype-$devices.npy" --devices $devices > /dev/null 2> "$out/fwd-$dtype-$devices.err"
  done
  for b in ${IDS_BATCHES:-8 256}; do
    if [[ -s "$out/ids$b-$dtype-0.txt" ]] && cmp -s "$out/ids$b-$dtype-0.txt" "$out/ids$b-$dtype-all.txt"; then
      echo "greedy ids $dtype batch $b, 256 steps: identical on 1 and all GPUs ($(wc -l < "$out/ids$b-$dtype-0.txt") sequences)"
    else
      echo "greedy ids $dtype batch $b: DIFFER or missing ($(tail -c 300 "$out/ids$b-$dtype-all.err"))"
    fi
  done
  cmp -s "$out/logits-$dtype-0.npy" "$out/logits-$dtype-all.npy" && echo "forward logits $dtype, 3 sequences: bit-identical on 1 and all GPUs" \
    || echo "forward logits $dtype: DIFFER"
done
tail -1 "$out"/ids256-bf16-all.err
tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r
