#!/usr/bin/env bash
# One device call for the decode figures of the README and the closing notes: bench of random
# GPT-2 models per engine (with the floor), one megakernel timeline, the PyTorch static-cache
# CUDA-graph peer, a short tune whose database feeds `kernelforge report`. Results in $OUT/r.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
export PYTHONUNBUFFERED=1
dir=/tmp/models/gpt2
python3 - "$dir" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
run() {  # name, bench args...
  local name=$1; shift
  timeout 240 .device/kernelforge bench --model "$dir" --device cuda --seq 16 --generate 256 --repeats 2 --json "$@" \
    > "$out/$name.json" 2> "$out/$name.err" || echo "$name failed: $(tail -c 300 "$out/$name.err")"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))["decode"]
    print(f'{sys.argv[2]:28s} {d["tokens_per_s"]:9.1f} tok/s {d["ms_per_step"]*1e3:7.1f} us/step gpu {(d.get("gpu_ms_per_step") or 0)*1e3:7.1f} us'
          f'  floor {d.get("floor_ms", 0)*1e3:6.1f} us ({(d.get("floor_bytes") or 0)/1e6:.0f} MB @ {d.get("copy_gb_per_s") or 0:.0f} GB/s)'
          f'  share {100*(d.get("floor_share") or 0):4.1f}% wall {100*(d.get("floor_share_gpu") or 0):4.1f}% gpu')
except Exception as e:
    print(sys.argv[2], "no result", e)
PY
}
for dtype in bf16 f32; do
  for batch in 1 8; do
    for engine in graph megakernel; do
      run "$dtype-b$batch-$engine" --dtype $dtype --batch $batch --decode-engine $engine
    done
  done
done
run "bf16-b1-megakernel-timeline" --dtype bf16 --batch 1 --decode-engine megakernel --timeline "$out/timeline.svg"
timeout 200 python3 tests/parity_hf.py .device/kernelforge --size gpt2 --static-peer only --steps 128 > "$out/peer.log" 2>&1
tail -12 "$out/peer.log"
timeout 150 .device/kernelforge tune --model gpt2 --batch 1 --dtype bf16 --budget 60 --db "$out/db.json" > "$out/tune.log" 2>&1
tail -3 "$out/tune.log"
.device/kernelforge report --db "$out/db.json" --bench "$out/bf16-b1-megakernel-timeline.json" --bench "$out/bf16-b1-graph.json" --out "$out/site" > "$out/report.log" 2>&1
tail -2 "$out/report.log"
tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r
