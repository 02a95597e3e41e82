#!/usr/bin/env bash
# The tuning-time figures (README "Where tuning stands", benches/RESULTS.md) in one device
# call: `tune` of the GPT-2 124M shapes cold (empty compile cache and database) in bf16 and
# f32, the bf16 model again warm, one matmul shape cold in bf16 and f32, and the bf16 model
# cold with NVRTC on threads of one process (KERNELFORGE_COMPILE_WORKERS=0) instead of worker
# processes. Run on the GPU machine after ../shared/tools/device-pack (the binary in
# .device/); results in $OUT/r, the summary is printed. The first compile-heavy run of a fresh
# machine also pays for loading NVRTC from a cold page cache: WARM=1 (the default) runs one
# small tune first so that the figures do not.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
kf=.device/kernelforge
echo "$(nproc) CPU cores; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
run() {  # name, then env assignments and the command
  local name=$1; shift
  /usr/bin/time -f "%e" -o "$out/$name.time" timeout 400 env "$@" > "$out/$name.json" 2> "$out/$name.err"
  echo "$name: $(cat "$out/$name.time") s; $(grep -E 'workloads \(' "$out/$name.err" | tail -1)"
}
rm -rf /tmp/kf-tune-time
c=/tmp/kf-tune-time
if [[ ${WARM:-1} == 1 ]]; then
  KERNELFORGE_CACHE=$c/warmup $kf tune --op matmul --shape 64,64,64 --dtype bf16 > /dev/null 2>&1
fi
run bf16_cold KERNELFORGE_CACHE=$c/bf16 $kf tune --model gpt2 --batch 1,8 --dtype bf16 --json
run bf16_warm KERNELFORGE_CACHE=$c/bf16 $kf tune --model gpt2 --batch 1,8 --dtype bf16 --json
run bf16_cold_threads KERNELFORGE_COMPILE_WORKERS=0 KERNELFORGE_CACHE=$c/bf16t $kf tune --model gpt2 --batch 1,8 --dtype bf16 --json
run f32_cold KERNELFORGE_CACHE=$c/f32 $kf tune --model gpt2 --batch 1,8 --dtype f32 --json
run op_bf16 KERNELFORGE_CACHE=$c/op_bf16 $kf tune --op matmul --shape 1024,768,768 --dtype bf16 --json
run op_f32 KERNELFORGE_CACHE=$c/op_f32 $kf tune --op matmul --shape 1024,768,768 --dtype f32 --json
tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r
