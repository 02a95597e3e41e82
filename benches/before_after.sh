#!/usr/bin/env bash
# Two builds side by side in one device call, turn by turn: is any figure slower after a change?
# Each build runs with its own specs and templates (--root), the same model, the same flags, no
# tuning database (every kernel at its family default), a kernel cache of its own.
#   OLD_BIN=.device/kernelforge-old OLD_ROOT=.device/old-root [NEW_BIN=.device/kernelforge] \
#     [DTYPES="f32 bf16"] [ENGINES="graph megakernel"] [ROUNDS=2] [MODEL=DIR] benches/before_after.sh
# Prepare the old side here: build the old commit's binary, and
#   mkdir -p .device/old-root && git archive OLD_COMMIT specs templates | tar -x -C .device/old-root
# One line per run (forward tokens/s at batch 4 x 512 tokens, decode tokens/s and GPU ms a step
# over 64 greedy steps), then per dtype and engine the new / old ratio of the rounds' medians.
# JSON in $OUT/r/before-after-*.json.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
old_bin=${OLD_BIN:?OLD_BIN: the old build} old_root=${OLD_ROOT:?OLD_ROOT: the old specs/ and templates/}
new_bin=${NEW_BIN:-.device/kernelforge} new_root=${NEW_ROOT:-.}
model=${MODEL:-/tmp/models/gpt2}
[ -d "$model" ] || python3 - "$model" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
PY
for round in $(seq "${ROUNDS:-2}"); do
  for side in old new; do
    if [[ $side == old ]]; then bin=$old_bin root=$old_root; else bin=$new_bin root=$new_root; fi
    for dtype in ${DTYPES:-f32 bf16}; do
      for engine in ${ENGINES:-graph megakernel}; do
        j="$out/before-after-$round-$side-$dtype-$engine.json"
        KERNELFORGE_CACHE="$out/cache-$side" timeout 120 "$bin" bench --root "$root" --model "$model" --device cuda \
          --dtype "$dtype" --batch 4 --seq 512 --generate 64 --decode-engine "$engine" --greedy --repeats 5 --json \
          > "$j" 2> "$j.err"
        python3 - "$j" "$round $side $dtype $engine" <<'PY' || echo "$round $side $dtype $engine: $(tail -1 "$j.err")"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(sys.argv[2], "forward", round(d["forward"]["tokens_per_s"]), "decode", round(d["decode"]["tokens_per_s"]),
      "gpu_ms", d["decode"]["gpu_ms_per_step"])
PY
      done
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
runs = {}
for path in glob.glob(f"{sys.argv[1]}/before-after-*.json"):
    _round, side, dtype, engine = path.rsplit("/", 1)[1][len("before-after-"):-len(".json")].split("-")
    try:
        d = json.loads(open(path).read().strip().splitlines()[-1])
    except Exception:
        continue
    runs.setdefault((dtype, engine, side), []).append((d["forward"]["tokens_per_s"], d["decode"]["tokens_per_s"]))
print(f"{'dtype':6} {'engine':11} {'forward new/old':>16} {'decode new/old':>15}")
for dtype, engine in sorted({(k[0], k[1]) for k in runs}):
    old, new = runs.get((dtype, engine, "old")), runs.get((dtype, engine, "new"))
    if not old or not new:
        print(f"{dtype:6} {engine:11} {'-':>16} {'-':>15}")
        continue
    med = lambda rs, i: statistics.median(r[i] for r in rs)
    print(f"{dtype:6} {engine:11} {med(new, 0) / med(old, 0):16.3f} {med(new, 1) / med(old, 1):15.3f}")
PY
