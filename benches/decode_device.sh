#!/usr/bin/env bash
# One device call for the decode engines: the GPU tests of the megakernel, then `bench` of random
# GPT-2 models (written here with transformers, so no download) for every engine, batch and dtype
# asked for. Run from the repo root on the GPU machine after ../shared/tools/device-pack:
#   benches/decode_device.sh [SIZES] [BATCHES] [DTYPES] [ENGINES]
#   e.g. benches/decode_device.sh "gpt2 gpt2-xl" "1 8" "bf16 f32" "graph megakernel"
# Logs and JSON go to $OUT/r/ (or /tmp/r), packed into results.tgz.
set -uo pipefail
sizes=${1:-gpt2}
batches=${2:-1 8}
dtypes=${3:-bf16 f32}
engines=${4:-graph megakernel}
steps=${STEPS:-256}
seq=${SEQ:-16}
out=${OUT:-/tmp}/r
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ -z ${SKIP_TESTS:-} ]]; then
  .device/test-gpu_megakernel --include-ignored --test-threads=1 --nocapture > "$out/test-gpu_megakernel.log" 2>&1
  echo "gpu_megakernel tests: exit $? ($(grep -E '^test result' "$out/test-gpu_megakernel.log"))"
fi
for size in $sizes; do
  dir=/tmp/models/$size
  python3 - "$size" "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
dims = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}
l, h, c = dims[sys.argv[1]]
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(n_layer=l, n_head=h, n_embd=c)).save_pretrained(sys.argv[2], safe_serialization=True)
PY
  for dtype in $dtypes; do
    for batch in $batches; do
      for engine in $engines; do
        name="bench-$size-$dtype-b$batch-$engine"
        timeout 300 .device/kernelforge bench --model "$dir" --device cuda --decode-engine "$engine" \
          --dtype "$dtype" --batch "$batch" --seq "$seq" --generate "$steps" --repeats 2 --json \
          > "$out/$name.json" 2> "$out/$name.err"
        python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
    d = j["decode"]
    print(f'{sys.argv[2]:40s} {d["tokens_per_s"]:10.1f} tok/s  {d["ms_per_step"]*1e3:8.1f} us/step  gpu {(d.get("gpu_ms_per_step") or 0)*1e3:8.1f} us/step')
except Exception as e:
    print(f'{sys.argv[2]:40s} failed: {open(sys.argv[1][:-5] + ".err").read()[-300:]}')
PY
      done
    done
  done
done | tee "$out/summary.txt"
tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r
