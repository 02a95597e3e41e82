#!/usr/bin/env bash
# Decode figures the short-prompt run of benches/decode_report.sh does not cover: GPT-2 124M after
# a 1,000-token prompt (the KV cache counts in the floor) and GPT-2 1.5B at batch 1, each with the
# graph and the megakernel engine (random weights written here with transformers). Run on the GPU
# machine after ../shared/tools/device-pack; results in $OUT/r.
set -uo pipefail
out=$OUT/r; mkdir -p $out
export PYTHONUNBUFFERED=1
python3 - /tmp/models/gpt2 /tmp/models/gpt2-xl <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
with torch.device("cuda"):
    m = GPT2LMHeadModel(GPT2Config(n_layer=48, n_head=25, n_embd=1600))
m.to("cpu").save_pretrained(sys.argv[2], safe_serialization=True)
PY
show() {  # bench JSON, label: one line of decode figures
  python3 - "$1" "$2" <<'PY' || tail -c 300 "${1%.json}.err"
import json, sys
d = json.load(open(sys.argv[1]))["decode"]
print(f'{sys.argv[2]:34s} {d["tokens_per_s"]:8.1f} tok/s {d["ms_per_step"]*1e3:7.1f} us/step gpu {(d.get("gpu_ms_per_step") or 0)*1e3:7.1f}'
      f' floor {d["floor_ms"]*1e3:6.1f} us share {100*d["floor_share"]:4.1f}% wall {100*(d.get("floor_share_gpu") or 0):4.1f}% gpu')
PY
}
for e in graph megakernel; do
  timeout 200 .device/kernelforge bench --model /tmp/models/gpt2 --device cuda --dtype bf16 --batch 1 --seq 1000 --generate 24 --repeats 1 --json --decode-engine $e > $out/long-$e.json 2> $out/long-$e.err; show $out/long-$e.json "124M bf16 B=1 after 1000 ($e)"
  timeout 200 .device/kernelforge bench --model /tmp/models/gpt2 --device cuda --dtype f32 --batch 1 --seq 1000 --generate 24 --repeats 1 --json --decode-engine $e > $out/longf-$e.json 2> $out/longf-$e.err; show $out/longf-$e.json "124M f32 B=1 after 1000 ($e)"
done
for e in graph megakernel; do
  timeout 240 .device/kernelforge bench --model /tmp/models/gpt2-xl --device cuda --dtype bf16 --batch 1 --seq 16 --generate 64 --repeats 1 --json --decode-engine $e > $out/xl-$e.json 2> $out/xl-$e.err; show $out/xl-$e.json "1.5B bf16 B=1 ($e)"
done
tar czf $OUT/results.tgz -C $OUT r
