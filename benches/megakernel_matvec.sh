#!/usr/bin/env bash
# One matrix-vector task of the decode megakernel, measured alone (benches/megakernel_matvec.cu):
# renders a megakernel point with `kernelforge inspect`, appends the harness, builds it with nvcc
# and runs it over the tasks of a GPT-2 small and a GPT-2 1.5B decode step at batch 1.
#   [KERNELFORGE=BIN] [DTYPE=bf16] benches/megakernel_matvec.sh [--param NAME=VALUE ...]
# The point is the default with one row, two slots of 96 KiB and the given --param on top (for
# example --param cols_per_warp=4, or --param tensor_cores=1 with MATVEC_TASK=matvec_task_mma, or
# --param kslice=1 with MATVEC_TASK=matvec_task_kslice: tasks of at most 16 columns).
# MLP=1 times fused MLP tasks instead (GPT-2 small's and 1.5B's, the point at fuse_mlp = 1), each
# with its sums added once a block and added every task.
# Needs nvcc (CUDA_HOME, else /usr/local/cuda) and a GPU with the copy engine of sm_90.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${KERNELFORGE:-$here/../target/release/kernelforge}
cuda=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin" inspect --root "$here/.." decode_megakernel --dtype "${DTYPE:-bf16}" \
  --param max_rows=1 --param slots=2 --param slot_kib=96 ${MLP:+--param fuse_mlp=1} "$@" > "$work/task.cu"
cat "$here/megakernel_matvec.cu" >> "$work/task.cu"
"$cuda/bin/nvcc" -arch=sm_90a -O3 -std=c++17 ${MATVEC_TASK:+-DMATVEC_TASK=$MATVEC_TASK} ${MLP:+-DMLP_TASK} \
  -o "$work/task" "$work/task.cu"
# matvec_task_kslice computes at most 16 columns (KSLICE_COLS): wider tasks are not its to run
fits() {
  [ "${MATVEC_TASK:-}" != matvec_task_kslice ] || [ "${1%x*}" -le 16 ] || { echo "$1: wider than kslice's 16 columns, skipped"; return 1; }
}
if [ -n "${MLP:-}" ]; then
  # hidden units x C of one MLP task: GPT-2 small's (128 tasks a stage), 1.5B's (493)
  for task in 24x768 13x1600; do
    fits "$task" || continue
    for every in 0 1; do "$work/task" "${task#*x}" "${task%x*}" $every || true; done
  done
  exit 0
fi
# rows x K of one task: GPT-2 small's qkv, fc, attention and fc projections (128 tasks a stage),
# then GPT-2 1.5B's (253, 256, 124 and 229 tasks); a task larger than a slot is refused
for task in 18x768 24x768 6x768 6x3072 19x1600 25x1600 13x1600 7x6400; do
  fits "$task" || continue
  "$work/task" "${task#*x}" "${task%x*}" || true
done
