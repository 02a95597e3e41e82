#!/usr/bin/env bash
# What cuBLASLt runs on a GEMM and where our kernel stands beside it, from Nsight Compute, in one
# device call. For each workload, `tune --op` runs under ncu (clocks as they are, L2 flushed
# before each profiled kernel) and keeps cuBLASLt's offers (the kernels its heuristic gives the
# peer: their names carry cuBLASLt's tile, stages and cluster); with POINT, a second run keeps
# our kernel at that point of matmul_wgmma_tma (a project copy whose spec keeps only the values
# POINT gives; give all of them for one point). One line a kernel: time, SM clock, share of the
# cycles the tensor pipe was busy, bytes the crossbar delivered into the SMs (a tile's operand
# bytes: multicast does not lower them; over the time and SMs, how fast the feed runs), L2 and
# DRAM bytes, grid and cluster.
#
#   [WORKLOADS="dtype:M,N,K:epilogue ..."] [POINT='{"mma_n": 160, "m_tiles": 2, ...}'] \
#     benches/gemm_vs_peer_ncu.sh
#
# The default workloads are the rows below 0.95x in `README.md`: GPT-2 small's LM head at
# M = 1024 (bf16), GPT-2 1.5B's fc projection at M = 1024 (bf16), and the tf32 LM head at
# M = 8192. Run it on the GPU machine after ../shared/tools/device-pack (the binary in .device/);
# the printed tables and ncu's raw CSV are in $OUT/r.
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
kf=$(realpath "${KF:-.device/kernelforge}")   # ncu wants a path it can find
workloads=${WORKLOADS:-bf16:1024,50304,768:none bf16:1024,1600,6400:bias_residual tf32:8192,50304,768:none}
root=.   # our side's project folder
if [ -n "${POINT:-}" ]; then
  root=$(mktemp -d)
  cp -r specs templates "$root"/
  rm "$root"/specs/matmul_wgmma_tma_3xtf32.toml   # it extends the spec cut down here
  python3 - "$root/specs/matmul_wgmma_tma.toml" "$POINT" <<'PY'
import json, re, sys
path, point = sys.argv[1], json.loads(sys.argv[2])
s = open(path).read()
s = re.sub(r"(?ms)^\[\[start\]\]\n.*?(?=^\[|\Z)", "", s)   # start points lie outside the cut
head, default = s.split("[default]", 1)
for name, value in point.items():
    head, n = re.subn(r"(?m)^%s = \[[^\]]*\]" % name, "%s = [%d]" % (name, value), head, count=1)
    default, m = re.subn(r"(?m)^%s = .*$" % name, "%s = %d" % (name, value), default, count=1)
    if n != 1 or m != 1:
        sys.exit(f"POINT: matmul_wgmma_tma has no parameter {name}")
open(path, "w").write(head + "[default]" + default)
PY
fi
metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__cluster_dim_x,launch__cluster_dim_y
# One profile of a `tune --op` run: the first COUNT kernels whose names match REGEX.
profile() {  # log regex count shape epilogue dtype root
  KERNELFORGE_CACHE=$(mktemp -d) timeout 300 ncu --clock-control none --csv --metrics "$metrics" \
    --kernel-name regex:"$2" --launch-count "$3" \
    "$kf" tune --root "$7" --op matmul --shape "$4" --epilogue "$5" --dtype "$6" --budget 5 > "$1.csv" 2> "$1.err"
}
for w in $workloads; do
  IFS=: read -r dtype shape epilogue <<< "$w"
  log="$out/ncu-$dtype-${shape//,/x}-$epilogue"
  # cuBLASLt's offers (all full-size: the peer is checked on the whole problem) ...
  profile "$log-peer" 'nvjet|xmma|cutlass|gemm' 12 "$shape" "$epilogue" "$dtype" .
  echo "== $dtype $shape $epilogue (ncu exit $?)"
  # ... and with POINT our kernel: its verification on a few rows, then its timed runs.
  [ -n "${POINT:-}" ] && profile "$log-ours" matmul_wgmma_tma 3 "$shape" "$epilogue" "$dtype" "$root"
  python3 - "$metrics" "$log-peer.csv" ${POINT:+"$log-ours.csv"} <<'PY'
import csv, sys
# Each value in base units (seconds, bytes, hertz) whatever scale ncu printed it in.
scale = {"": 1, "%": 1, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9,
         "usecond": 1e-6, "msecond": 1e-3, "second": 1, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1,
         "hz": 1, "Khz": 1e3, "Mhz": 1e6, "Ghz": 1e9, "cycle/second": 1, "cycle/usecond": 1e6,
         "cycle/nsecond": 1e9}
names = sys.argv[1].split(",")
print(f"{'us':>8} {'GHz':>5} {'tensor%':>7} {'to SMs MB':>9} {'L2 MB':>7} {'DRAM r/w MB':>13} {'grid':>5} cluster  kernel")
for side, path in enumerate(sys.argv[2:]):
    # ncu's CSV rows (one per kernel and metric) among the tuner's output: a dict per launch.
    launches = {}
    for r in csv.reader(open(path)):
        if len(r) > 14 and r[0].isdigit():
            unit = r[-2] if r[-2] in scale else ""
            launches.setdefault((int(r[0]), r[4]), {})[r[-3]] = float(r[-1].replace(",", "") or 0) * scale[unit]
    rows = [(name, {k: m.get(k, 0.0) for k in names}) for (_, name), m in sorted(launches.items())]
    if side == 1:   # ours: the longest launch is a timed run on the whole shape
        rows = [max(rows, key=lambda r: r[1]["gpu__time_duration.sum"])] if rows else []
    for name, m in rows:
        print(f"{m['gpu__time_duration.sum'] * 1e6:8.1f} {m['sm__cycles_elapsed.avg.per_second'] / 1e9:5.2f} "
              f"{m['sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed']:7.1f} "
              f"{m['l1tex__m_xbar2l1tex_read_bytes.sum'] / 1e6:9.0f} {m['lts__t_bytes.sum'] / 1e6:7.0f} {m['dram__bytes_read.sum'] / 1e6:6.0f}/{m['dram__bytes_write.sum'] / 1e6:<6.0f} "
              f"{m['launch__grid_size']:5.0f} {m['launch__cluster_dim_x']:.0f}x{m['launch__cluster_dim_y']:.0f}      {name[:90]}")
PY
done | tee "$out/summary.txt"
